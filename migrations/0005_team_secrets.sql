-- Team secrets: a team's credentials for its agents' providers (ANTHROPIC_API_KEY, …),
-- encrypted by the server with AES-256-GCM. A row holds no plaintext: `key_id` names the
-- key that sealed it (a fingerprint, never the key), `nonce` is the 96-bit nonce chosen
-- for this value, `ciphertext` the sealed value with its tag. The team id and the name
-- are bound into the tag as associated data, so a row copied to another team or name
-- does not decrypt.

CREATE TABLE team_secrets (
    team_id     uuid NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    name        text NOT NULL CHECK (name ~ '^[A-Z_][A-Z0-9_]{0,127}$'),
    key_id      text NOT NULL,
    nonce       bytea NOT NULL CHECK (length(nonce) = 12),
    ciphertext  bytea NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    updated_by  uuid REFERENCES users(id) ON DELETE SET NULL,
    PRIMARY KEY (team_id, name)
);
CREATE INDEX team_secrets_key ON team_secrets (key_id);
