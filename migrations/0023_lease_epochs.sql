-- Fencing: each ownership of an agent has an epoch. It grows whenever the agent passes to
-- another replica (a claim of an agent another replica held, a take-over of an expired
-- lease). The owner's actor writes with the epoch it started with, and the event writer
-- stores its batch only while the agent's row still has that epoch, checked in the same
-- statement (the row locked): a replica deposed while it was paused or cut off cannot
-- write into a timeline that another replica now owns.
ALTER TABLE agents ADD COLUMN lease_epoch bigint NOT NULL DEFAULT 0;
