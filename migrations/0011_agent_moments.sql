-- Moments of an agent's life that lifecycle hooks hear about (a turn started or ended, a
-- permission was requested or resolved, the agent closed). The event writer stores each
-- in the same transaction as the timeline event that records it, so a moment exists
-- exactly when its event does, crash or not. A worker turns each row into the outbox rows
-- (`hook_deliveries`) of the hooks it concerns and deletes it, in one transaction; rows a
-- crash left behind are handled after the restart. `seq` is the event's seq.

CREATE TABLE agent_moments (
    id          bigserial PRIMARY KEY,
    agent_id    uuid NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    seq         bigint NOT NULL,
    kind        text NOT NULL,
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
