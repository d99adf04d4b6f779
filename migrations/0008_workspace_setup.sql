-- Repository setup scripts (`.agentry.toml`, `[worktree] setup`): a workspace whose setup
-- failed stays usable but says so, and keeps what its commands printed.
ALTER TABLE workspaces DROP CONSTRAINT workspaces_status_check;
ALTER TABLE workspaces ADD CONSTRAINT workspaces_status_check
    CHECK (status IN ('active', 'setup_failed', 'archived'));
ALTER TABLE workspaces
    ADD COLUMN setup_status text CHECK (setup_status IN ('running', 'succeeded', 'failed')),
    ADD COLUMN setup_output text,
    -- The replica running the setup, so a restart fails only its own interrupted runs.
    ADD COLUMN setup_replica text;
