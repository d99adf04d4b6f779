-- Several replicas on one database: each running server registers itself here and
-- renews `last_seen_at`; each live agent is owned by one replica through
-- `agents.owner_replica` / `agents.lease_expires_at` (columns from 0001, used from now on).
CREATE TABLE replicas (
    id            text PRIMARY KEY,
    advertise_url text NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX agents_owner ON agents (owner_replica) WHERE owner_replica IS NOT NULL;
