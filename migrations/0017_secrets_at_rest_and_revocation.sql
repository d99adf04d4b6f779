-- Idempotency keys are kept 24 hours: an index finds the expired ones to purge.
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);

-- Stored answers of token creations held the new token in the clear; replays now keep it
-- sealed. Those rows are dropped: such a key is treated as new from now on.
DELETE FROM idempotency_keys WHERE response IS NOT NULL AND response ? 'token';

-- A browser session revoked, cut short or deleted ends what it opened (event streams,
-- waits) on every replica: it announces itself on `agentry_auth` like the changes of
-- migration 0014. Its use (`last_seen_at`, `idle_expires_at` pushed forward) does not.
CREATE TRIGGER user_sessions_auth_changed
    AFTER UPDATE OF user_id, session_hash, absolute_expires_at, revoked_at, groups
       OR DELETE OR TRUNCATE ON user_sessions
    FOR EACH STATEMENT EXECUTE FUNCTION agentry_auth_changed();
