-- Leases per replica. A replica renews one row (its own) instead of the row of every agent
-- it runs: a live agent's lease is its owner replica's lease, or its own
-- `agents.lease_expires_at` while that has not run out (set when an agent is claimed, and
-- renewed by replicas of the previous version, which know only that one). NULL in rows
-- that a replica of the previous version wrote: while such a replica runs, the others
-- renew their agents' own leases too, so that it does not take their agents over.
ALTER TABLE replicas ADD COLUMN lease_expires_at timestamptz;
