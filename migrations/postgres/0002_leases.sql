-- Leases and shared numbering (issue 10): several instances serve one database.
--
-- A live run is held by one instance (`lease_holder`) until `lease_expires_at`; the holder
-- renews it, and another instance may claim it once it expired. Only the holder may change a
-- run, start or record one of its tool calls, or ask for an approval: `stable_harness_apply`
-- refuses those writes from anyone else with SQLSTATE SH410 (fencing), so an instance that
-- lost a lease cannot record a step or run a tool after the new holder took over.
--
-- Events are numbered here, not by the writer: a run's holder and an operator deciding an
-- approval on another instance append to the same request, so the request's row is locked
-- and its numbers continue from the stored ones. Every append is announced on the channel
-- `stable_harness_events` as `holder request first last`, for followers on other instances.

ALTER TABLE runs ADD COLUMN lease_holder TEXT, ADD COLUMN lease_expires_at TIMESTAMPTZ;

-- Batches applied lately, by the id their writer gives them (the same on every try), with the
-- numbers their events got: a batch tried again after its commit's reply was lost with the
-- connection is answered from here instead of being applied twice. Kept for a minute.
-- Ids are time-ordered (UUID v7, hex: the first 12 digits are the milliseconds since the
-- epoch), so old entries are found by the key alone.
CREATE TABLE applied_batches (
    id       TEXT COLLATE "C" PRIMARY KEY,
    numbers  BIGINT[] NOT NULL
);

DROP FUNCTION stable_harness_apply(jsonb);

-- Refuses (SQLSTATE SH410) a write of `run` unless `holder` holds its lease; the share lock
-- keeps the lease from being claimed until the write commits.
CREATE FUNCTION stable_harness_fence(run text, holder text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM runs WHERE id = run AND lease_holder = holder FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'run `%` is not held by this instance', run USING ERRCODE = 'SH410';
    END IF;
END $$;

-- Applies a batch (see 0001) as `holder`, whose new runs are leased for `lease_ms`, once per
-- `batch_id`, and returns the numbers given to its events, in order. Every request the batch
-- touches is locked first, in id order, so two instances' batches never deadlock on them.
CREATE FUNCTION stable_harness_apply(batch jsonb, holder text, lease_ms bigint, batch_id text)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
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
    PERFORM 1 FROM requests
      WHERE id IN (SELECT o->>'request_id' FROM jsonb_array_elements(batch) o
                   UNION SELECT o->>'id' FROM jsonb_array_elements(batch) o
                          WHERE o->>'op' = 'update_request'
                   UNION SELECT e->>'request_id' FROM jsonb_array_elements(batch) o,
                                jsonb_array_elements(o->'events') e
                          WHERE o->>'op' = 'append_events')
      ORDER BY id FOR NO KEY UPDATE;
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
                    (op->>'ended_at')::timestamptz, holder, now() + lease_ms * interval '1 millisecond');
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
