-- Performance (issue 16): a session's first message has no parent, and no query looks for a
-- parent that is NULL (`parent_id = $1` is never true of one): it no longer takes an entry
-- in the index of parents (one index insert fewer for a request that starts a session).
DROP INDEX messages_by_parent;
CREATE INDEX messages_by_parent ON messages(parent_id) WHERE parent_id IS NOT NULL;
