-- Performance (issue 16): fewer statements a batch on PostgreSQL. Each statement the batch
-- function runs costs its own executor set-up and PL/pgSQL's turn around it, whatever its
-- rows (a chat request's batch ran about twenty, with their foreign-key checks; setting up
-- executors was 18.5% of the writer lanes' CPU). Three changes:
--
-- - The inserts of a batch's sessions, requests, runs and messages come first, one op of
--   rows for each kind (`touch_sessions`, `insert_requests`, `insert_runs`,
--   `insert_messages`), each written in one statement whatever the number of rows: the
--   common request's two messages in one, and a batch of several requests (at concurrency)
--   their sessions, requests, runs and messages in four. The writer sends them in that order,
--   ahead of the batch's other ops: an insert only needs the rows it names (its session, its
--   request), which come before it, and no op removes a row, so a batch that commits leaves
--   the same rows. A run's insert can meet another instance's run of the same attempt (one
--   that took the run over when this instance lost its lease), so the writer leaves a run
--   inserted after an op that may be refused (fenced to a lease, or a decision) in its
--   place, and the batch is refused for the lost lease, as in order. A session touched
--   twice in a batch is sent once, with its first touch's fields and its last touch's
--   `updated_at`, as the two upserts would have left it. An instance not yet upgraded
--   sends its inserts one op each: each is read as an op of one row.
-- - The requests a batch touches are gathered and locked in one statement instead of two,
--   still found by key (`= ANY`, see 0008), now also through the rows of `insert_runs` and
--   `insert_messages`.
-- - The charges' function, when no charge counts against a budget, lets their reservations
--   go and inserts their records in one statement each (a charge written again, or twice,
--   counts once, as before), where it ran two statements a charge; otherwise it runs as
--   0012's did, and skips the counters' statement when no new record counts.
--
-- Everything else is 0010's batch function and 0012's charges' function as they were.

CREATE OR REPLACE FUNCTION stable_harness_apply(batch jsonb, holder text, lease_ms bigint, batch_id text)
RETURNS bigint[]
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    op jsonb;
    changed integer;
    numbers bigint[];
    assigned bigint[] := '{}';
