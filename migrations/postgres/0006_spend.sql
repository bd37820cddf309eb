-- Spend (issue 15); see migrations/sqlite/0009_spend.sql for the ledger and counters.
CREATE TABLE usage_records (
    id TEXT PRIMARY KEY,
    at TIMESTAMPTZ NOT NULL,
    request_id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    agent_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    model TEXT NOT NULL,
    source TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    cost_nanos BIGINT,
    estimated BOOLEAN NOT NULL
);
CREATE INDEX usage_records_at ON usage_records (at);
CREATE INDEX usage_records_request ON usage_records (request_id);

CREATE TABLE budget_usage (
    budget TEXT NOT NULL,
    subject TEXT NOT NULL,
    bucket BIGINT NOT NULL,
    tokens BIGINT NOT NULL,
    cost_nanos BIGINT NOT NULL,
    PRIMARY KEY (budget, subject, bucket)
);

-- What calls in flight may still spend, shared by every instance. A reservation counts while
-- it is younger than a lease, or while the run holding it holds its lease: a dead instance's
-- reservations stop counting when its leases expire, and are deleted by the next reservation
-- of the same counter.
CREATE TABLE budget_reservations (
    hold_id TEXT NOT NULL,
    budget TEXT NOT NULL,
    subject TEXT NOT NULL,
    run_id TEXT NOT NULL,
    tokens BIGINT NOT NULL,
    cost_nanos BIGINT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (hold_id, budget, subject)
);
CREATE INDEX budget_reservations_counter ON budget_reservations (budget, subject);

-- Rate limits' token buckets, refilled on the database's clock.
CREATE TABLE rate_buckets (
    name TEXT NOT NULL,
    subject TEXT NOT NULL,
    dimension TEXT NOT NULL,
    level DOUBLE PRECISION NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (name, subject, dimension)
);
