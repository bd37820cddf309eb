-- Client tools (issue 13): calls handed to the client are found again by the id the client
-- was given, when its next call brings their results. Only client tools' calls are indexed.
CREATE INDEX tool_calls_client_call_id ON tool_calls (model_call_id) WHERE tool_id LIKE 'client.%';
