-- Device authorization (RFC 8628) for clients without a browser, such as `agentry login`:
-- the client gets a device code (kept secret) and a user code (shown to its person), the
-- person approves the user code in the dashboard, and the client collects a new API token
-- with its device code. Both codes are stored hashed; a code lives ten minutes and is used
-- once. The token is generated when the client collects it (a personal token of the
-- approver, audited as their `token.create`), so no secret is ever stored here.
CREATE TABLE device_codes (
    id uuid PRIMARY KEY,
    device_code_hash bytea NOT NULL UNIQUE,
    user_code_hash bytea NOT NULL UNIQUE,
    -- What the client says it is ("agentry CLI on build-7"), shown to the approver and
    -- used as the token's name.
    client_name text NOT NULL,
    -- Where the request came from (the connection's address), for rate limiting.
    client_ip text NOT NULL,
    interval_s integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    last_polled_at timestamptz,
    status text NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'approved', 'denied', 'used')),
    answered_by uuid REFERENCES users (id) ON DELETE CASCADE,
    -- How the approver acted (`user` or `admin`), for the audit entry of the token.
    answered_kind text,
    answered_at timestamptz,
    -- The approver's token scopes at approval: the new token gets no more.
    token_scopes text[],
    token_id uuid REFERENCES api_tokens (id) ON DELETE SET NULL
);

CREATE INDEX device_codes_by_ip ON device_codes (client_ip, created_at);
CREATE INDEX device_codes_expiry ON device_codes (expires_at);