BEGIN
    -- A try of a batch that committed already is answered from its record; one still
    -- committing holds this lock until it has.
    PERFORM pg_advisory_xact_lock(hashtextextended(batch_id, 0));
    SELECT a.numbers INTO numbers FROM applied_batches a WHERE a.id = batch_id;
    IF FOUND THEN
        RETURN numbers;
    END IF;
    -- The ids first, then their rows, in one statement: the ids gathered once (an InitPlan)
    -- and each row found by its key, however many requests are stored.
    PERFORM 1 FROM requests
     WHERE id = ANY(ARRAY(
               SELECT o->>'request_id' FROM jsonb_array_elements(batch) o
               UNION ALL SELECT o->>'id' FROM jsonb_array_elements(batch) o
                          WHERE o->>'op' = 'update_request'
               UNION ALL SELECT r->>'request_id' FROM jsonb_array_elements(batch) o,
                                jsonb_array_elements(o->'rows') r
                          WHERE o->>'op' IN ('insert_messages', 'insert_runs')
               UNION ALL SELECT e->>'request_id' FROM jsonb_array_elements(batch) o,
                                jsonb_array_elements(o->'events') e
                          WHERE o->>'op' = 'append_events'))
     ORDER BY id FOR NO KEY UPDATE;
    FOR op IN SELECT value FROM jsonb_array_elements(batch) LOOP
        -- An insert sent alone (by an instance not yet upgraded) is an op of one row.
        IF op->>'op' IN ('touch_session', 'insert_request', 'insert_run', 'insert_message') THEN
            op := jsonb_build_object('op', (op->>'op') || 's', 'rows', jsonb_build_array(op));
        END IF;
        CASE op->>'op'
        WHEN 'touch_sessions' THEN
            INSERT INTO sessions (id, agent_id, owner, metadata, created_at, updated_at)
            SELECT r->>'id', r->>'agent_id', r->>'owner', r->'metadata',
                   (r->>'created_at')::timestamptz, (r->>'updated_at')::timestamptz
              FROM jsonb_array_elements(op->'rows') r
            ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at;
        WHEN 'insert_requests' THEN
            INSERT INTO requests (id, session_id, agent_id, protocol, status, input, output, error,
                                  usage, metadata, created_at, updated_at, owner)
            SELECT r->>'id', r->>'session_id', r->>'agent_id', r->>'protocol', r->>'status',
                   r->'input', r->>'output', NULLIF(r->'error', 'null'), NULLIF(r->'usage', 'null'), r->'metadata',
                   (r->>'created_at')::timestamptz, (r->>'updated_at')::timestamptz, r->>'owner'
              FROM jsonb_array_elements(op->'rows') r;
        WHEN 'insert_runs' THEN
            INSERT INTO runs (id, request_id, attempt, status, state, error, created_at, updated_at,
                              started_at, ended_at, lease_holder, lease_expires_at)
            SELECT r->>'id', r->>'request_id', (r->>'attempt')::bigint, r->>'status',
                   NULLIF(r->'state', 'null'), NULLIF(r->'error', 'null'), (r->>'created_at')::timestamptz,
                   (r->>'updated_at')::timestamptz, (r->>'started_at')::timestamptz,
                   (r->>'ended_at')::timestamptz,
                   CASE WHEN r->'leased' = 'false' THEN NULL ELSE holder END,
                   CASE WHEN r->'leased' = 'false' THEN NULL
                        ELSE now() + lease_ms * interval '1 millisecond' END
              FROM jsonb_array_elements(op->'rows') r;
        WHEN 'insert_messages' THEN
            INSERT INTO messages (id, session_id, parent_id, request_id, role, content, created_at)
            SELECT r->>'id', r->>'session_id', r->>'parent_id', r->>'request_id', r->>'role',
                   r->'content', (r->>'created_at')::timestamptz
              FROM jsonb_array_elements(op->'rows') r;
        WHEN 'update_request' THEN
            UPDATE requests SET status = op->>'status', output = COALESCE(op->>'output', output),
                   error = NULLIF(op->'error', 'null'), usage = COALESCE(NULLIF(op->'usage', 'null'), usage),
                   updated_at = (op->>'at')::timestamptz
             WHERE id = op->>'id';
        WHEN 'update_run' THEN
            -- Only the holder changes a run; an ended run keeps no checkpoint and no lease.
            UPDATE runs SET status = op->>'status', error = COALESCE(NULLIF(op->'error', 'null'), error),
                   state = CASE WHEN op->>'status' IN ('completed', 'failed', 'cancelled') THEN NULL
                                ELSE COALESCE(NULLIF(op->'state', 'null'), state) END,
                   updated_at = (op->>'at')::timestamptz,
                   started_at = CASE WHEN op->>'status' = 'running'
                                     THEN COALESCE(started_at, (op->>'at')::timestamptz) ELSE started_at END,
                   ended_at = CASE WHEN op->>'status' IN ('completed', 'failed', 'cancelled')
                                   THEN (op->>'at')::timestamptz ELSE ended_at END,
                   lease_holder = CASE WHEN op->>'status' IN ('completed', 'failed', 'cancelled')
                                       THEN NULL ELSE lease_holder END,
                   lease_expires_at = CASE WHEN op->>'status' IN ('completed', 'failed', 'cancelled')
                                           THEN NULL ELSE lease_expires_at END
             WHERE id = op->>'id' AND lease_holder = holder;
            GET DIAGNOSTICS changed = ROW_COUNT;
            IF changed <> 1 THEN
                RAISE EXCEPTION 'run `%` is not held by this instance', op->>'id' USING ERRCODE = 'SH410';
            END IF;
        WHEN 'insert_approval' THEN
            PERFORM stable_harness_fence(op->>'run_id', holder);
            INSERT INTO approvals (id, request_id, run_id, session_id, agent_id, tool_call_id, tool_id,
                                   arguments, rule, status, reason, decided_by, created_at, expires_at,
                                   decided_at, call_key, kind, execution)
            VALUES (op->>'id', op->>'request_id', op->>'run_id', op->>'session_id', op->>'agent_id',
                    op->>'tool_call_id', op->>'tool_id', op->'arguments', op->>'rule', op->>'status',
                    op->>'reason', op->>'decided_by', (op->>'created_at')::timestamptz,
                    (op->>'expires_at')::timestamptz, (op->>'decided_at')::timestamptz,
                    op->>'call_key', op->>'kind', (op->>'execution')::bigint);
        WHEN 'decide_approval' THEN
            UPDATE approvals SET status = op->>'status', reason = op->>'reason',
                   decided_by = op->>'decided_by', decided_at = (op->>'at')::timestamptz
             WHERE id = op->>'id' AND status = 'pending';
            GET DIAGNOSTICS changed = ROW_COUNT;
            IF changed <> 1 THEN
                RAISE EXCEPTION 'approval `%` is not pending', op->>'id' USING ERRCODE = 'SH409';
            END IF;
        WHEN 'start_tool_call' THEN
            -- A tool runs only for the run's holder.
            PERFORM stable_harness_fence(op->>'run_id', holder);
            INSERT INTO tool_calls (run_id, call_key, model_call_id, request_id, tool_id, arguments,
                                    idempotency_key, outcome, result, duration_ms, recorded_at, executions)
            VALUES (op->>'run_id', op->>'call_key', op->>'model_call_id', op->>'request_id',
                    op->>'tool_id', op->'arguments', op->>'idempotency_key', 'started', 'null', 0,
                    (op->>'recorded_at')::timestamptz, 1)
            ON CONFLICT (run_id, call_key) DO UPDATE SET executions = tool_calls.executions + 1;
        WHEN 'record_tool_call' THEN
            PERFORM stable_harness_fence(op->>'run_id', holder);
            INSERT INTO tool_calls (run_id, call_key, model_call_id, request_id, tool_id, arguments,
                                    idempotency_key, outcome, result, duration_ms, recorded_at)
            VALUES (op->>'run_id', op->>'call_key', op->>'model_call_id', op->>'request_id',
                    op->>'tool_id', op->'arguments', op->>'idempotency_key', op->>'outcome',
                    op->'result', (op->>'duration_ms')::bigint, (op->>'recorded_at')::timestamptz)
            ON CONFLICT (run_id, call_key) DO UPDATE SET tool_id = excluded.tool_id,
                   model_call_id = excluded.model_call_id, arguments = excluded.arguments,
                   idempotency_key = excluded.idempotency_key, outcome = excluded.outcome,
                   result = excluded.result, duration_ms = excluded.duration_ms,
                   recorded_at = excluded.recorded_at;
        WHEN 'append_events' THEN
            -- Each element is a row: its first event, and in `more` the run's events after
            -- it. The request rows are locked (above): a row is numbered after the request's
            -- last event, and after the batch's rows of the request before it.
            WITH batch_rows AS (
                SELECT x.e, x.ord, x.e->>'request_id' AS request_id,
                       1 + COALESCE(jsonb_array_length(x.e->'more'), 0) AS count
                  FROM jsonb_array_elements(op->'events') WITH ORDINALITY AS x(e, ord)
            ), numbered AS (
                SELECT b.e, b.ord, b.request_id, b.count,
                       last.seq + SUM(b.count) OVER (PARTITION BY b.request_id ORDER BY b.ord)
                           - b.count + 1 AS seq
                  FROM batch_rows b
                  CROSS JOIN LATERAL (
                      SELECT COALESCE((SELECT v.seq + COALESCE(jsonb_array_length(v.more), 0)
                                         FROM events v WHERE v.request_id = b.request_id
                                        ORDER BY v.seq DESC LIMIT 1), 0) AS seq) last
            ), inserted AS (
                INSERT INTO events (id, request_id, run_id, seq, type, at, data, more)
                SELECT e->>'id', request_id, e->>'run_id', seq, e->>'type',
                       (e->>'at')::timestamptz, e->'data', e->'more'
                  FROM numbered
            ), announced AS (
                SELECT pg_notify('stable_harness_events',
                                 holder || ' ' || request_id || ' ' || MIN(seq) || ' '
                                     || MAX(seq + count - 1))
                  FROM numbered GROUP BY request_id
            )
            SELECT array_agg(n.seq ORDER BY b.ord, n.seq), (SELECT COUNT(*) FROM announced)
              INTO numbers, changed
              FROM numbered b, generate_series(b.seq, b.seq + b.count - 1) AS n(seq);
            assigned := assigned || numbers;
        END CASE;
    END LOOP;
    INSERT INTO applied_batches (id, numbers) VALUES (batch_id, assigned);
    RETURN assigned;
