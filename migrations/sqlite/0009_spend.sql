-- Spend (issue 15): every charged upstream call, and the per-window counters budgets read.
-- The ledger outlives pruned sessions: a budget never resets because history was pruned.
CREATE TABLE usage_records (
    id TEXT PRIMARY KEY,
    at TEXT NOT NULL,
    request_id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    agent_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    model TEXT NOT NULL,
    source TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost_nanos INTEGER,
    estimated INTEGER NOT NULL
);
CREATE INDEX usage_records_at ON usage_records (at);
CREATE INDEX usage_records_request ON usage_records (request_id);

-- What one budget counted for one subject (key, agent, session, or `*`) in one bucket of its
-- window (unix seconds of the bucket's start).
CREATE TABLE budget_usage (
    budget TEXT NOT NULL,
    subject TEXT NOT NULL,
    bucket INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    cost_nanos INTEGER NOT NULL,
    PRIMARY KEY (budget, subject, bucket)
);
