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

-- Rate limits' token buckets, refilled on the database's clock; `taken` says whether the
-- last take found enough.
CREATE TABLE rate_buckets (
    name TEXT NOT NULL,
    subject TEXT NOT NULL,
    dimension TEXT NOT NULL,
    level DOUBLE PRECISION NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL,
    taken BOOLEAN NOT NULL DEFAULT true,
    PRIMARY KEY (name, subject, dimension)
);

-- Reserves every claim under `hold` for `run`, or none: one call, one transaction. Each claim
-- is {budget, subject, from_bucket, tokens, cost_nanos, max_tokens, max_cost_nanos} and the
-- claims come sorted by (budget, subject), so concurrent reservations take the counters' locks
-- in one order and never deadlock. Returns NULL when reserved, else the first claim that does
-- not fit: {index, used_tokens, used_cost, reserved_tokens, reserved_cost}.
CREATE FUNCTION stable_harness_reserve(hold text, run text, lease_ms bigint, claims jsonb)
RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    claim jsonb;
    place integer := 0;
    used_tokens bigint;
    used_cost bigint;
    reserved_tokens bigint;
    reserved_cost bigint;
BEGIN
    FOR claim IN SELECT value FROM jsonb_array_elements(claims) LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended((claim->>'budget') || '/' || (claim->>'subject'), 15));
        -- A dead instance's reservations no longer count: they go here.
        DELETE FROM budget_reservations r
         WHERE r.budget = claim->>'budget' AND r.subject = claim->>'subject'
           AND r.created_at <= now() - lease_ms * interval '1 millisecond'
           AND NOT EXISTS (SELECT 1 FROM runs u WHERE u.id = r.run_id AND u.lease_expires_at > now()
                             AND u.status IN ('queued', 'running', 'waiting_approval'));
        -- Reserved before used: a call settling between the two reads (its own statement,
        -- its own snapshot) is then seen twice at worst, never missed.
        SELECT COALESCE(SUM(r.tokens), 0), COALESCE(SUM(r.cost_nanos), 0)
          INTO reserved_tokens, reserved_cost
          FROM budget_reservations r
         WHERE r.budget = claim->>'budget' AND r.subject = claim->>'subject';
        SELECT COALESCE(SUM(b.tokens), 0), COALESCE(SUM(b.cost_nanos), 0)
          INTO used_tokens, used_cost
          FROM budget_usage b
         WHERE b.budget = claim->>'budget' AND b.subject = claim->>'subject'
           AND b.bucket >= (claim->>'from_bucket')::bigint;
        IF (claim->'max_tokens' <> 'null' AND used_tokens + reserved_tokens + (claim->>'tokens')::bigint > (claim->>'max_tokens')::bigint)
           OR (claim->'max_cost_nanos' <> 'null' AND used_cost + reserved_cost + (claim->>'cost_nanos')::bigint > (claim->>'max_cost_nanos')::bigint) THEN
            RETURN jsonb_build_object('index', place, 'used_tokens', used_tokens, 'used_cost', used_cost,
                                      'reserved_tokens', reserved_tokens, 'reserved_cost', reserved_cost);
        END IF;
        place := place + 1;
    END LOOP;
    -- Every counter is locked and fits: take the room.
    INSERT INTO budget_reservations (hold_id, budget, subject, run_id, tokens, cost_nanos)
    SELECT hold, c->>'budget', c->>'subject', run, (c->>'tokens')::bigint, (c->>'cost_nanos')::bigint
      FROM jsonb_array_elements(claims) c;
    RETURN NULL;
END $$;
