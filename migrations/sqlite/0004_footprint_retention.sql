-- Footprint and retention (issue 9): what a request stores, without what is stored elsewhere.
-- Events lose the columns their request holds (session and agent, read through a join), the
-- unique index on their id (ids are time-ordered UUIDs, unique by construction, and nothing
-- looks an event up by id) and the index by run (a run's events are read within its
-- request's key range). An ended run keeps no checkpoint: only a live run is ever resumed.

CREATE TABLE events_v4 (
    request_id  TEXT NOT NULL REFERENCES requests(id),
    seq         INTEGER NOT NULL,
    id          TEXT NOT NULL,
    run_id      TEXT NOT NULL,
    type        TEXT NOT NULL,
    at          TEXT NOT NULL,
    data        TEXT NOT NULL,
    PRIMARY KEY (request_id, seq)
) WITHOUT ROWID;
INSERT INTO events_v4 (request_id, seq, id, run_id, type, at, data)
SELECT request_id, seq, id, run_id, type, at, data FROM events;
DROP TABLE events;
ALTER TABLE events_v4 RENAME TO events;

UPDATE runs SET state = NULL WHERE status IN ('completed', 'failed', 'cancelled');

-- Retention (issue 9): pruning finds a request's approvals, and records each maintenance pass.
CREATE INDEX approvals_by_request ON approvals(request_id);

CREATE TABLE maintenance (
    id          TEXT PRIMARY KEY,
    operation   TEXT NOT NULL,
    status      TEXT NOT NULL,
    started_at  TEXT NOT NULL,
    ended_at    TEXT NOT NULL,
    report      TEXT NOT NULL
);
