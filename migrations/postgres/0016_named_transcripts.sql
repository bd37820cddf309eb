-- Performance (issue 16): a chat with no session sends its whole transcript every turn, and
-- each turn's request stored it whole. A turn whose transcript continues an earlier
-- request's (the same key's and agent's, found by the digest of that request's messages)
-- names the request that holds its first messages whole, and stores only the rest
-- (`prefixOf`, `prefixLen` in its input; `inputDigest`, the digest of its own transcript,
-- for the next turn to find it by). The indexes are on those members of the input, so the
-- batch function writes requests as before.
--
-- Building them reads every request's input, once for each, and holds the table's writes
-- until the migration commits.
-- The newest of one key's and agent's requests with a digest is the index's last entry for
-- them, however many others (another key's sending the same) share the digest.
CREATE INDEX requests_by_input_digest ON requests ((input ->> 'inputDigest'), owner, agent_id, id)
    WHERE input ? 'inputDigest';
-- A prune keeps a session while a request of another session names one of its requests.
CREATE INDEX requests_by_prefix_of ON requests ((input ->> 'prefixOf'))
    WHERE input ? 'prefixOf';
