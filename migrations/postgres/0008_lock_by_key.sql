-- Performance (issue 16): `stable_harness_apply` locks the requests a batch touches by
-- their keys. Its lock was one query joining `requests` to the ids the batch names; planned
-- for ~200 ids (the planner's guess for `jsonb_array_elements`), it became a merge join
-- that walked `requests_pkey` whole, so every batch read every stored request's key (0.8 ms
-- at 1,700 requests, growing with the table). 0007's `enable_seqscan = off` had only moved
-- that walk from the table to its index. The ids are now gathered first and the rows found
-- with `id = ANY(...)`: an index lookup per id.
--
-- And `insert_run` takes `"leased": false` for a run inserted already ended: the writer folds
-- a batch's updates of the runs and requests it inserts into their inserts (as the embedded
-- store does), so the common request writes each row once instead of inserting it and then
-- updating every index of it. Everything else is 0002's function as it was.

CREATE OR REPLACE FUNCTION stable_harness_apply(batch jsonb, holder text, lease_ms bigint, batch_id text)
RETURNS bigint[]
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    op jsonb;
    changed integer;
    numbers bigint[];
    assigned bigint[] := '{}';
    locked text[];
BEGIN
    -- A try of a batch that committed already is answered from its record; one still
    -- committing holds this lock until it has.
    PERFORM pg_advisory_xact_lock(hashtextextended(batch_id, 0));
    SELECT a.numbers INTO numbers FROM applied_batches a WHERE a.id = batch_id;
    IF FOUND THEN
        RETURN numbers;
    END IF;
    -- The ids first, then their rows: each found by its key, however many requests are
    -- stored.
    SELECT array_agg(DISTINCT touched.id) INTO locked
      FROM (SELECT o->>'request_id' AS id FROM jsonb_array_elements(batch) o
            UNION ALL SELECT o->>'id' FROM jsonb_array_elements(batch) o
                       WHERE o->>'op' = 'update_request'
            UNION ALL SELECT e->>'request_id' FROM jsonb_array_elements(batch) o,
                             jsonb_array_elements(o->'events') e
                       WHERE o->>'op' = 'append_events') touched
     WHERE touched.id IS NOT NULL;
    PERFORM 1 FROM requests WHERE id = ANY(locked) ORDER BY id FOR NO KEY UPDATE;
    FOR op IN SELECT value FROM jsonb_array_elements(batch) LOOP
        CASE op->>'op'
        WHEN 'touch_session' THEN
            INSERT INTO sessions (id, agent_id, owner, metadata, created_at, updated_at)
            VALUES (op->>'id', op->>'agent_id', op->>'owner', op->'metadata',
                    (op->>'created_at')::timestamptz, (op->>'updated_at')::timestamptz)
            ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at;
        WHEN 'insert_message' THEN
            INSERT INTO messages (id, session_id, parent_id, request_id, role, content, created_at)
            VALUES (op->>'id', op->>'session_id', op->>'parent_id', op->>'request_id', op->>'role',
                    op->'content', (op->>'created_at')::timestamptz);
        WHEN 'insert_request' THEN
            INSERT INTO requests (id, session_id, agent_id, protocol, status, input, output, error,
                                  usage, metadata, created_at, updated_at, owner)
            VALUES (op->>'id', op->>'session_id', op->>'agent_id', op->>'protocol', op->>'status',
                    op->'input', op->>'output', NULLIF(op->'error', 'null'), NULLIF(op->'usage', 'null'), op->'metadata',
                    (op->>'created_at')::timestamptz, (op->>'updated_at')::timestamptz, op->>'owner');
        WHEN 'update_request' THEN
            UPDATE requests SET status = op->>'status', output = COALESCE(op->>'output', output),
                   error = NULLIF(op->'error', 'null'), usage = COALESCE(NULLIF(op->'usage', 'null'), usage),
                   updated_at = (op->>'at')::timestamptz
             WHERE id = op->>'id';
        WHEN 'insert_run' THEN
            INSERT INTO runs (id, request_id, attempt, status, state, error, created_at, updated_at,
                              started_at, ended_at, lease_holder, lease_expires_at)
            VALUES (op->>'id', op->>'request_id', (op->>'attempt')::bigint, op->>'status',
                    NULLIF(op->'state', 'null'), NULLIF(op->'error', 'null'), (op->>'created_at')::timestamptz,
                    (op->>'updated_at')::timestamptz, (op->>'started_at')::timestamptz,
                    (op->>'ended_at')::timestamptz,
                    CASE WHEN op->'leased' = 'false' THEN NULL ELSE holder END,
                    CASE WHEN op->'leased' = 'false' THEN NULL
                         ELSE now() + lease_ms * interval '1 millisecond' END);
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
            -- The request rows are locked (above): number after each one's last event.
            WITH numbered AS (
                SELECT x.e, x.ord,
                       last.seq + row_number() OVER (PARTITION BY x.e->>'request_id' ORDER BY x.ord) AS seq
                  FROM jsonb_array_elements(op->'events') WITH ORDINALITY AS x(e, ord)
                  CROSS JOIN LATERAL (SELECT COALESCE(MAX(v.seq), 0) AS seq FROM events v
                                       WHERE v.request_id = x.e->>'request_id') last
            ), inserted AS (
                INSERT INTO events (id, request_id, run_id, seq, type, at, data)
                SELECT e->>'id', e->>'request_id', e->>'run_id', seq, e->>'type',
                       (e->>'at')::timestamptz, e->'data'
                  FROM numbered
            )
            SELECT array_agg(seq ORDER BY ord) INTO numbers FROM numbered;
            PERFORM pg_notify('stable_harness_events',
                              holder || ' ' || (x.e->>'request_id') || ' ' || MIN(n.seq) || ' ' || MAX(n.seq))
               FROM jsonb_array_elements(op->'events') WITH ORDINALITY AS x(e, ord)
               JOIN unnest(numbers) WITH ORDINALITY AS n(seq, ord) ON n.ord = x.ord
              GROUP BY x.e->>'request_id';
            assigned := assigned || numbers;
        END CASE;
    END LOOP;
    INSERT INTO applied_batches (id, numbers) VALUES (batch_id, assigned);
    RETURN assigned;
END $$;
