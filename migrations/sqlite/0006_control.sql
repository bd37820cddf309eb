-- The operator control plane (issue 11).
-- A cancel asked of a run that another instance (or nobody) executes: the holder stops it when
-- it next looks; a run nobody holds is claimed and ended as cancelled.
ALTER TABLE runs ADD COLUMN cancel_requested_by TEXT;
-- A forked session names where it branched off in its metadata (`forkedFrom`); a session
-- others branched from keeps its messages while they live (pruning asks this index).
CREATE INDEX sessions_by_fork_origin ON sessions(json_extract(metadata, '$.forkedFrom.sessionId'))
    WHERE json_extract(metadata, '$.forkedFrom.sessionId') IS NOT NULL;
-- Operators list sessions newest first, by agent or owner.
CREATE INDEX sessions_by_agent ON sessions(agent_id, id);
-- A message's children (a session's branches).
CREATE INDEX messages_by_parent ON messages(parent_id);
