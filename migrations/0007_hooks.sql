-- Lifecycle hooks (webhooks) and their durable outbox.
-- `hooks`: a team's hooks (team_id set) and server-wide ones (team_id null), made through
-- the API or read from the settings file (`settings_position` set: the hook's place in
-- the file; such rows are rewritten at every start and read-only in the API). The
-- signing secret is sealed like team secrets (AES-256-GCM, key id + nonce + ciphertext).
-- `hook_deliveries`: one row per notification to send, holding the exact body sent on
-- every attempt; workers claim due rows with FOR UPDATE SKIP LOCKED.

CREATE TABLE hooks (
    id                 uuid PRIMARY KEY,
    team_id            uuid REFERENCES teams(id) ON DELETE CASCADE,
    name               text NOT NULL,
    events             text[] NOT NULL,
    url                text NOT NULL,
    key_id             text NOT NULL,
    nonce              bytea NOT NULL CHECK (length(nonce) = 12),
    ciphertext         bytea NOT NULL,
    project_id         uuid REFERENCES projects(id) ON DELETE CASCADE,
    labels             jsonb NOT NULL DEFAULT '{}',
    enabled            boolean NOT NULL DEFAULT true,
    settings_position  integer,
    created_at         timestamptz NOT NULL DEFAULT now(),
    created_by         uuid REFERENCES users(id) ON DELETE SET NULL
);
CREATE INDEX hooks_team ON hooks (team_id, created_at, id);
CREATE INDEX hooks_events ON hooks USING gin (events);

CREATE TABLE hook_deliveries (
    id               uuid PRIMARY KEY,
    hook_id          uuid NOT NULL REFERENCES hooks(id) ON DELETE CASCADE,
    hook_name        text NOT NULL,
    event            text NOT NULL,
    team_id          uuid,
    body             text NOT NULL,
    status           text NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts         integer NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    retry_until      timestamptz NOT NULL,
    response_status  integer,
    error            text,
    duration_ms      integer,
    created_at       timestamptz NOT NULL DEFAULT now(),
    delivered_at     timestamptz
);
CREATE INDEX hook_deliveries_due ON hook_deliveries (next_attempt_at) WHERE status = 'pending';
CREATE INDEX hook_deliveries_hook ON hook_deliveries (hook_id, id DESC);
