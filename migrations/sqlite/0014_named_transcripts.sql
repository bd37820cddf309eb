-- Performance (issue 16): a chat with no session sends its whole transcript every turn, and
-- each turn's request stored it whole: 114 MB after 600 turns of 500 bytes. A turn whose
-- transcript continues an earlier request's (the same key's and agent's, found by the
-- digest of that request's messages) names the request that holds its first messages
-- whole, and stores only the rest (`prefixOf`, `prefixLen` in its input; `inputDigest`,
-- the digest of its own transcript, for the next turn to find it by). The columns repeat
-- those members of the input so that the lookup and the prune read no input; the runtime
-- writes them with the row.
ALTER TABLE requests ADD COLUMN input_digest TEXT;
ALTER TABLE requests ADD COLUMN prefix_of TEXT;
ALTER TABLE requests ADD COLUMN prefix_len INTEGER;
-- The newest of one key's and agent's requests with a digest is the index's last entry for
-- them, however many others (another key's sending the same) share the digest. The entry
-- holds what the lookup reads: the row's own columns come after its input, which SQLite
-- reaches only through the input's overflow pages (a megabyte's ~500 of them, each read).
CREATE INDEX requests_by_input_digest
    ON requests(input_digest, owner, agent_id, id, updated_at, prefix_of, prefix_len)
    WHERE input_digest IS NOT NULL;
-- A prune keeps a session while a request of another session names one of its requests.
CREATE INDEX requests_by_prefix_of ON requests(prefix_of) WHERE prefix_of IS NOT NULL;
