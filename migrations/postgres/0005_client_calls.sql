-- Client tools (issue 13); see migrations/sqlite/0008_client_calls.sql.
CREATE INDEX tool_calls_client_call_id ON tool_calls (model_call_id) WHERE tool_id LIKE 'client.%';
