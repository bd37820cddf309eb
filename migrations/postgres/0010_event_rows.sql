-- Performance (issue 16): a row of `events` holds a run of consecutive events of one run of
-- one request, written in one batch, as on the embedded store (its migration 0012). The
-- row's columns are its first event (`seq`, `id`, `type`, `at`, `data`); `more` holds the
-- ones after it, numbered `seq + 1` onwards, as a JSON array of {"id", "type", "at",
-- "data"} (`at` in RFC 3339, to the microsecond, as the column keeps it), or is NULL when
-- the row holds one event (as every row written before this migration does). A chat
-- request answered whole wrote seven rows of events, seven index entries and seven
-- foreign-key checks for them; it now writes one of each. Readers unpack rows into events.
--
-- `stable_harness_apply` reads a batch's `append_events` as such rows, and announces each
-- request's new numbers in the same statement as their insert. Everything else is 0008's
-- function as it was.

ALTER TABLE events ADD COLUMN more JSONB;

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
