-- A team's owners may require that its agents run sandboxed: on a server whose sandbox
-- is off or unavailable, creating or prompting an agent of such a team is refused.
ALTER TABLE teams ADD COLUMN require_sandbox boolean NOT NULL DEFAULT false;
