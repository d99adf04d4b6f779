-- The per-team limits of `[limits]` count a team's live agents and workspaces on every
-- creation: partial indexes keep that count to the team's live rows.
CREATE INDEX agents_team_live ON agents (team_id) WHERE archived_at IS NULL;
CREATE INDEX workspaces_team_live ON workspaces (team_id) WHERE archived_at IS NULL;
