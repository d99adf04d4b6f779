-- Users from an OpenID Connect provider, and browser sessions.
--
-- An IdP user is identified by (issuer, subject), never by email: providers let people
-- change their address, several providers may share one, and some send none. So the
-- email of an IdP user is informational (refreshed at every sign-in, '' when the
-- provider sends none) and only local users' emails stay unique — they are how the
-- server finds its bootstrap admin. Local users keep a null issuer and subject.

ALTER TABLE users ADD COLUMN oidc_issuer text, ADD COLUMN oidc_subject text;
ALTER TABLE users ADD CONSTRAINT users_oidc_identity UNIQUE (oidc_issuer, oidc_subject);
ALTER TABLE users ADD CONSTRAINT users_oidc_pair
    CHECK ((oidc_issuer IS NULL) = (oidc_subject IS NULL));
ALTER TABLE users DROP CONSTRAINT users_email_key;
CREATE UNIQUE INDEX users_local_email ON users (email) WHERE oidc_issuer IS NULL;

-- Browser sessions: the cookie carries a random id; only its SHA-256 is stored. A session
-- ends at `idle_expires_at` (pushed forward by use) or `absolute_expires_at`, whichever
-- comes first, or when revoked (sign-out).
CREATE TABLE user_sessions (
    id                   uuid PRIMARY KEY,
    user_id              uuid NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    session_hash         bytea NOT NULL UNIQUE,
    created_at           timestamptz NOT NULL DEFAULT now(),
    last_seen_at         timestamptz NOT NULL DEFAULT now(),
    idle_expires_at      timestamptz NOT NULL,
    absolute_expires_at  timestamptz NOT NULL,
    revoked_at           timestamptz,
    -- The IdP identity the session stands for: group mapping is re-applied from it.
    groups               text[] NOT NULL DEFAULT '{}'
);
CREATE INDEX user_sessions_user ON user_sessions (user_id);

-- A sign-in in progress: state → the PKCE verifier and nonce, kept server-side for a few
-- minutes and used once.
CREATE TABLE oidc_logins (
    state_hash     bytea PRIMARY KEY,
    code_verifier  text NOT NULL,
    nonce          text NOT NULL,
    return_to      text NOT NULL,
    expires_at     timestamptz NOT NULL
);
