-- Performance (issue 16): a row of `events` holds a run's consecutive events (0010), about
-- 1,536 bytes of their data at most; with the later events' ids, types and times, in
-- JSONB's layout, a row of a request's six or seven events is 2.2-2.6 KB, past the ~2 KB at
-- which PostgreSQL compresses a row's values: a third to a half of the rows were
-- compressed (pglz) as they were written, and decompressed at every read. A row now stays
-- as written up to a page (the most this setting allows: the block size less the page's
-- header and one line pointer); a larger one is compressed, and moved out of line, as
-- before. Rows written before keep their form.
DO $$
BEGIN
    EXECUTE format('ALTER TABLE events SET (toast_tuple_target = %s)',
                   current_setting('block_size')::integer - 32);
END $$;
