//! Memory (issue 12) through the real server over HTTP, on both stores: a fact an agent
//! writes in one session, approved by an operator, reaches the upstream's system message in
//! a new session; a rejected one never does; `user/` memory stays with its key; an external
//! provider is used, and one that fails does not fail the run; export then import into a
//! fresh store round-trips; bad input is refused with its position.

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use super::control::{OTHER_CLIENT_KEY, spawn, submit};
use super::trust::data_of;
use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, TestApp, api_workspace, types};
use crate::helpers::TestWorkspace;

/// `api_workspace` with memory on (candidates wait for an operator unless `approval` is
/// false), a `memory.write` tool, and the agent `rememberer`: `user/{user}` memory, then
/// its own `agent/` memory. `agent_extra` extends the agent's `memory` block.
fn memory_workspace(
    upstream: &MockUpstream,
    approval: bool,
    runtime_extra: &str,
    agent_extra: &str,
) -> TestWorkspace {
    let workspace = api_workspace(
        upstream,
        &format!(
            "  memory:\n    enabled: true\n    write: {{ requireApproval: {approval}, maxContentBytes: 200 }}\n{runtime_extra}"
        ),
    );
    workspace.write(
        "config/catalogs/memory.yaml",
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: memory }\nspec:\n  tools:\n    - { id: memory.write, builtin: memory.write }\n",
    );
    workspace.write(
        "config/agents/rememberer.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: {{ name: rememberer }}\nspec:\n  backend: openai\n  model: main\n  tools: [memory.write]\n  memory: {{ namespaces: [\"user/{{user}}\", \"agent/{{agentId}}\"]{agent_extra} }}\n"
        ),
    );
    workspace
}

/// Imports JSON Lines `data` through the operators' memory API: the status and the report.
async fn import(app: &TestApp, data: &str) -> (u16, Value) {
    app.post(
        "/admin/memory/maintenance",
        ADMIN_KEY,
        &json!({ "operation": "import", "data": data }),
    )
    .await
}

/// Runs one request of `rememberer` for `user` with `key` to its end; its request id.
async fn turn(app: &TestApp, key: &str, user: &str, text: &str) -> String {
    let body = json!({ "agentId": "rememberer", "input": { "text": text },
        "metadata": { "user": user }, "wait": true });
    let (status, view) = app.post("/runtime/requests", key, &body).await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["status"], "completed", "{view}");
    view["requestId"].as_str().unwrap().to_owned()
}

