-- Trust (issue 8): tool calls and approvals are identified by their place in the run (model
-- turn and position, `call_key`), never by the id the model gave the call (providers reuse
-- `call_0` or send none); a call's start is recorded with its idempotency key before it runs;
-- sessions and requests belong to the client key identity that made them.

ALTER TABLE tool_calls RENAME COLUMN tool_call_id TO call_key;
ALTER TABLE tool_calls ADD COLUMN model_call_id TEXT NOT NULL DEFAULT '';
ALTER TABLE tool_calls ADD COLUMN idempotency_key TEXT NOT NULL DEFAULT '';
-- How many times the call was started (a re-run after a crash starts it again).
ALTER TABLE tool_calls ADD COLUMN executions INTEGER NOT NULL DEFAULT 0;

-- Approvals are rebuilt: one per (run, call, kind, execution), where kind says why a human is
-- asked (`policy`, or `interrupted`: the call's outcome is unknown after a restart) and an
-- interrupted approval concerns one execution: each interruption needs its own decision.
CREATE TABLE approvals_v3 (
    id            TEXT PRIMARY KEY,
    request_id    TEXT NOT NULL REFERENCES requests(id),
    run_id        TEXT NOT NULL REFERENCES runs(id),
    session_id    TEXT NOT NULL,
    agent_id      TEXT NOT NULL,
    call_key      TEXT NOT NULL,
    kind          TEXT NOT NULL,
    execution     INTEGER NOT NULL DEFAULT 0,
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
    UNIQUE (run_id, call_key, kind, execution)
);
INSERT INTO approvals_v3 (id, request_id, run_id, session_id, agent_id, call_key, kind, tool_call_id,
    tool_id, arguments, rule, status, reason, decided_by, created_at, expires_at, decided_at)
SELECT id, request_id, run_id, session_id, agent_id, tool_call_id, 'policy', tool_call_id,
    tool_id, arguments, rule, status, reason, decided_by, created_at, expires_at, decided_at
FROM approvals;
DROP TABLE approvals;
ALTER TABLE approvals_v3 RENAME TO approvals;
CREATE INDEX approvals_by_status ON approvals(status, id);
CREATE INDEX approvals_by_run ON approvals(run_id);

ALTER TABLE sessions ADD COLUMN owner TEXT NOT NULL DEFAULT '';
ALTER TABLE requests ADD COLUMN owner TEXT NOT NULL DEFAULT '';
CREATE INDEX requests_by_owner ON requests(owner, id);
