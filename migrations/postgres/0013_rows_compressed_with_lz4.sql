-- Performance (issue 16): a row of `events` holds a run's consecutive events (0010), about
-- 1,536 bytes of their data at most; with the later events' ids, types and times, in
-- JSONB's layout, a row of a request's six or seven events is 2.2-2.6 KB, past the ~2 KB at
-- which PostgreSQL compresses a row's values: a third to a half of the rows were
-- compressed with pglz as they were written (1.6% of PostgreSQL's CPU for a chat request).
-- Where the server has LZ4, the values a request writes that may be long are compressed
-- with it instead: nearly as small (2,196 bytes of `events` a chat request, 2,092 with
-- pglz, 2,843 uncompressed) for about a seventh of the CPU, and faster to read back. Values
-- written before keep their form; a server without LZ4 keeps pglz.
--
-- Changing a column's compression locks its table against reads and writes until the
-- migration commits. The three tables are locked at once, in the order a batch reaches
-- them (its requests, then its messages, then its events), so that a batch of an instance
-- still running never waits on one of them while holding another this waits for; and for
-- at most 5 s, so that a busy database fails the start (try it again) rather than holding
-- every request behind the wait.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_settings
                WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)) THEN
        PERFORM set_config('lock_timeout', '5s', true);
        LOCK TABLE requests, messages, events IN ACCESS EXCLUSIVE MODE;
        EXECUTE 'ALTER TABLE events ALTER COLUMN data SET COMPRESSION lz4, '
                'ALTER COLUMN more SET COMPRESSION lz4';
        EXECUTE 'ALTER TABLE messages ALTER COLUMN content SET COMPRESSION lz4';
        EXECUTE 'ALTER TABLE requests ALTER COLUMN input SET COMPRESSION lz4, '
                'ALTER COLUMN output SET COMPRESSION lz4';
    END IF;
END $$;
