-- The forge a cloned project lives on (for pull requests), and what a workspace sent
-- back to the project's remote: the pull/merge request it started from, its last push
-- and the pull/merge request opened for it.
ALTER TABLE projects
    ADD COLUMN forge text CHECK (forge IN ('github', 'gitlab')),
    ADD COLUMN forge_api_url text,
    ADD COLUMN forge_repo text;

CREATE TABLE workspace_remotes (
    workspace_id      uuid PRIMARY KEY REFERENCES workspaces(id),
    -- The pull/merge request number the workspace was made from, and the ref fetched.
    source_pull_request bigint,
    source_ref        text,
    -- The last push: the remote branch, the commit, when, and whether it was forced.
    pushed_branch     text,
    pushed_commit     text,
    pushed_at         timestamptz,
    pushed_forced     boolean,
    -- The pull/merge request opened for the workspace's branch, and its last known state.
    pr_number         bigint,
    pr_url            text,
    pr_state          text,
    pr_checks         text,
    pr_refreshed_at   timestamptz
);
