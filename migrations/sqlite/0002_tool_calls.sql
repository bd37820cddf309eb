-- The gateway's record of tool calls: a call id with a recorded result is never executed again
-- (SPEC section 4, durability). Approvals also name the agent and session they concern.

CREATE TABLE tool_calls (
    run_id        TEXT NOT NULL REFERENCES runs(id),
    tool_call_id  TEXT NOT NULL,
    request_id    TEXT NOT NULL,
    tool_id       TEXT NOT NULL,
    arguments     TEXT NOT NULL,
    outcome       TEXT NOT NULL,
    result        TEXT NOT NULL,
    duration_ms   INTEGER NOT NULL,
    recorded_at   TEXT NOT NULL,
    PRIMARY KEY (run_id, tool_call_id)
) WITHOUT ROWID;

ALTER TABLE approvals ADD COLUMN agent_id TEXT NOT NULL DEFAULT '';
ALTER TABLE approvals ADD COLUMN session_id TEXT NOT NULL DEFAULT '';
