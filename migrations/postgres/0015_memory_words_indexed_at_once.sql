-- Performance (issue 16): recall searches the GIN index of the memories' words before every
-- run of an agent with memory, where a write comes far less often. With GIN's fast update
-- (PostgreSQL's default) a new record's words wait in a pending list that every search
-- reads whole, until a vacuum or 4 MB of them merge it into the index: right after an
-- import of 10,000 records, a recall took 5.7-6.3 ms at concurrency 1 where it takes
-- 2.2-2.3 ms with the list merged, and 313-391 recalls a second at concurrency 32 where it
-- serves 970-1,124. A record's words now go into the index as it is written, and what
-- waits in the list is merged here.
--
-- Changing the index's option locks the table `memories` until the migration commits; for
-- at most 5 s, so that a busy database fails the start (try it again) rather than holding
-- every recall and memory write behind the wait.
SET LOCAL lock_timeout = '5s';
ALTER INDEX memories_by_words SET (fastupdate = off);
SELECT gin_clean_pending_list('memories_by_words');
