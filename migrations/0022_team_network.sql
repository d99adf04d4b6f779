-- What a team's owners add to the allow lists of the team's agents (egress proxy):
-- one row per team that set any, entries validated by the service (`host`, `*.suffix`,
-- `*` or an IP literal, each with an optional `:port`).
CREATE TABLE team_network (
    team_id     uuid PRIMARY KEY REFERENCES teams (id) ON DELETE CASCADE,
    allow       text[] NOT NULL DEFAULT '{}',
    updated_at  timestamptz NOT NULL DEFAULT now(),
    updated_by  uuid
);
