-- Performance (issue 16): a settled call's charge commits with the journal's next batch (the
-- run's next step or its end) instead of in a transaction of its own, so the common request
-- commits once before its answer, as on the embedded store.
--
-- Records every charge of `charges`, each {record: {id, at, request_id, run_id, owner,
-- agent_id, session_id, model, source, prompt_tokens, completion_tokens, cost_nanos,
-- estimated}, hold, deltas: [{budget, subject, bucket, tokens, cost_nanos}]}: its
-- reservation released, its ledger record inserted and, if that record is new, its deltas
-- added to the counters. A charge written again (a batch retried after its reply was lost)
-- counts once. The counters are added in one statement, summed per counter and in key order,
-- so two batches updating the same counters lock them in one order and never deadlock.
-- Returns how many charges were new.
CREATE FUNCTION stable_harness_record_usage(charges jsonb) RETURNS integer
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    charge jsonb;
    counted jsonb := '[]'::jsonb;
    recorded integer := 0;
BEGIN
    FOR charge IN SELECT value FROM jsonb_array_elements(charges) LOOP
        DELETE FROM budget_reservations WHERE hold_id = charge->>'hold';
        INSERT INTO usage_records (id, at, request_id, run_id, owner, agent_id, session_id,
            model, source, prompt_tokens, completion_tokens, cost_nanos, estimated)
        SELECT r.id, r.at, r.request_id, r.run_id, r.owner, r.agent_id, r.session_id,
            r.model, r.source, r.prompt_tokens, r.completion_tokens, r.cost_nanos, r.estimated
          FROM jsonb_to_record(charge->'record') AS r(id text, at timestamptz, request_id text,
            run_id text, owner text, agent_id text, session_id text, model text, source text,
            prompt_tokens bigint, completion_tokens bigint, cost_nanos bigint, estimated boolean)
        ON CONFLICT (id) DO NOTHING;
        IF FOUND THEN
            recorded := recorded + 1;
            counted := counted || COALESCE(charge->'deltas', '[]'::jsonb);
        END IF;
    END LOOP;
    INSERT INTO budget_usage (budget, subject, bucket, tokens, cost_nanos)
    SELECT d.budget, d.subject, d.bucket, SUM(d.tokens), SUM(d.cost_nanos)
      FROM jsonb_to_recordset(counted)
           AS d(budget text, subject text, bucket bigint, tokens bigint, cost_nanos bigint)
     GROUP BY d.budget, d.subject, d.bucket
     ORDER BY d.budget, d.subject, d.bucket
    ON CONFLICT (budget, subject, bucket) DO UPDATE
       SET tokens = budget_usage.tokens + excluded.tokens,
           cost_nanos = budget_usage.cost_nanos + excluded.cost_nanos;
    RETURN recorded;
END;
$$;