/// The memory block of the system messages the upstream got last.
fn memory_block(upstream: &MockUpstream) -> String {
    let call = upstream.calls().last().cloned().expect("an upstream call");
    call.body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "system")
        .filter_map(|m| m["content"].as_str())
        .filter(|text| text.contains("<memory>"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn remember(content: &str) -> Reply {
    Reply::call("memory_write", &json!({ "content": content }).to_string())
}

on_both_stores!(an_approved_fact_is_recalled_in_a_new_session_and_a_rejected_one_never);
async fn an_approved_fact_is_recalled_in_a_new_session_and_a_rejected_one_never(
    store: Option<String>,
) {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("noted".into()));
    let app = spawn(memory_workspace(&upstream, true, "", ""), store).await;

    upstream.push([
        remember("Ada's favourite tea is oolong"),
        Reply::Text("noted".into()),
    ]);
    let first = turn(&app, CLIENT_KEY, "ada", "remember my favourite tea: oolong").await;
    let events = app.events(&first).await;
    let kinds = types(&events);
    for kind in [
        "runtime.memory.lifecycle",
        "runtime.memory.candidate.submitted",
        "runtime.memory.approval.requested",
    ] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} in {kinds:?}");
    }
    let submitted = &data_of(&events, "runtime.memory.candidate.submitted")[0];
    assert_eq!(submitted["decision"], "pending", "{submitted}");
    assert_eq!(submitted["candidate"]["namespace"], "user/ada");
    let hooks: Vec<Value> = data_of(&events, "runtime.memory.lifecycle")
        .iter()
        .map(|d| d["hook"].clone())
        .collect();
    assert_eq!(hooks, [json!("read-before-plan"), json!("write-after-run")]);

    // Pending: not recalled yet.
    turn(&app, CLIENT_KEY, "ada", "which tea do I like?").await;
    assert!(!memory_block(&upstream).contains("oolong"));

    let (status, pending) = app.get("/admin/memory?status=pending", ADMIN_KEY).await;
    assert_eq!(status, 200, "{pending}");
    let record = pending["data"][0].clone();
    assert_eq!(record["namespace"], "user/ada", "{pending}");
    assert_eq!(record["content"], "Ada's favourite tea is oolong");
    assert_eq!(record["sourceRequestId"], first.as_str());
    let id = record["id"].as_str().unwrap().to_owned();
    let (status, approved) = app
        .post(
            &format!("/admin/memory/{id}/approve"),
            ADMIN_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(
        (status, approved["status"].as_str()),
        (200, Some("active")),
        "{approved}"
    );
    assert!(approved["decidedBy"].is_string());

    // A second fact, rejected by the operator.
    upstream.push([remember("Ada hates coffee"), Reply::Text("noted".into())]);
    turn(&app, CLIENT_KEY, "ada", "also: I hate coffee").await;
    let (_, pending) = app.get("/admin/memory?status=pending", ADMIN_KEY).await;
    let rejected_id = pending["data"][0]["id"].as_str().unwrap().to_owned();
    let (status, rejected) = app
        .post(
            &format!("/admin/memory/{rejected_id}/reject"),
            ADMIN_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(
        (status, rejected["status"].as_str()),
        (200, Some("rejected"))
    );
    let (status, error) = app
        .post(
            &format!("/admin/memory/{rejected_id}/approve"),
            ADMIN_KEY,
            &json!({}),
        )
        .await;
    assert_eq!(status, 409, "{error}");
    assert_eq!(error["error"]["code"], "memory_not_pending");

    // A new session: the approved fact reaches the model, the rejected one never does.
    let asked = turn(&app, CLIENT_KEY, "ada", "what tea and coffee do I like?").await;
    let block = memory_block(&upstream);
    assert!(block.contains("Ada's favourite tea is oolong"), "{block}");
    assert!(!block.contains("coffee"), "{block}");
    let events = app.events(&asked).await;
    let recalled = data_of(&events, "runtime.memory.recall.completed");
    let user_recall = recalled
        .iter()
        .find(|d| d["namespace"] == "user/ada")
        .expect("a recall of user/ada");
    assert_eq!(user_recall["recordIds"], json!([id]));

    // Another key claiming the same user sees none of it.
    turn(&app, OTHER_CLIENT_KEY, "ada", "what tea do I like?").await;
    assert!(!memory_block(&upstream).contains("oolong"));
    // `/v1`'s `user` fills `{user}` as the runtime metadata does.
    let (response, _) = app
        .chat(&json!({ "model": "rememberer", "user": "ada",
            "messages": [{ "role": "user", "content": "which tea?" }] }))
        .await;
    assert_eq!(response.status(), 200);
    assert!(memory_block(&upstream).contains("oolong"));

    // The same fact proposed again merges into the record, even once approved.
    upstream.push([
        remember("Ada's favourite tea is oolong"),
        Reply::Text("noted".into()),
    ]);
    let again = turn(&app, CLIENT_KEY, "ada", "oolong, remember?").await;
    let events = app.events(&again).await;
    let submitted = &data_of(&events, "runtime.memory.candidate.submitted")[0];
    assert_eq!(submitted["decision"], "merged", "{submitted}");
    assert_eq!(submitted["record"]["memoryId"], id.as_str());
    let (_, all) = app
        .get("/admin/memory?namespace=user%2Fada", ADMIN_KEY)
        .await;
    assert_eq!(all["data"].as_array().unwrap().len(), 2, "{all}");

    // Search and owner filters.
    let (_, found) = app.get("/admin/memory?q=oolong", ADMIN_KEY).await;
    assert_eq!(found["data"].as_array().unwrap().len(), 1, "{found}");
    let owner = found["data"][0]["owner"].as_str().unwrap().to_owned();
    let (_, owned) = app
        .get(
            &format!("/admin/memory?owner={owner}&status=rejected"),
            ADMIN_KEY,
        )
        .await;
    assert_eq!(owned["data"][0]["id"], rejected_id.as_str(), "{owned}");

    // Delete: gone, then not found.
    let delete = |id: String| {
        app.http
            .delete(app.url(&format!("/admin/memory/{id}")))
            .bearer_auth(ADMIN_KEY)
            .send()
    };
    assert_eq!(delete(rejected_id.clone()).await.unwrap().status(), 204);
    assert_eq!(delete(rejected_id.clone()).await.unwrap().status(), 404);
    let (status, _) = app
        .get(&format!("/admin/memory/{rejected_id}"), ADMIN_KEY)
        .await;
    assert_eq!(status, 404);
    let (status, _) = app.get("/admin/memory", CLIENT_KEY).await;
    assert_eq!(status, 403, "a client key never reads memory records");
}

on_both_stores!(an_external_provider_serves_memory_and_a_failing_one_never_fails_the_run);
async fn an_external_provider_serves_memory_and_a_failing_one_never_fails_the_run(
    store: Option<String>,
) {
    let service = MemoryService::start().await;
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("ok".into()));
    let providers = format!(
        "    providers:\n      - {{ name: team, url: \"{}\", apiKeyEnv: CARGO_MANIFEST_DIR }}\n      - {{ name: down, url: \"http://127.0.0.1:9\", timeout: 1s }}\n",
        service.url
    );
    let workspace = memory_workspace(&upstream, false, &providers, ", provider: team");
    workspace.write(
        "config/agents/fragile.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: fragile }\nspec:\n  backend: openai\n  model: main\n  tools: [memory.write]\n  memory: { namespace: \"agent/{agentId}\", provider: down }\n",
    );
    let app = spawn(workspace, store).await;

    upstream.push([
        remember("The VPN needs the new client"),
        Reply::Text("ok".into()),
    ]);
    turn(
        &app,
        CLIENT_KEY,
        "bo",
        "the VPN needs the new client, remember",
    )
    .await;
    let writes = service.writes();
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert_eq!(writes[0]["protocol"], "stable-harness.memory/v1");
    assert_eq!(writes[0]["namespace"], "user/bo");
    assert_eq!(writes[0]["content"], "The VPN needs the new client");
    assert_eq!(writes[0]["requireApproval"], false);
    // Recall went to the service, with the request's words, and reached the model.
    let recalls = service.recalls();
    assert!(
        recalls
            .iter()
            .any(|r| r["query"].as_str().unwrap_or("").contains("VPN"))
    );
    assert!(memory_block(&upstream).contains("From the team service"));
    // Nothing was stored here: the service owns its records.
    let (_, local) = app.get("/admin/memory", ADMIN_KEY).await;
    assert_eq!(local["data"].as_array().unwrap().len(), 0, "{local}");
    // The service reported what its recall cost: charged to the budgets like a model call.
    let (_, usage) = app
        .get("/admin/usage?scope=model&id=memory:team", ADMIN_KEY)
        .await;
    assert!(usage["total"]["calls"].as_u64().unwrap() >= 1, "{usage}");
    assert_eq!(
        usage["total"]["promptTokens"].as_u64().unwrap(),
        40 * usage["total"]["calls"].as_u64().unwrap(),
        "{usage}"
    );
    assert_eq!(usage["total"]["estimatedCalls"], 0, "{usage}");

    // The provider that cannot be reached: the run completes, without memory.
    upstream.push([remember("Lost fact"), Reply::Text("still fine".into())]);
    let id = submit(
        &app,
        json!({ "agentId": "fragile", "input": { "text": "hello" } }),
    )
    .await;
    let done = app.wait_until_done(&id).await;
    assert_eq!(done["status"], "completed", "{done}");
    let events = app.events(&id).await;
    let failures = data_of(&events, "runtime.memory.plugin.failed");
    let operations: Vec<&str> = failures
        .iter()
        .filter_map(|f| f["operation"].as_str())
        .collect();
    assert_eq!(operations, ["recall", "write"], "{failures:?}");
    assert_eq!(failures[0]["provider"], "down");
    let result = data_of(&events, "runtime.tool.direct.completed")[0].clone();
    assert_eq!(result["error"]["code"], "memory_unavailable", "{result}");
}

