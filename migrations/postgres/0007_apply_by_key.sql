-- Performance (issue 16): `stable_harness_apply` locks the requests a batch touches, by id.
-- Planned while `requests` was small, that query kept a sequential scan of the table in the
-- plan each connection caches. Measured, a batch then took 5-9 ms once the table held 25,000
-- requests: the whole table was read under every batch. Every statement of the function
-- finds its rows by key, so it never needs a sequential scan.
ALTER FUNCTION stable_harness_apply(jsonb, text, bigint, text) SET enable_seqscan = off;
