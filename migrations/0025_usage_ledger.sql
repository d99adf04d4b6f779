-- The usage ledger: one row per ended turn, written once at the turn's end (the turn id
-- is the key, so a retried or repeated write changes nothing), never per event. What a
-- row is attributed to is copied from the agent when it is written, so the ledger stays
-- whole when agents, workspaces or projects are archived.
CREATE TABLE usage_ledger (
    turn_id              uuid PRIMARY KEY,
    team_id              uuid NOT NULL REFERENCES teams(id),
    agent_id             uuid NOT NULL,
    workspace_id         uuid NOT NULL,
    project_id           uuid NOT NULL,
    -- The person who created the agent, and the service token it was created with (a
    -- team's token acts for the team, not for the person who issued it).
    created_by           uuid,
    service_token_id     uuid,
    provider             text NOT NULL,
    model                text,
    input_tokens         bigint NOT NULL DEFAULT 0,
    output_tokens        bigint NOT NULL DEFAULT 0,
    cached_input_tokens  bigint NOT NULL DEFAULT 0,
    cost_usd             double precision NOT NULL DEFAULT 0,
    -- `reported` (the CLI's own figure), `estimated` (the settings' price table) or
    -- `unknown` (neither: counted as 0).
    cost_source          text NOT NULL CHECK (cost_source IN ('reported', 'estimated', 'unknown')),
    wall_ms              bigint NOT NULL DEFAULT 0,
    started_at           timestamptz NOT NULL,
    ended_at             timestamptz NOT NULL
);
CREATE INDEX usage_ledger_team_time ON usage_ledger (team_id, ended_at);
CREATE INDEX usage_ledger_agent ON usage_ledger (agent_id);

-- A team's budget for a period (only `month`, calendar months in UTC).
CREATE TABLE team_budgets (
    team_id       uuid PRIMARY KEY REFERENCES teams(id),
    period        text NOT NULL CHECK (period IN ('month')),
    max_cost_usd  double precision CHECK (max_cost_usd IS NULL OR max_cost_usd >= 0),
    max_tokens    bigint CHECK (max_tokens IS NULL OR max_tokens >= 0),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

-- The service token an agent was created with, when it was one: its usage is the
-- token's, not its issuer's.
CREATE TABLE agent_service_tokens (
    agent_id   uuid PRIMARY KEY REFERENCES agents(id),
    token_id   uuid NOT NULL
);

-- Caps an agent was created with: over its whole life.
CREATE TABLE agent_caps (
    agent_id      uuid PRIMARY KEY REFERENCES agents(id),
    max_cost_usd  double precision,
    max_turns     bigint,
    max_wall_s    bigint
);

-- The budget thresholds a team was told of, once per period and threshold.
CREATE TABLE budget_notices (
    team_id       uuid NOT NULL REFERENCES teams(id),
    period_start  timestamptz NOT NULL,
    budget        text NOT NULL,
    percent       integer NOT NULL,
    PRIMARY KEY (team_id, period_start, budget, percent)
);
