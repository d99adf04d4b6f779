-- Large event data (a whole assistant message, a tool's output) is compressed when it is
-- stored, inside the writer's statement, while every agent's events wait for it. pglz,
-- PostgreSQL's default, is the slow part of the statement that stores 20 messages of
-- 220 kB at once; lz4 compresses several times faster. Only a server built with lz4 offers
-- it: elsewhere the default stays. Rows already stored keep their compression.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_settings
               WHERE name = 'default_toast_compression' AND 'lz4' = ANY (enumvals)) THEN
        ALTER TABLE agent_events ALTER COLUMN data SET COMPRESSION lz4;
    END IF;
END
$$;
