-- Agents as callers and as parents. An agent gets a token of its own at each launch
-- (kind `agent`: `api_tokens.agent_id` names it); an agent created with such a token
-- records its parent and its depth in the tree (a root agent is at depth 0). An agent
-- may be created without agentry's own MCP server, and a team's owners may turn it off
-- for every agent of the team.
ALTER TABLE api_tokens ADD COLUMN agent_id uuid REFERENCES agents (id) ON DELETE CASCADE;
CREATE INDEX api_tokens_agent ON api_tokens (agent_id) WHERE agent_id IS NOT NULL;

ALTER TABLE agents ADD COLUMN parent_agent_id uuid REFERENCES agents (id) ON DELETE SET NULL;
ALTER TABLE agents ADD COLUMN depth integer NOT NULL DEFAULT 0;
ALTER TABLE agents ADD COLUMN agentry_mcp boolean NOT NULL DEFAULT true;
-- The role its creator had in the team when it was created: its token never has more.
ALTER TABLE agents ADD COLUMN creator_role text
    CHECK (creator_role IN ('owner', 'member', 'viewer'));
CREATE INDEX agents_parent ON agents (parent_agent_id) WHERE parent_agent_id IS NOT NULL;

ALTER TABLE teams ADD COLUMN agentry_mcp boolean NOT NULL DEFAULT true;
