-- The whole lifecycle schema of SPEC section 8 on PostgreSQL: the same tables, keys and
-- meanings as the embedded store's migrations up to 0004 (one migration here, since nothing
-- was released on PostgreSQL before). Never edit once released: add a migration instead.
-- Keys compare byte by byte (COLLATE "C"), as SQLite compares them, whatever the database's
-- locale: ids sort by creation and cursors page the same on both stores.

CREATE TABLE sessions (
    id          TEXT COLLATE "C" PRIMARY KEY,
    agent_id    TEXT NOT NULL,
    owner       TEXT NOT NULL DEFAULT '',
    metadata    JSONB NOT NULL DEFAULT '{}',
    created_at  TIMESTAMPTZ NOT NULL,
    updated_at  TIMESTAMPTZ NOT NULL
);

-- Messages form a tree per session: each names its parent.
CREATE TABLE messages (
    id          TEXT COLLATE "C" PRIMARY KEY,
    session_id  TEXT NOT NULL REFERENCES sessions(id),
    parent_id   TEXT REFERENCES messages(id) DEFERRABLE INITIALLY DEFERRED,
    request_id  TEXT,
    role        TEXT NOT NULL,
    content     JSONB NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL
);
CREATE INDEX messages_by_session ON messages(session_id, created_at, id);
CREATE INDEX messages_by_parent ON messages(parent_id);

CREATE TABLE requests (
    id          TEXT COLLATE "C" PRIMARY KEY,
    session_id  TEXT NOT NULL REFERENCES sessions(id),
    agent_id    TEXT NOT NULL,
    protocol    TEXT NOT NULL,
    owner       TEXT NOT NULL DEFAULT '',
    status      TEXT NOT NULL,
    input       JSONB NOT NULL,
    output      TEXT,
    error       JSONB,
    usage       JSONB,
    metadata    JSONB NOT NULL DEFAULT '{}',
    created_at  TIMESTAMPTZ NOT NULL,
    updated_at  TIMESTAMPTZ NOT NULL
);
CREATE INDEX requests_by_status ON requests(status, id);
CREATE INDEX requests_by_agent ON requests(agent_id, id);
CREATE INDEX requests_by_session ON requests(session_id, id);
CREATE INDEX requests_by_owner ON requests(owner, id);

-- One execution attempt of a request; `state` is the conversation after the last step of a
-- live run (an ended run keeps none).
CREATE TABLE runs (
    id          TEXT COLLATE "C" PRIMARY KEY,
    request_id  TEXT NOT NULL REFERENCES requests(id),
    attempt     BIGINT NOT NULL,
    status      TEXT NOT NULL,
    state       JSONB,
    error       JSONB,
    created_at  TIMESTAMPTZ NOT NULL,
    updated_at  TIMESTAMPTZ NOT NULL,
    started_at  TIMESTAMPTZ,
    ended_at    TIMESTAMPTZ,
    UNIQUE (request_id, attempt)
);
CREATE INDEX runs_by_status ON runs(status) WHERE status IN ('queued', 'running', 'waiting_approval');

-- Events are gapless per request: (request_id, seq) is the key, seq counts from 1. Session
-- and agent are read from the request.
CREATE TABLE events (
    request_id  TEXT COLLATE "C" NOT NULL REFERENCES requests(id),
    seq         BIGINT NOT NULL,
    id          TEXT NOT NULL,
    run_id      TEXT NOT NULL,
    type        TEXT NOT NULL,
    at          TIMESTAMPTZ NOT NULL,
    data        JSONB NOT NULL,
    PRIMARY KEY (request_id, seq)
);

CREATE TABLE approvals (
    id            TEXT COLLATE "C" PRIMARY KEY,
    request_id    TEXT NOT NULL REFERENCES requests(id),
    run_id        TEXT NOT NULL REFERENCES runs(id),
    session_id    TEXT NOT NULL,
    agent_id      TEXT NOT NULL,
    call_key      TEXT NOT NULL,
    kind          TEXT NOT NULL,
    execution     BIGINT NOT NULL DEFAULT 0,
    tool_call_id  TEXT NOT NULL,
    tool_id       TEXT NOT NULL,
    arguments     JSONB NOT NULL,
    rule          TEXT,
    status        TEXT NOT NULL,
    reason        TEXT,
    decided_by    TEXT,
    created_at    TIMESTAMPTZ NOT NULL,
    expires_at    TIMESTAMPTZ,
    decided_at    TIMESTAMPTZ,
    UNIQUE (run_id, call_key, kind, execution)
);
CREATE INDEX approvals_by_status ON approvals(status, id);
CREATE INDEX approvals_by_run ON approvals(run_id);
CREATE INDEX approvals_by_request ON approvals(request_id);

