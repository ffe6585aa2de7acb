-- Changes of an account's credentials, announced at commit (NOTIFY credentials_changed,
-- with the user's id) so that every server process acts on them at once (board.live.revocation):
-- its token cache forgets the user, and its open streams are checked again. Triggers
-- rather than signals, so that every writer is covered (the admin, create_agent, a
-- queryset update, psql).


-- Count one change of a user's credentials in credential_changes and announce it. The
-- count lets a relay that was cut off from the database when a change was announced learn,
-- on reconnecting, whose credentials changed meanwhile (board.live.relay). A logout (announced
-- by the access app) goes through here too.
CREATE OR REPLACE FUNCTION announce_credentials_changed(changed bigint) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO credential_changes AS c (user_id, changes) VALUES (changed, 1)
    ON CONFLICT (user_id) DO UPDATE SET changes = c.changes + 1;
    SELECT pg_notify('credentials_changed', changed::text);
$$;

-- Announce whose credentials a row change touches: a token rotated or deleted; a queue
-- limit set, changed or cleared; a user deactivated, reactivated, given a new password
-- (which ends their sessions), made staff or superuser or no longer, or deleted; a
-- permission or a group given or taken; a permission given to or taken from a group (for
-- each member). The token cache holds the user with their permissions, so each of these
-- must reach it.
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

DROP TRIGGER IF EXISTS credentials_changed ON auth_user;
CREATE TRIGGER credentials_changed AFTER UPDATE OR DELETE ON auth_user
FOR EACH ROW EXECUTE FUNCTION credentials_changed();

DROP TRIGGER IF EXISTS credentials_changed ON api_tokens;
CREATE TRIGGER credentials_changed AFTER UPDATE OR DELETE ON api_tokens
FOR EACH ROW EXECUTE FUNCTION credentials_changed();

DROP TRIGGER IF EXISTS credentials_changed ON queue_limits;
CREATE TRIGGER credentials_changed AFTER INSERT OR UPDATE OR DELETE ON queue_limits
FOR EACH ROW EXECUTE FUNCTION credentials_changed();

DROP TRIGGER IF EXISTS credentials_changed ON auth_user_user_permissions;
CREATE TRIGGER credentials_changed AFTER INSERT OR UPDATE OR DELETE ON auth_user_user_permissions
FOR EACH ROW EXECUTE FUNCTION credentials_changed();

DROP TRIGGER IF EXISTS credentials_changed ON auth_user_groups;
CREATE TRIGGER credentials_changed AFTER INSERT OR UPDATE OR DELETE ON auth_user_groups
FOR EACH ROW EXECUTE FUNCTION credentials_changed();

DROP TRIGGER IF EXISTS credentials_changed ON auth_group_permissions;
CREATE TRIGGER credentials_changed AFTER INSERT OR UPDATE OR DELETE ON auth_group_permissions
FOR EACH ROW EXECUTE FUNCTION credentials_changed();
