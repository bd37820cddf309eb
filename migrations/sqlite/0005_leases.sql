-- Leases (issue 10): a live run is held by the instance executing it until its lease
-- expires. The embedded store has one process, so its leases only fence a run's writes
-- against an instance that let it go; PostgreSQL shares the same semantics between instances.
ALTER TABLE runs ADD COLUMN lease_holder TEXT;
ALTER TABLE runs ADD COLUMN lease_expires_at TEXT;
-- Claims look for live runs every second: they must not scan every run ever stored.
CREATE INDEX runs_live ON runs(id) WHERE status IN ('queued', 'running', 'waiting_approval');
