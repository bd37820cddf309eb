-- Performance (issue 16): fewer pages written per request. Every b-tree a write touches is
-- one more page in the commit's WAL frames and one more page to copy back at a checkpoint.

-- These three indexes served no query: listings spell their optional filters
-- `?n IS NULL OR column = ?n`, which SQLite plans once per statement as a walk of the primary
-- key. The prune's "newest ended requests" read requests_by_status through a sort of every
-- ended request; it now walks the primary key backwards and stops at its limit.
DROP INDEX requests_by_status;
DROP INDEX requests_by_agent;
DROP INDEX sessions_by_agent;

-- Events become a rowid table with a unique index on (request_id, seq). As a WITHOUT ROWID
-- table keyed by (request_id, seq), each ~330-byte row (six to a 2 KiB page) went in by key,
-- so a page split every few rows rebalanced the cells of three pages (12% of the writer
-- thread's time went to b-tree balancing at c=32, 9.8% after this). A rowid table takes each
-- row at its end, where SQLite splits by starting a new page; the index's entries are ~50
-- bytes, forty to a page.
CREATE TABLE events_v10 (
    request_id  TEXT NOT NULL REFERENCES requests(id),
    seq         INTEGER NOT NULL,
    id          TEXT NOT NULL,
    run_id      TEXT NOT NULL,
    type        TEXT NOT NULL,
    at          TEXT NOT NULL,
    data        TEXT NOT NULL
);
INSERT INTO events_v10 (request_id, seq, id, run_id, type, at, data)
SELECT request_id, seq, id, run_id, type, at, data FROM events ORDER BY request_id, seq;
DROP TABLE events;
ALTER TABLE events_v10 RENAME TO events;
CREATE UNIQUE INDEX events_by_request ON events(request_id, seq);
