-- Prompts that wait: follow-ups sent while their agent runs a turn (`agent_busy`), and
-- prompts over the running-turn limits of `[limits]` (`capacity`). A row waits in state
-- `queued`; the replica that runs its agent (or any, for an agent no replica runs) starts
-- it and marks it `started` with its turn, in one transaction holding the row.
CREATE TABLE queued_messages (
    id                 uuid PRIMARY KEY,
    -- Arrival order, across agents and teams.
    seq                bigserial NOT NULL UNIQUE,
    agent_id           uuid NOT NULL REFERENCES agents(id),
    team_id            uuid NOT NULL REFERENCES teams(id),
    text               text NOT NULL,
    client_message_id  text,
    -- Steering: sent before the agent's other waiting messages, after the interrupted turn.
    interrupt          boolean NOT NULL DEFAULT false,
    -- Who sent it (authorized then), to start it on their behalf.
    created_by         uuid,
    token_id           uuid,
    reason             text NOT NULL CHECK (reason IN ('agent_busy', 'capacity')),
    state              text NOT NULL CHECK (state IN ('queued', 'started', 'canceled', 'failed')),
    turn_id            uuid,
    error              text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    -- When it started, was canceled or failed.
    ended_at           timestamptz
);
CREATE INDEX queued_messages_waiting ON queued_messages (agent_id, interrupt DESC, seq)
    WHERE state = 'queued';
CREATE INDEX queued_messages_agent ON queued_messages (agent_id, seq);

-- Round-robin between teams: the order in which teams were last given a running turn.
CREATE SEQUENCE capacity_turns;
CREATE TABLE capacity_served (
    team_id      uuid PRIMARY KEY REFERENCES teams(id),
    last_served  bigint NOT NULL
);
