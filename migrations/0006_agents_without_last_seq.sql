-- An agent's last seq is read from its timeline (`max(seq)` on the primary key), never
-- stored: the writer stopped updating this column so that no row lock is held across a
-- batch's commit. The column has held 0 since; it goes.
ALTER TABLE agents DROP COLUMN last_seq;
