-- Performance (issue 16): the ledger of charges keeps one index for its key and its request,
-- as on the embedded store (its migration 0013). A charge was found by its key (`ON CONFLICT`
-- writes it once) and by its request, through two indexes. Its id is made for it alone, so
-- the pair (request, id) is as unique as the id: the key becomes that pair, and a charge's
-- insert updates one index instead of two (with `usage_records_at`, two instead of three).
ALTER TABLE usage_records DROP CONSTRAINT usage_records_pkey;
DROP INDEX usage_records_request;
ALTER TABLE usage_records ADD CONSTRAINT usage_records_pkey PRIMARY KEY (request_id, id);

-- 0009's function, writing each charge once by the new key.
CREATE OR REPLACE FUNCTION stable_harness_record_usage(charges jsonb) RETURNS integer
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
        ON CONFLICT (request_id, id) DO NOTHING;
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
