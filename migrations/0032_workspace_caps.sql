-- Caps on a workspace over its whole life: what every agent in it spent together. Set
-- by the team's owners; a turn that reaches one is interrupted like one reaching a team
-- budget.
CREATE TABLE workspace_caps (
    workspace_id  uuid PRIMARY KEY REFERENCES workspaces(id),
    max_cost_usd  double precision CHECK (max_cost_usd IS NULL OR max_cost_usd >= 0),
    max_turns     bigint CHECK (max_turns IS NULL OR max_turns >= 0),
    max_wall_s    bigint CHECK (max_wall_s IS NULL OR max_wall_s >= 0),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
