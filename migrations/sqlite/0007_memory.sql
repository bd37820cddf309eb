-- Memory (issue 12): records agents remember across sessions, and their full-text index.
-- `scope` is the owner for `user/` and `session/` namespaces (recalled and written only within
-- that key) and '' for shared ones (`agent/`); `owner` is who wrote the record either way.
-- `content_hash` makes exact duplicates in a namespace one record; `near_hash` (the content
-- normalized: case, punctuation, spacing) finds the near-duplicates compaction merges.
CREATE TABLE memories (
    id                TEXT PRIMARY KEY,
    namespace         TEXT NOT NULL,
    scope             TEXT NOT NULL,
    owner             TEXT NOT NULL,
    content           TEXT NOT NULL,
    metadata          TEXT NOT NULL,
    status            TEXT NOT NULL,
    content_hash      TEXT NOT NULL,
    near_hash         TEXT NOT NULL,
    source_request_id TEXT,
    source_run_id     TEXT,
    decided_by        TEXT,
    created_at        TEXT NOT NULL,
    updated_at        TEXT NOT NULL
);
CREATE UNIQUE INDEX memories_by_content ON memories(namespace, scope, content_hash);
CREATE INDEX memories_by_near ON memories(namespace, scope, near_hash);
CREATE INDEX memories_by_recency ON memories(namespace, scope, status, updated_at);
CREATE INDEX memories_by_status ON memories(status, id);
CREATE INDEX memories_by_owner ON memories(owner, id);
-- The content's words (Porter-stemmed), kept in step with the table by triggers.
CREATE VIRTUAL TABLE memory_fts USING fts5(
    content, content = 'memories', content_rowid = 'rowid', tokenize = 'porter unicode61'
);
CREATE TRIGGER memories_indexed AFTER INSERT ON memories BEGIN
    INSERT INTO memory_fts(rowid, content) VALUES (new.rowid, new.content);
END;
CREATE TRIGGER memories_unindexed AFTER DELETE ON memories BEGIN
    INSERT INTO memory_fts(memory_fts, rowid, content) VALUES ('delete', old.rowid, old.content);
END;
CREATE TRIGGER memories_reindexed AFTER UPDATE OF content ON memories BEGIN
    INSERT INTO memory_fts(memory_fts, rowid, content) VALUES ('delete', old.rowid, old.content);
    INSERT INTO memory_fts(rowid, content) VALUES (new.rowid, new.content);
END;