END $$;

-- 0012's charges' function, with the path above when nothing counts against a budget, and
-- without the counters' statement when no new record counts.
CREATE OR REPLACE FUNCTION stable_harness_record_usage(charges jsonb) RETURNS integer
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    charge jsonb;
    counted jsonb := '[]'::jsonb;
    recorded integer := 0;
BEGIN
    -- No charge counts against a budget (an expression, not a statement): their
    -- reservations let go, and their records inserted, in one statement each.
    IF NOT jsonb_path_exists(charges, '$[*].deltas[*]') THEN
        DELETE FROM budget_reservations
         WHERE hold_id = ANY(ARRAY(SELECT c->>'hold' FROM jsonb_array_elements(charges) c));
        INSERT INTO usage_records (id, at, request_id, run_id, owner, agent_id, session_id,
            model, source, prompt_tokens, completion_tokens, cost_nanos, estimated)
        SELECT r.id, r.at, r.request_id, r.run_id, r.owner, r.agent_id, r.session_id,
            r.model, r.source, r.prompt_tokens, r.completion_tokens, r.cost_nanos, r.estimated
          FROM jsonb_array_elements(charges) c,
               jsonb_to_record(c->'record') AS r(id text, at timestamptz, request_id text,
            run_id text, owner text, agent_id text, session_id text, model text, source text,
            prompt_tokens bigint, completion_tokens bigint, cost_nanos bigint, estimated boolean)
        ON CONFLICT (request_id, id) DO NOTHING;
        GET DIAGNOSTICS recorded = ROW_COUNT;
        RETURN recorded;
    END IF;
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
    IF counted = '[]'::jsonb THEN
        RETURN recorded;
    END IF;
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
