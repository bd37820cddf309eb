-- A partial index's condition is evaluated on every insert and update of its table. Spelled
-- `status IN (...)`, SQLite built a temporary b-tree of the three statuses for each run
-- written (three or four per request: ~1% of the CPU of a request, on the writer thread).
-- Spelled as comparisons it costs three string compares. Queries that read the index spell
-- the same condition (`LIVE_RUN` in src/store/sqlite.rs), as SQLite requires.
DROP INDEX runs_live;
CREATE INDEX runs_live ON runs(id)
    WHERE status = 'queued' OR status = 'running' OR status = 'waiting_approval';
