-- Replicas hold the principals of recently used API tokens (who the caller is, their
-- teams and roles). Whatever could change a principal — a token revoked or re-scoped, a
-- member added, removed or given another role, a user or team changed or deleted —
-- announces itself on `agentry_auth` when it commits, whoever wrote it: every listening
-- replica then forgets what it holds. Recording a token's last use does not announce.
CREATE FUNCTION agentry_auth_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('agentry_auth', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER api_tokens_auth_changed
    AFTER UPDATE OF user_id, team_id, role, token_hash, scopes, expires_at, revoked_at
       OR DELETE OR TRUNCATE ON api_tokens
    FOR EACH STATEMENT EXECUTE FUNCTION agentry_auth_changed();

CREATE TRIGGER users_auth_changed
    AFTER UPDATE OR DELETE OR TRUNCATE ON users
    FOR EACH STATEMENT EXECUTE FUNCTION agentry_auth_changed();

CREATE TRIGGER teams_auth_changed
    AFTER UPDATE OR DELETE OR TRUNCATE ON teams
    FOR EACH STATEMENT EXECUTE FUNCTION agentry_auth_changed();

CREATE TRIGGER team_members_auth_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON team_members
    FOR EACH STATEMENT EXECUTE FUNCTION agentry_auth_changed();
