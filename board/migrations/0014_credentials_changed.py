"""A change of an account's credentials is announced at commit (NOTIFY credentials_changed,
with the user's id), so that every server process acts on it at once (board.live.revocation):
its token cache forgets the user, and its open streams are checked again. Without it a
revoked token went on streaming until the next re-check, TASKBOARD_TOKEN_CACHE_SECONDS
(streams held in Pushpin still wait for theirs: board.live.revocation).

Triggers rather than signals, so that every writer is covered (the admin, create_agent,
a queryset update, psql). A change is: a token rotated or deleted; a queue limit set,
changed or cleared; a user deactivated, reactivated, given a new password (which ends
their sessions) or deleted. A logout is announced by the access app (user_logged_out).
"""

from django.conf import settings
from django.db import migrations

CHANNEL = "credentials_changed"

TRIGGERS = f"""
CREATE FUNCTION credentials_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    changed bigint;
BEGIN
    IF TG_TABLE_NAME = 'auth_user' THEN
        IF TG_OP = 'UPDATE' AND OLD.is_active IS NOT DISTINCT FROM NEW.is_active
                AND OLD.password IS NOT DISTINCT FROM NEW.password THEN
            RETURN NULL;  -- last_login and the like: nothing to revoke
        END IF;
        changed := OLD.id;
    ELSIF TG_OP = 'INSERT' THEN
        changed := NEW.user_id;
    ELSE
        changed := OLD.user_id;
    END IF;
    PERFORM pg_notify('{CHANNEL}', changed::text);
    RETURN NULL;
END $$;

CREATE TRIGGER credentials_changed AFTER UPDATE OR DELETE ON auth_user
FOR EACH ROW EXECUTE FUNCTION credentials_changed();
CREATE TRIGGER credentials_changed AFTER UPDATE OR DELETE ON api_tokens
FOR EACH ROW EXECUTE FUNCTION credentials_changed();
CREATE TRIGGER credentials_changed AFTER INSERT OR UPDATE OR DELETE ON queue_limits
FOR EACH ROW EXECUTE FUNCTION credentials_changed();
"""

DROP = """
DROP TRIGGER credentials_changed ON queue_limits;
DROP TRIGGER credentials_changed ON api_tokens;
DROP TRIGGER credentials_changed ON auth_user;
DROP FUNCTION credentials_changed();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("board", "0013_event_counters"),
        ("access", "0001_initial"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [migrations.RunSQL(TRIGGERS, DROP)]
