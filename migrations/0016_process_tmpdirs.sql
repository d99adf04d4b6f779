-- A process's own temporary directory (its TMPDIR), recorded so that whoever reconciles
-- the row after a crash removes what the process left there. NULL: the process used the
-- server's TMPDIR.
ALTER TABLE managed_processes ADD COLUMN tmpdir text;