CREATE TABLE artifacts (
    id            TEXT PRIMARY KEY,
    request_id    TEXT NOT NULL REFERENCES requests(id),
    run_id        TEXT NOT NULL REFERENCES runs(id),
    name          TEXT NOT NULL,
    content_type  TEXT NOT NULL,
    content       BYTEA NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL
);
CREATE INDEX artifacts_by_request ON artifacts(request_id, id);
CREATE INDEX artifacts_by_run ON artifacts(run_id);

-- The gateway's record of tool calls, by their place in the run (`call_key`).
CREATE TABLE tool_calls (
    run_id           TEXT NOT NULL REFERENCES runs(id),
    call_key         TEXT NOT NULL,
    model_call_id    TEXT NOT NULL DEFAULT '',
    request_id       TEXT NOT NULL,
    tool_id          TEXT NOT NULL,
    arguments        JSONB NOT NULL,
    idempotency_key  TEXT NOT NULL DEFAULT '',
    executions       BIGINT NOT NULL DEFAULT 0,
    outcome          TEXT NOT NULL,
    result           JSONB NOT NULL,
    duration_ms      BIGINT NOT NULL,
    recorded_at      TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (run_id, call_key)
);

CREATE TABLE maintenance (
    id          TEXT COLLATE "C" PRIMARY KEY,
    operation   TEXT NOT NULL,
    status      TEXT NOT NULL,
    started_at  TIMESTAMPTZ NOT NULL,
    ended_at    TIMESTAMPTZ NOT NULL,
    report      JSONB NOT NULL
);

-- A batch of writes in one round trip: the store sends the ops as one JSON array and this
-- applies them in order, in the statement's transaction. A JSON null field is SQL NULL
-- (`->>` gives NULL for it; JSON-valued fields go through NULLIF). A decision on an approval that is
-- not pending raises SQLSTATE SH409, which the store reports as a conflict.
CREATE FUNCTION stable_harness_apply(batch jsonb) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    op jsonb;
    changed integer;
BEGIN
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
                              started_at, ended_at)
            VALUES (op->>'id', op->>'request_id', (op->>'attempt')::bigint, op->>'status',
                    NULLIF(op->'state', 'null'), NULLIF(op->'error', 'null'), (op->>'created_at')::timestamptz,
                    (op->>'updated_at')::timestamptz, (op->>'started_at')::timestamptz,
                    (op->>'ended_at')::timestamptz);
        WHEN 'update_run' THEN
            -- An ended run keeps no checkpoint: only a live run is ever resumed.
            UPDATE runs SET status = op->>'status', error = COALESCE(NULLIF(op->'error', 'null'), error),
                   state = CASE WHEN op->>'status' IN ('completed', 'failed', 'cancelled') THEN NULL
                                ELSE COALESCE(NULLIF(op->'state', 'null'), state) END,
                   updated_at = (op->>'at')::timestamptz,
                   started_at = CASE WHEN op->>'status' = 'running'
                                     THEN COALESCE(started_at, (op->>'at')::timestamptz) ELSE started_at END,
                   ended_at = CASE WHEN op->>'status' IN ('completed', 'failed', 'cancelled')
                                   THEN (op->>'at')::timestamptz ELSE ended_at END
             WHERE id = op->>'id';
        WHEN 'insert_approval' THEN
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
            INSERT INTO tool_calls (run_id, call_key, model_call_id, request_id, tool_id, arguments,
                                    idempotency_key, outcome, result, duration_ms, recorded_at, executions)
            VALUES (op->>'run_id', op->>'call_key', op->>'model_call_id', op->>'request_id',
                    op->>'tool_id', op->'arguments', op->>'idempotency_key', 'started', 'null', 0,
                    (op->>'recorded_at')::timestamptz, 1)
            ON CONFLICT (run_id, call_key) DO UPDATE SET executions = tool_calls.executions + 1;
        WHEN 'record_tool_call' THEN
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
            INSERT INTO events (id, request_id, run_id, seq, type, at, data)
            SELECT e.id, e.request_id, e.run_id, e.seq, e.type, e.at, e.data
              FROM jsonb_to_recordset(op->'events')
                   AS e(id text, request_id text, run_id text, seq bigint, type text,
                        at timestamptz, data jsonb);
        END CASE;
    END LOOP;
END $$;
