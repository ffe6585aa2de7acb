"""Each announced change of an account's credentials is also counted, per user, in
``credential_changes``, so that a process whose relay was cut off from the database when
a change was announced (a notification is sent only to the sessions listening at that
moment) learns on reconnecting whose credentials changed meanwhile: it compares each
user's count with the one it read when it last connected (board.relay), and closes those
users' streams held in Pushpin at once (board.revocation) instead of leaving them to the
periodic re-check.

One row per user whose credentials ever changed, updated in the transaction that makes
the change, and read only by a relay that connects. A logout (announced by the access app)
goes through the same function, announce_credentials_changed().
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
    PERFORM announce_credentials_changed(changed);
    RETURN NULL;
END $$;
"""

BACKWARD = f"""
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
    dependencies = [("board", "0014_credentials_changed")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
