-- The parent of the agent a ledger row is for, when another agent created it (through
-- agentry's MCP server or its token): copied from the agent when the row is written, as
-- the rest of the row's attribution is. The person (or service token) stays the one who
-- answers for the spend; the parent says which agent spent it on their behalf.
ALTER TABLE usage_ledger ADD COLUMN parent_agent_id uuid;
CREATE INDEX usage_ledger_parent ON usage_ledger (parent_agent_id) WHERE parent_agent_id IS NOT NULL;
