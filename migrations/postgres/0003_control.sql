-- The operator control plane (issue 11); see migrations/sqlite/0006_control.sql.
ALTER TABLE runs ADD COLUMN cancel_requested_by TEXT;
CREATE INDEX sessions_by_fork_origin ON sessions ((metadata -> 'forkedFrom' ->> 'sessionId'))
    WHERE metadata -> 'forkedFrom' ->> 'sessionId' IS NOT NULL;
CREATE INDEX sessions_by_agent ON sessions(agent_id, id);
