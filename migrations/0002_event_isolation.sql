-- Inserts agent events one at a time, each in its own subtransaction, and reports the ones
-- the database refuses for their content (data exceptions, integrity and program limits,
-- trigger refusals) instead of failing the whole statement. The event writer calls it only
-- for a batch that was refused, to set the refused events aside in one round trip; `data`
-- arrives as text so that even invalid JSON is refused row by row. A seq slot already
-- taken is not the row's content: it fails the call as before.
CREATE FUNCTION agentry_insert_events_each(
    p_agent_ids uuid[],
    p_seqs int8[],
    p_turns uuid[],
    p_kinds text[],
    p_data text[],
    p_ats timestamptz[]
) RETURNS TABLE (idx int, code text, message text)
LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_seqs, 1), 0) LOOP
        BEGIN
            INSERT INTO agent_events (agent_id, seq, turn_id, kind, data, created_at)
            VALUES (p_agent_ids[i], p_seqs[i], p_turns[i], p_kinds[i], p_data[i]::jsonb, p_ats[i]);
        EXCEPTION
            WHEN unique_violation THEN
                RAISE;
            WHEN data_exception OR integrity_constraint_violation OR program_limit_exceeded
                 OR plpgsql_error THEN
                idx := i - 1;
                code := SQLSTATE;
                message := SQLERRM;
                RETURN NEXT;
        END;
    END LOOP;
END
$$;
