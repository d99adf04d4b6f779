-- A webhook delivery is answered as soon as its run is recorded; a worker acts on it
-- afterwards. A run waits `pending` until a replica's worker claims it (`running`, with
-- a lease it renews while it acts; `attempt` counts the claims, so a worker that lost
-- its lease cannot record over the next one), then ends `done` or `failed`. What the run
-- is to do is kept in `work` until then; `outcome` is known only when it ends.
ALTER TABLE trigger_runs
    ADD COLUMN state text NOT NULL DEFAULT 'done'
        CHECK (state IN ('pending', 'running', 'done', 'failed')),
    ADD COLUMN work jsonb,
    ADD COLUMN lease_until timestamptz,
    ADD COLUMN attempt integer NOT NULL DEFAULT 0,
    ALTER COLUMN outcome DROP NOT NULL;
CREATE INDEX trigger_runs_unfinished ON trigger_runs (id) WHERE state IN ('pending', 'running');
