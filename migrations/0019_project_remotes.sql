-- Projects cloned from a git remote: the URL (never with credentials) and the name of
-- the team secret that authenticates to it. `repo_path` of such a project is the bare
-- clone the server keeps.
ALTER TABLE projects ADD COLUMN git_url text;
ALTER TABLE projects ADD COLUMN credential_secret text;
CREATE INDEX projects_repo_path ON projects (repo_path) WHERE deleted_at IS NULL;