on_both_stores!(export_then_import_into_a_fresh_store_round_trips);
async fn export_then_import_into_a_fresh_store_round_trips(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    let app = spawn(memory_workspace(&upstream, true, "", ""), store).await;
    let lines = [
        json!({ "namespace": "agent/rememberer", "content": "Refunds take five days" }),
        json!({ "namespace": "user/ada", "scope": "key-a", "owner": "key-a", "content": "Ada likes oolong", "status": "pending", "metadata": { "topic": "tea" } }),
        json!({ "namespace": "user/ada", "scope": "key-a", "content": "Ada lives in Lyon", "status": "archived" }),
    ];
    let data: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let (status, report) = import(&app, &data).await;
    assert_eq!(status, 201, "{report}");
    assert_eq!(
        (report["imported"].as_u64(), report["merged"].as_u64()),
        (Some(3), Some(0))
    );

    let exported = app
        .http
        .post(app.url("/admin/memory/maintenance"))
        .bearer_auth(ADMIN_KEY)
        .json(&json!({ "operation": "export" }))
        .send()
        .await
        .unwrap();
    assert_eq!(exported.status(), 200);
    assert_eq!(exported.headers()["content-type"], "application/x-ndjson");
    let export = exported.text().await.unwrap();
    assert_eq!(export.lines().count(), 3, "{export}");

    // A fresh store (always SQLite here: a new folder) takes the export whole.
    let fresh = TestApp::spawn(memory_workspace(&upstream, true, "", "")).await;
    let (status, report) = import(&fresh, &export).await;
    assert_eq!(status, 201, "{report}");
    let listing = async |app: &TestApp| {
        let (_, page) = app.get("/admin/memory", ADMIN_KEY).await;
        let mut records: Vec<(String, String, String, String, Value)> = page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let text = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
                (
                    text("namespace"),
                    text("scope"),
                    text("content"),
                    text("status"),
                    r["metadata"].clone(),
                )
            })
            .collect();
        records.sort_by(|a, b| a.2.cmp(&b.2));
        records
    };
    assert_eq!(listing(&fresh).await, listing(&app).await);
    // Importing the same file again merges every record.
    let (_, again) = import(&fresh, &data).await;
    assert_eq!(again["merged"].as_u64(), Some(3), "{again}");

    // Compaction through the API: near-duplicates archived, the newest kept.
    let near = [
        json!({ "namespace": "agent/rememberer", "content": "refunds take five days!!", "createdAt": "2030-01-01T00:00:00Z" }),
    ];
    let near: String = near.iter().map(|l| format!("{l}\n")).collect();
    import(&app, &near).await;
    let (status, compacted) = app
        .post(
            "/admin/memory/maintenance",
            ADMIN_KEY,
            &json!({ "operation": "compact", "namespace": "agent/rememberer" }),
        )
        .await;
    assert_eq!(status, 200, "{compacted}");
    assert_eq!(compacted["merged"], 1, "{compacted}");
    let (_, store_view) = app.get("/admin/store", ADMIN_KEY).await;
    let operations = store_view.to_string();
    for operation in ["memory.import", "memory.export", "memory.compact"] {
        assert!(
            operations.contains(operation),
            "{operation} in {operations}"
        );
    }
}

