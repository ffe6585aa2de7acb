"""Each announced change of an account's credentials is also counted, per user, in
``credential_changes``, so that a process whose relay was cut off from the database when
a change was announced (a notification is sent only to the sessions listening at that
moment) learns on reconnecting whose credentials changed meanwhile: it compares each
user's count with the one it read when it last connected (board.live.relay), and closes those
users' streams held in Pushpin at once (board.live.revocation) instead of leaving them to the
periodic re-check.

One row per user whose credentials ever changed, updated in the transaction that makes
the change, and read only by a relay that connects. A logout (announced by the access app)
goes through the same function, announce_credentials_changed().

A change of what an account may do is announced too, since the token cache holds the user
with their permissions: made staff or superuser or no longer, a permission or a group
given or taken, a permission given to or taken from a group (announced for each member).
Without it a triager whose permission was taken kept it for up to
TASKBOARD_TOKEN_CACHE_SECONDS.
"""

from django.db import migrations

CHANNEL = "credentials_changed"

FORWARD = f"""
CREATE TABLE credential_changes (
    user_id bigint PRIMARY KEY,
    changes bigint NOT NULL
);

CREATE FUNCTION announce_credentials_changed(changed bigint) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO credential_changes AS c (user_id, changes) VALUES (changed, 1)
    ON CONFLICT (user_id) DO UPDATE SET changes = c.changes + 1;
    SELECT pg_notify('{CHANNEL}', changed::text);
$$;

CREATE OR REPLACE FUNCTION credentials_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    changed bigint;
    affected record;
BEGIN
    IF TG_OP = 'DELETE' THEN
        affected := OLD;
    ELSE
        affected := NEW;
    END IF;
    IF TG_TABLE_NAME = 'auth_user' THEN
        IF TG_OP = 'UPDATE' AND OLD.is_active IS NOT DISTINCT FROM NEW.is_active
                AND OLD.password IS NOT DISTINCT FROM NEW.password
                AND OLD.is_staff IS NOT DISTINCT FROM NEW.is_staff
                AND OLD.is_superuser IS NOT DISTINCT FROM NEW.is_superuser THEN
            RETURN NULL;  -- last_login and the like: nothing to revoke
        END IF;
        changed := OLD.id;
    ELSIF TG_TABLE_NAME = 'auth_group_permissions' THEN
        PERFORM announce_credentials_changed(member.user_id)
        FROM auth_user_groups AS member WHERE member.group_id = affected.group_id;
        IF TG_OP = 'UPDATE' AND OLD.group_id <> NEW.group_id THEN
            PERFORM announce_credentials_changed(member.user_id)
            FROM auth_user_groups AS member WHERE member.group_id = OLD.group_id;
        END IF;
        RETURN NULL;
    ELSE
        changed := affected.user_id;
        IF TG_OP = 'UPDATE' AND OLD.user_id <> NEW.user_id THEN
            PERFORM announce_credentials_changed(OLD.user_id);
        END IF;
    END IF;
    PERFORM announce_credentials_changed(changed);
    RETURN NULL;
END $$;

CREATE TRIGGER credentials_changed AFTER INSERT OR UPDATE OR DELETE ON auth_user_user_permissions
FOR EACH ROW EXECUTE FUNCTION credentials_changed();
CREATE TRIGGER credentials_changed AFTER INSERT OR UPDATE OR DELETE ON auth_user_groups
FOR EACH ROW EXECUTE FUNCTION credentials_changed();
CREATE TRIGGER credentials_changed AFTER INSERT OR UPDATE OR DELETE ON auth_group_permissions
FOR EACH ROW EXECUTE FUNCTION credentials_changed();
"""

BACKWARD = f"""
DROP TRIGGER credentials_changed ON auth_group_permissions;
DROP TRIGGER credentials_changed ON auth_user_groups;
DROP TRIGGER credentials_changed ON auth_user_user_permissions;
CREATE OR REPLACE FUNCTION credentials_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    changed bigint;
BEGIN
    IF TG_TABLE_NAME = 'auth_user' THEN
        IF TG_OP = 'UPDATE' AND OLD.is_active IS NOT DISTINCT FROM NEW.is_active
                AND OLD.password IS NOT DISTINCT FROM NEW.password THEN
            RETURN NULL;
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

DROP FUNCTION announce_credentials_changed(bigint);
DROP TABLE credential_changes;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("board", "0014_credentials_changed"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
