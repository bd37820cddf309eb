-- Performance (issue 16): two b-trees fewer in a request's commit, each a page of the WAL.

-- A session's first message has no parent, and no query looks for a parent that is NULL
-- (`parent_id = ?` is never true of one). Its entry went to the index's NULL end, a page
-- apart from the newest entries: a chat request, which starts a session, wrote both pages.
DROP INDEX messages_by_parent;
CREATE INDEX messages_by_parent ON messages(parent_id) WHERE parent_id IS NOT NULL;

-- A charge was found by its key (`INSERT OR IGNORE` writes it once) and by its request,
-- through two indexes. Its id is made for it alone, so the pair (request, id) is as unique
-- as the id: one index serves both, and the table keeps no index of its own key.
CREATE TABLE usage_records_v13 (
    id TEXT NOT NULL,
    at TEXT NOT NULL,
    request_id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    agent_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    model TEXT NOT NULL,
    source TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost_nanos INTEGER,
    estimated INTEGER NOT NULL
);
INSERT INTO usage_records_v13 (id, at, request_id, run_id, owner, agent_id, session_id, model,
                               source, prompt_tokens, completion_tokens, cost_nanos, estimated)
SELECT id, at, request_id, run_id, owner, agent_id, session_id, model, source, prompt_tokens,
       completion_tokens, cost_nanos, estimated
  FROM usage_records ORDER BY rowid;
DROP TABLE usage_records;
ALTER TABLE usage_records_v13 RENAME TO usage_records;
CREATE INDEX usage_records_at ON usage_records (at);
CREATE UNIQUE INDEX usage_records_request ON usage_records (request_id, id);