on_both_stores!(bad_memory_input_is_refused_and_nothing_partial_is_imported);
async fn bad_memory_input_is_refused_and_nothing_partial_is_imported(store: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("ok".into()));
    let app = spawn(memory_workspace(&upstream, false, "", ""), store).await;

    // Oversized content: the model gets the error, the run goes on, nothing is stored.
    upstream.push([
        remember(&"x".repeat(300)),
        Reply::Text("too long, sorry".into()),
    ]);
    let id = turn(&app, CLIENT_KEY, "ada", "remember this essay").await;
    let events = app.events(&id).await;
    let result = data_of(&events, "runtime.tool.direct.completed")[0].clone();
    assert_eq!(result["error"]["code"], "content_too_large", "{result}");
    // So is metadata past the same bound.
    upstream.push([
        Reply::call(
            "memory_write",
            &json!({ "content": "ok", "metadata": { "blob": "y".repeat(300) } }).to_string(),
        ),
        Reply::Text("too much".into()),
    ]);
    let id = turn(&app, CLIENT_KEY, "ada", "remember this with a blob").await;
    let result = data_of(&app.events(&id).await, "runtime.tool.direct.completed")[0].clone();
    assert_eq!(result["error"]["code"], "content_too_large", "{result}");
    // Arguments off the schema never reach the provider.
    upstream.push([
        Reply::call("memory_write", r#"{"content":"x","namespace":"user/eve"}"#),
        Reply::Text("ok".into()),
    ]);
    turn(&app, CLIENT_KEY, "ada", "write elsewhere").await;
    let (_, all) = app.get("/admin/memory", ADMIN_KEY).await;
    assert_eq!(all["data"].as_array().unwrap().len(), 0, "{all}");

    // A namespace filter that is not a namespace; an unknown status; a bogus cursor.
    for (query, status, param) in [
        ("namespace=team%2Fx", 400, "namespace"),
        ("status=forgotten", 422, "status"),
        ("cursor=abc", 400, "cursor"),
    ] {
        let (got, error) = app.get(&format!("/admin/memory?{query}"), ADMIN_KEY).await;
        assert_eq!(
            (got, error["error"]["param"].as_str()),
            (status, Some(param)),
            "{query}: {error}"
        );
    }
    let (status, error) = app
        .post("/admin/memory/mem_0193/approve", ADMIN_KEY, &json!({}))
        .await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (404, Some("memory_not_found"))
    );

    // An import with bad lines names every one and imports nothing.
    let data = [
        json!({ "namespace": "agent/rememberer", "content": "fine" }).to_string(),
        "{not json".to_owned(),
        json!({ "namespace": "team/x", "content": "y" }).to_string(),
        json!({ "namespace": "user/ada", "content": "no scope" }).to_string(),
        json!({ "namespace": "agent/rememberer", "content": "z".repeat(300) }).to_string(),
    ]
    .join("\n");
    let (status, error) = import(&app, &data).await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(error["error"]["code"], "invalid_import");
    let message = error["error"]["message"].as_str().unwrap();
    for line in ["line 2:", "line 3:", "line 4:", "line 5:"] {
        assert!(message.contains(line), "{line} in {message}");
    }
    assert!(!message.contains("line 1:"), "{message}");
    let (_, all) = app.get("/admin/memory", ADMIN_KEY).await;
    assert_eq!(
        all["data"].as_array().unwrap().len(),
        0,
        "nothing partial: {all}"
    );
    // Asked to, it imports the good lines and reports the others.
    let (status, report) = app
        .post(
            "/admin/memory/maintenance",
            ADMIN_KEY,
            &json!({ "operation": "import", "data": data, "skipInvalid": true }),
        )
        .await;
    assert_eq!(status, 201, "{report}");
    assert_eq!(report["imported"], 1);
    assert_eq!(report["skipped"].as_array().unwrap().len(), 4);
    let (status, error) = app
        .post(
            "/admin/memory/maintenance",
            ADMIN_KEY,
            &json!({ "operation": "import" }),
        )
        .await;
    assert_eq!(
        (status, error["error"]["param"].as_str()),
        (422, Some("data"))
    );
    let (status, error) = app
        .post(
            "/admin/memory/maintenance",
            ADMIN_KEY,
            &json!({ "operation": "shred" }),
        )
        .await;
    assert_eq!(
        (status, error["error"]["param"].as_str()),
        (422, Some("operation")),
        "{error}"
    );
}

