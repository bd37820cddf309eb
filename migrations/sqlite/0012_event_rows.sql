-- Performance (issue 16): a row of `events` holds a run of consecutive events of one run of
-- one request, written in one batch. The row's columns are its first event (`seq`, `id`,
-- `type`, `at`, `data`); `more` holds the ones after it, numbered `seq + 1` onwards, as a
-- JSON array of {"id", "type", "at", "data"}, or is NULL when the row holds one event (as
-- every row written before this migration does). A request answered whole wrote seven rows
-- and seven index entries; it now writes two of each. Readers unpack rows into events.
ALTER TABLE events ADD COLUMN more TEXT;
