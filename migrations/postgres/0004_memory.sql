-- Memory (issue 12); see migrations/sqlite/0007_memory.sql. Full-text search is a stored
-- English tsvector of the content with a GIN index.
CREATE TABLE memories (
    id                TEXT COLLATE "C" PRIMARY KEY,
    namespace         TEXT COLLATE "C" NOT NULL,
    scope             TEXT COLLATE "C" NOT NULL,
    owner             TEXT COLLATE "C" NOT NULL,
    content           TEXT NOT NULL,
    metadata          JSONB NOT NULL,
    status            TEXT NOT NULL,
    content_hash      TEXT NOT NULL,
    near_hash         TEXT NOT NULL,
    source_request_id TEXT,
    source_run_id     TEXT,
    decided_by        TEXT,
    created_at        TIMESTAMPTZ NOT NULL,
    updated_at        TIMESTAMPTZ NOT NULL,
    words             TSVECTOR GENERATED ALWAYS AS (to_tsvector('english', content)) STORED
);
CREATE UNIQUE INDEX memories_by_content ON memories(namespace, scope, content_hash);
CREATE INDEX memories_by_near ON memories(namespace, scope, near_hash);
CREATE INDEX memories_by_recency ON memories(namespace, scope, status, updated_at);
CREATE INDEX memories_by_status ON memories(status, id);
CREATE INDEX memories_by_owner ON memories(owner, id);
CREATE INDEX memories_by_words ON memories USING GIN (words);
