-- The whole lifecycle schema of SPEC section 8. Timestamps are RFC 3339 UTC text; JSON
-- columns hold compact JSON text. Never edit once released: add a migration instead.

CREATE TABLE sessions (
    id          TEXT PRIMARY KEY,
    agent_id    TEXT NOT NULL,
    metadata    TEXT NOT NULL DEFAULT '{}',
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL
);

-- Messages form a tree per session: each names its parent, so a session forks at any message.
CREATE TABLE messages (
    id          TEXT PRIMARY KEY,
    session_id  TEXT NOT NULL REFERENCES sessions(id),
    parent_id   TEXT REFERENCES messages(id),
    request_id  TEXT,
    role        TEXT NOT NULL,
    content     TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
CREATE INDEX messages_by_session ON messages(session_id, created_at, id);

CREATE TABLE requests (
    id          TEXT PRIMARY KEY,
    session_id  TEXT NOT NULL REFERENCES sessions(id),
    agent_id    TEXT NOT NULL,
    protocol    TEXT NOT NULL,
    status      TEXT NOT NULL,
    input       TEXT NOT NULL,
    output      TEXT,
    error       TEXT,
    usage       TEXT,
    metadata    TEXT NOT NULL DEFAULT '{}',
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL
);
CREATE INDEX requests_by_status ON requests(status, id);
CREATE INDEX requests_by_agent ON requests(agent_id, id);
CREATE INDEX requests_by_session ON requests(session_id, id);

-- One execution attempt of a request; `state` is the conversation after the last step.
CREATE TABLE runs (
    id          TEXT PRIMARY KEY,
    request_id  TEXT NOT NULL REFERENCES requests(id),
    attempt     INTEGER NOT NULL,
    status      TEXT NOT NULL,
    state       TEXT,
    error       TEXT,
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL,
    started_at  TEXT,
    ended_at    TEXT,
    UNIQUE (request_id, attempt)
);

-- Events are gapless per request: (request_id, seq) is the key, seq counts from 1.
CREATE TABLE events (
    request_id  TEXT NOT NULL REFERENCES requests(id),
    seq         INTEGER NOT NULL,
    id          TEXT NOT NULL UNIQUE,
    run_id      TEXT NOT NULL,
    session_id  TEXT NOT NULL,
    agent_id    TEXT NOT NULL,
    type        TEXT NOT NULL,
    at          TEXT NOT NULL,
    data        TEXT NOT NULL,
    PRIMARY KEY (request_id, seq)
) WITHOUT ROWID;
CREATE INDEX events_by_run ON events(run_id, seq);

CREATE TABLE approvals (
    id            TEXT PRIMARY KEY,
    request_id    TEXT NOT NULL REFERENCES requests(id),
    run_id        TEXT NOT NULL REFERENCES runs(id),
    tool_call_id  TEXT NOT NULL,
    tool_id       TEXT NOT NULL,
    arguments     TEXT NOT NULL,
    rule          TEXT,
    status        TEXT NOT NULL,
    reason        TEXT,
    decided_by    TEXT,
    created_at    TEXT NOT NULL,
    expires_at    TEXT,
    decided_at    TEXT,
    UNIQUE (run_id, tool_call_id)
);
CREATE INDEX approvals_by_status ON approvals(status, id);

CREATE TABLE artifacts (
    id            TEXT PRIMARY KEY,
    request_id    TEXT NOT NULL REFERENCES requests(id),
    run_id        TEXT NOT NULL REFERENCES runs(id),
    name          TEXT NOT NULL,
    content_type  TEXT NOT NULL,
    content       BLOB NOT NULL,
    created_at    TEXT NOT NULL
);
CREATE INDEX artifacts_by_request ON artifacts(request_id, id);
