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