/// A team's memory service on loopback, speaking `stable-harness.memory/v1`: it answers every
/// recall with one record and keeps every write it is sent. It wants its bearer key: the
/// value of `CARGO_MANIFEST_DIR`, a variable cargo sets for every test process (tests cannot
/// set one of their own without `unsafe`).
struct MemoryService {
    url: String,
    seen: Arc<Mutex<Vec<(String, Value)>>>,
}

const SERVICE_KEY: &str = env!("CARGO_MANIFEST_DIR");

impl MemoryService {
    async fn start() -> Self {
        let seen: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
        let kept = Arc::clone(&seen);
        let app = axum::Router::new().route(
            "/{operation}",
            axum::routing::post(
                move |axum::extract::Path(operation): axum::extract::Path<String>,
                      headers: axum::http::HeaderMap,
                      axum::Json(body): axum::Json<Value>| {
                    let kept = Arc::clone(&kept);
                    async move {
                        let authorized = headers
                            .get("authorization")
                            .and_then(|v| v.to_str().ok())
                            == Some(&format!("Bearer {SERVICE_KEY}"));
                        if !authorized {
                            return (axum::http::StatusCode::UNAUTHORIZED, axum::Json(json!({})));
                        }
                        kept.lock().unwrap().push((operation.clone(), body));
                        let answer = match operation.as_str() {
                            "recall" => json!({ "records": [{ "id": "team-1", "content": "From the team service: use the new VPN client" }],
                                "usage": { "prompt_tokens": 40, "completion_tokens": 2, "costUsd": 0.0001 } }),
                            _ => json!({ "id": "team-2", "status": "active" }),
                        };
                        (axum::http::StatusCode::OK, axum::Json(answer))
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, seen }
    }

    fn of(&self, operation: &str) -> Vec<Value> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(op, _)| op == operation)
            .map(|(_, body)| body.clone())
            .collect()
    }

    fn writes(&self) -> Vec<Value> {
        self.of("write")
    }

    fn recalls(&self) -> Vec<Value> {
        self.of("recall")
    }
}

/// On PostgreSQL a record's words go into the word index as it is written, imported or
/// written by the model: no pending list is left for every recall to read whole until a
/// vacuum merges it (migration `0015`), and recall finds both kinds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_written_words_are_in_the_index_before_the_next_recall() {
    let url = crate::pg::fresh_database();
    let upstream = MockUpstream::start().await;
    upstream.set_default(Reply::Text("noted".into()));
    let app = spawn(
        memory_workspace(&upstream, false, "", ""),
        Some(url.clone()),
    )
    .await;
    let data: String = (0..200)
        .map(|i| {
            let line = json!({ "namespace": "agent/rememberer",
                "content": format!("Gateway fact {i}: the zephyr relay restarts nightly") });
            format!("{line}\n")
        })
        .collect();
    let (status, report) = import(&app, &data).await;
    assert_eq!(status, 201, "{report}");
    assert_eq!(report["imported"], 200, "{report}");
    upstream.push([
        remember("The quokka relay moved to rack nine"),
        Reply::Text("noted".into()),
    ]);
    turn(
        &app,
        CLIENT_KEY,
        "ada",
        "remember where the quokka relay is",
    )
    .await;

    crate::pg::psql(&url, "CREATE EXTENSION IF NOT EXISTS pgstattuple");
    let index = crate::pg::psql(
        &url,
        "SELECT (SELECT reloptions::text FROM pg_class WHERE relname = 'memories_by_words')
                || ' ' || pending_tuples FROM pgstatginindex('memories_by_words')",
    );
    assert_eq!(index.trim(), "{fastupdate=off} 0");

    turn(
        &app,
        CLIENT_KEY,
        "ada",
        "when does the zephyr relay restart?",
    )
    .await;
    assert!(memory_block(&upstream).contains("zephyr relay restarts nightly"));
    turn(&app, CLIENT_KEY, "ada", "where is the quokka relay?").await;
    assert!(memory_block(&upstream).contains("rack nine"));
}
