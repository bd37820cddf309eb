//! Budgets and rate limits (issue 15), driven over HTTP against a loopback upstream that
//! reports usage: concurrent requests never overshoot a budget (used + reserved sampled while
//! they run), budgets survive a restart and are shared by two instances on PostgreSQL,
//! retries and tool-loop turns are charged, a stream is charged from its final usage chunk,
//! and rate limits answer 429 with `retry-after`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use super::upstream::{MockUpstream, Reply};
use super::{ADMIN_KEY, CLIENT_KEY, TestApp, api_workspace};
use crate::helpers::TestWorkspace;

/// Each call reports 10 prompt and 10,000 completion tokens, and reserves its prompt estimate
/// (50 to 200 tokens for these small requests) plus `maxOutputTokens` (10,000): five calls fit
/// in 51,100 tokens side by side, a sixth never does, and once five are charged (50,050) no
/// reservation fits in what is left.
const FIVE_CALLS: u64 = 51_100;

fn metered(pause_ms: u64) -> Reply {
    Reply::Metered {
        text: "metered answer".into(),
        usage: Some((10, 10_000)),
        pause: Duration::from_millis(pause_ms),
    }
}

/// A workspace whose `main` model states `maxOutputTokens: 10000` and a price, with
/// `budgets` and `rateLimits` as given (YAML list items, indented by 4).
fn spend_workspace(upstream: &MockUpstream, budgets: &str, rate_limits: &str) -> TestWorkspace {
    let mut extra = String::new();
    if !budgets.is_empty() {
        extra.push_str(&format!("  budgets:\n{budgets}"));
    }
    if !rate_limits.is_empty() {
        extra.push_str(&format!("  rateLimits:\n{rate_limits}"));
    }
    let workspace = api_workspace(upstream, &extra);
    workspace.write(
        "config/catalogs/models.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: {{ name: models }}\nspec:\n  models:\n    - {{ id: main, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: main-upstream, timeout: 5s, maxOutputTokens: 10000, pricing: {{ inputPerMTok: 1, outputPerMTok: 2 }} }}\n    - {{ id: flaky, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: flaky-upstream, timeout: 5s, fallbacks: [main], maxOutputTokens: 10000, pricing: {{ inputPerMTok: 1, outputPerMTok: 2 }} }}\n    - {{ id: slow, provider: openai-compatible, baseUrl: \"{url}\", upstreamModel: slow-upstream, timeout: 1s }}\n",
            url = upstream.url
        ),
    );
    workspace.write(
        "config/catalogs/tools.yaml",
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - { id: clock.now, builtin: clock.now }\n",
    );
    workspace.write(
        "config/agents/agents.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: main\n  instructions: You are a test assistant.\n  tools: [clock.now]\n---\napiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: greeter }\nspec:\n  backend: scripted\n  script: [{ reply: \"Hello {{input}}\" }]\n",
    );
    workspace
}

fn five_call_budget() -> String {
    format!(
        "    - {{ name: shared-pool, scope: workspace, maxTokens: {FIVE_CALLS}, window: 1h }}\n"
    )
}

async fn chat_status(
    http: &reqwest::Client,
    base: &str,
    content: &str,
) -> (u16, Value, Option<String>) {
    let response = http
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .json(
            &json!({ "model": "assistant", "messages": [{ "role": "user", "content": content }] }),
        )
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (
        status,
        response.json().await.unwrap_or(Value::Null),
        retry_after,
    )
}

/// Samples `/admin/budgets` until `stop`: every sample's used + reserved of `budget`.
fn sample_budget(
    base: String,
    budget: &'static str,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<u64>> {
    tokio::spawn(async move {
        let http = reqwest::Client::new();
        let mut samples = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            let (status, list) =
                super::get_json(&http, &format!("{base}/admin/budgets"), ADMIN_KEY).await;
            assert_eq!(status, 200, "{list}");
            for state in list["data"].as_array().unwrap() {
                if state["name"] == budget {
                    samples.push(
                        state["used"]["tokens"].as_u64().unwrap()
                            + state["reserved"]["tokens"].as_u64().unwrap(),
                    );
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        samples
    })
}

fn assert_refused_by(status: u16, body: &Value, retry_after: &Option<String>, budget: &str) {
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "budget_exceeded", "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    assert_eq!(body["error"]["param"], budget, "{body}");
    let seconds: u64 = retry_after.as_deref().unwrap().parse().unwrap();
    assert!((1..=86_400).contains(&seconds), "retry-after {seconds}");
}

async fn usage_total(app: &TestApp) -> Value {
    let (status, report) = app.get("/admin/usage", ADMIN_KEY).await;
    assert_eq!(status, 200, "{report}");
    report["total"].clone()
}

async fn concurrent_requests_never_overshoot(database: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.set_default(metered(300));
    let workspace = spend_workspace(&upstream, &five_call_budget(), "");
    let app = TestApp::spawn_on(workspace, database, &[CLIENT_KEY], &[ADMIN_KEY]).await;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_budget(app.base.clone(), "shared-pool", Arc::clone(&stop));
    let requests = (0..20).map(|i| {
        let (http, base) = (app.http.clone(), app.base.clone());
        tokio::spawn(async move { chat_status(&http, &base, &format!("request {i}")).await })
    });
    let answers = futures::future::join_all(requests).await;
    stop.store(true, Ordering::SeqCst);
    let samples = sampler.await.unwrap();
    let mut served = 0;
    for answer in answers {
        let (status, body, retry_after) = answer.unwrap();
        if status == 200 {
            served += 1;
        } else {
            assert_refused_by(status, &body, &retry_after, "shared-pool");
        }
    }
    assert_eq!(
        served, 5,
        "exactly the five calls the budget fits are served"
    );
    assert!(
        samples.len() > 3,
        "the budget was sampled while requests ran"
    );
    assert!(
        samples.iter().all(|total| *total <= FIVE_CALLS),
        "used + reserved passed the limit: {samples:?}"
    );
    assert!(
        samples.iter().any(|total| *total > 10_010),
        "reservations were visible: {samples:?}"
    );
    let total = usage_total(&app).await;
    assert_eq!(total["calls"], 5, "{total}");
    assert_eq!(total["totalTokens"], 50_050, "{total}");
    // Priced at 1 and 2 per million tokens.
    let cost = total["cost"].as_f64().unwrap();
    assert!(
        (cost - 5.0 * (10.0 + 20_000.0) / 1e6).abs() < 1e-9,
        "{total}"
    );
    // The budget's state: used as charged, nothing left reserved.
    let (_, list) = app.get("/admin/budgets", ADMIN_KEY).await;
    let state = &list["data"][0];
    assert_eq!(state["subject"], "*", "{list}");
    assert_eq!(state["used"]["tokens"], 50_050, "{list}");
    assert_eq!(state["reserved"]["tokens"], 0, "{list}");
    assert_eq!(state["limit"]["tokens"], FIVE_CALLS, "{list}");
    assert!(state["resetsAt"].is_string(), "{list}");
    // A refusal while running is announced, and counted in the metrics.
    let metrics = super::metrics_text(&app.http, &app.url("/metrics")).await;
    assert!(
        metrics.contains("stable_harness_budget_refusals_total{budget=\"shared-pool\""),
        "{metrics}"
    );
    assert!(
        metrics.contains("stable_harness_usage_tokens_total{"),
        "{metrics}"
    );
}
on_both_stores!(concurrent_requests_never_overshoot);

async fn a_budget_survives_a_restart(database: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.set_default(metered(0));
    // A rolling window: a calendar day's would start over if the test ran across midnight.
    let budget = "    - { name: per-key, scope: apiKey, maxTokens: 25000, window: 24h }\n";
    let workspace = spend_workspace(&upstream, budget, "");
    let app = TestApp::spawn_on(workspace, database.clone(), &[CLIENT_KEY], &[ADMIN_KEY]).await;
    for i in 0..2 {
        let (status, body, _) = chat_status(&app.http, &app.base, &format!("turn {i}")).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body, retry_after) = chat_status(&app.http, &app.base, "one more").await;
    assert_refused_by(status, &body, &retry_after, "per-key");
    let workspace = app.stop().await;
    let app = TestApp::spawn_on(workspace, database, &[CLIENT_KEY], &[ADMIN_KEY]).await;
    let (status, body, retry_after) = chat_status(&app.http, &app.base, "after the restart").await;
    assert_refused_by(status, &body, &retry_after, "per-key");
    assert_eq!(
        upstream.calls().len(),
        2,
        "no call reached the upstream after the budget was spent"
    );
    let (_, list) = app.get("/admin/budgets", ADMIN_KEY).await;
    assert_eq!(list["data"][0]["used"]["tokens"], 20_020, "{list}");
    assert_eq!(list["data"][0]["scope"], "apiKey", "{list}");
}
on_both_stores!(a_budget_survives_a_restart);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_postgres_share_a_budget_without_overshoot() {
    let database = crate::pg::fresh_database();
    let upstream = MockUpstream::start().await;
    upstream.set_default(metered(300));
    let first = TestApp::spawn_on(
        spend_workspace(&upstream, &five_call_budget(), ""),
        Some(database.clone()),
        &[CLIENT_KEY],
        &[ADMIN_KEY],
    )
    .await;
    let second = TestApp::spawn_on(
        spend_workspace(&upstream, &five_call_budget(), ""),
        Some(database),
        &[CLIENT_KEY],
        &[ADMIN_KEY],
    )
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_budget(first.base.clone(), "shared-pool", Arc::clone(&stop));
    let requests = (0..16).map(|i| {
        let app = if i % 2 == 0 { &first } else { &second };
        let (http, base) = (app.http.clone(), app.base.clone());
        tokio::spawn(async move { chat_status(&http, &base, &format!("request {i}")).await })
    });
    let answers = futures::future::join_all(requests).await;
    stop.store(true, Ordering::SeqCst);
    let samples = sampler.await.unwrap();
    let served = answers
        .into_iter()
        .map(|answer| answer.unwrap())
        .filter(|(status, body, retry_after)| {
            if *status != 200 {
                assert_refused_by(*status, body, retry_after, "shared-pool");
            }
            *status == 200
        })
        .count();
    assert_eq!(
        served, 5,
        "the two instances together serve what the budget fits"
    );
    assert!(
        samples.iter().all(|total| *total <= FIVE_CALLS),
        "{samples:?}"
    );
    assert_eq!(
        upstream.calls().len(),
        5,
        "no refused call reached the upstream"
    );
    let total = usage_total(&second).await;
    assert_eq!(total["totalTokens"], 50_050, "{total}");
}

async fn retries_and_tool_turns_are_all_charged(database: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.push([
        Reply::Status {
            status: 500,
            retry_after: None,
        },
        Reply::call("clock_now", "{}"),
        metered(0),
    ]);
    let workspace = spend_workspace(&upstream, "", "");
    let app = TestApp::spawn_on(workspace, database, &[CLIENT_KEY], &[ADMIN_KEY]).await;
    let (response, request_id) = app
        .chat(&json!({ "model": "assistant", "messages": [{ "role": "user", "content": "what time is it?" }] }))
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(upstream.calls().len(), 3);
    let (_, view) = app
        .get(&format!("/admin/requests/{request_id}"), ADMIN_KEY)
        .await;
    let charged = &view["charged"];
    assert_eq!(
        charged["calls"], 3,
        "the failed attempt, the tool turn and the answer: {view}"
    );
    // The 500 and the streamed tool turn reported no usage: each is charged its prompt's
    // estimate (and the turn its `{}` arguments, one token); the answer reported 10 + 10,000.
    assert_eq!(charged["estimatedCalls"], 2, "{view}");
    let prompt = charged["promptTokens"].as_u64().unwrap();
    assert!(prompt > 60 && prompt < 600, "{view}");
    assert_eq!(charged["completionTokens"], 10_001, "{view}");
    let events = app.events(&request_id).await;
    let recorded: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "runtime.usage.recorded")
        .collect();
    assert_eq!(recorded.len(), 3, "{events:?}");
    assert_eq!(recorded[0]["data"]["estimated"], true);
    assert_eq!(recorded[2]["data"]["completionTokens"], 10_000);
    assert_eq!(recorded[2]["data"]["key"], view["owner"]);
    // Usage by model and by day, and for this key.
    let (_, by_model) = app.get("/admin/usage?groupBy=model", ADMIN_KEY).await;
    assert_eq!(by_model["data"][0]["group"], "main", "{by_model}");
    assert_eq!(by_model["data"][0]["calls"], 3, "{by_model}");
    let owner = view["owner"].as_str().unwrap();
    let (_, by_day) = app
        .get(
            &format!("/admin/usage?scope=apiKey&id={owner}&groupBy=day"),
            ADMIN_KEY,
        )
        .await;
    // The three calls group under their day (two days only if they straddle UTC midnight).
    let days = by_day["data"].as_array().unwrap();
    assert!((1..=2).contains(&days.len()), "{by_day}");
    let is_a_day = |day: &Value| {
        let group = day["group"].as_str().unwrap_or_default();
        chrono::NaiveDate::parse_from_str(group, "%Y-%m-%d").is_ok()
    };
    assert!(days.iter().all(is_a_day), "{by_day}");
    let grouped: u64 = days.iter().filter_map(|day| day["calls"].as_u64()).sum();
    assert_eq!(grouped, 3, "{by_day}");
    assert_eq!(by_day["total"]["calls"], 3, "{by_day}");
    let (_, nobody) = app
        .get("/admin/usage?scope=agent&id=greeter", ADMIN_KEY)
        .await;
    assert_eq!(nobody["total"]["calls"], 0, "{nobody}");
}
on_both_stores!(retries_and_tool_turns_are_all_charged);

/// A waiting submit answers with the view the store keeps, read by the journal beside the
/// end's commit: it holds the end and the run's charge (on PostgreSQL committed with the end,
/// on the embedded store written before the read), and equals what a read afterwards returns.
async fn a_waited_answer_is_the_view_as_stored(database: Option<String>) {
    let upstream = MockUpstream::start().await;
    upstream.push([Reply::Metered {
        text: "a metered answer".into(),
        usage: Some((123, 456)),
        pause: Duration::ZERO,
    }]);
    let workspace = spend_workspace(&upstream, "", "");
    let app = TestApp::spawn_on(workspace, database, &[CLIENT_KEY], &[ADMIN_KEY]).await;
    let (status, waited) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "assistant", "input": { "text": "meter me" }, "wait": true }),
        )
        .await;
    assert_eq!(status, 200, "{waited}");
    assert_eq!(waited["output"], "a metered answer", "{waited}");
    assert_eq!(waited["charged"]["promptTokens"], 123, "{waited}");
    assert_eq!(waited["charged"]["completionTokens"], 456, "{waited}");
    assert_completed_and_as_stored(&app, &waited).await;
}

/// A waited answer shows its request completed, its run too and its one call charged, and
/// equals what a read of the request afterwards returns.
async fn assert_completed_and_as_stored(app: &TestApp, waited: &Value) {
    assert_eq!(waited["status"], "completed", "{waited}");
    assert_eq!(waited["runs"][0]["status"], "completed", "{waited}");
    assert_eq!(waited["charged"]["calls"], 1, "{waited}");
    let request_id = waited["requestId"].as_str().unwrap();
    let (status, read) = app
        .get(&format!("/runtime/requests/{request_id}"), CLIENT_KEY)
        .await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(*waited, read);
}

on_both_stores!(a_waited_answer_is_the_view_as_stored);

/// Requests ending in one commit have their views read together (on PostgreSQL in one
/// statement): each waiter is answered with its own request's view, as a read afterwards
/// returns it. The upstream holds every answer for the same time, so that the ends arrive
/// together.
async fn waits_ending_together_are_each_answered_with_their_own_view(database: Option<String>) {
    const WAITERS: usize = 12;
    let upstream = MockUpstream::start().await;
    upstream.push((0..WAITERS).map(|_| Reply::Metered {
        text: "answered together".into(),
        usage: Some((10, 20)),
        pause: Duration::from_millis(200),
    }));
    let workspace = spend_workspace(&upstream, "", "");
    let app = TestApp::spawn_on(workspace, database, &[CLIENT_KEY], &[ADMIN_KEY]).await;
    let waits = (0..WAITERS).map(|n| {
        let app = &app;
        async move {
            let waiter = format!("waiter {n}");
            let (status, waited) = app
                .post(
                    "/runtime/requests",
                    CLIENT_KEY,
                    &json!({
                        "agentId": "assistant",
                        "input": { "text": "answer with the others" },
                        "metadata": { "waiter": waiter },
                        "wait": true,
                    }),
                )
                .await;
            (waiter, status, waited)
        }
    });
    for (waiter, status, waited) in futures::future::join_all(waits).await {
        assert_eq!(status, 200, "{waited}");
        assert_eq!(waited["metadata"]["waiter"], waiter.as_str(), "{waited}");
        assert_completed_and_as_stored(&app, &waited).await;
    }
    assert_eq!(upstream.calls().len(), WAITERS);
}

on_both_stores!(waits_ending_together_are_each_answered_with_their_own_view);

/// On PostgreSQL a call's charge rides along with a batch of its run's writes, as on the
/// embedded store, instead of a transaction of its own before the run's end: the common
/// request commits once before its answer. The charge's ledger row was inserted by the same
/// transaction (`xmin`) as some of the request's events.
#[tokio::test]
async fn on_postgres_a_charge_commits_with_its_runs_writes() {
    let database = crate::pg::fresh_database();
    let upstream = MockUpstream::start().await;
    upstream.push([metered(0)]);
    let workspace = spend_workspace(&upstream, "", "");
    let app = TestApp::spawn_on(
        workspace,
        Some(database.clone()),
        &[CLIENT_KEY],
        &[ADMIN_KEY],
    )
    .await;
    let (response, request_id) = app
        .chat(&json!({ "model": "assistant", "messages": [{ "role": "user", "content": "hi" }] }))
        .await;
    assert_eq!(response.status(), 200);
    let count = |sql: String| crate::pg::psql(&database, &sql).trim().to_owned();
    assert_eq!(
        count(format!(
            "SELECT count(*) FROM usage_records WHERE request_id = '{request_id}'"
        )),
        "1",
        "the answer came after its charge was stored"
    );
    assert_eq!(
        count(format!(
            "SELECT count(*) FROM usage_records u WHERE u.request_id = '{request_id}' \
             AND EXISTS (SELECT 1 FROM events e WHERE e.request_id = u.request_id AND e.xmin = u.xmin)"
        )),
        "1",
        "the charge committed in a transaction of its own"
    );
}

/// On PostgreSQL the journal applies a batch per writer lane at once, each lane holding a
/// share of the requests, and a call's charge waits in its request's lane for a batch of
/// that lane. One request at a time, a charge in the wrong lane would wait for a lone write
/// (a quarter of a second) while its answer went out; many at once, the lanes' batches
/// overlap. Either way every waited answer holds its run's charge, in both lanes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_every_answer_holds_its_charge_whichever_lane_its_request_is_in() {
    const LANES: usize = 2;
    let database = crate::pg::fresh_database();
    let upstream = MockUpstream::start().await;
    upstream.set_default(metered(0));
    let workspace = spend_workspace(&upstream, "", "");
    let app = TestApp::spawn_on(workspace, Some(database), &[CLIENT_KEY], &[ADMIN_KEY]).await;
    let waited = |http: reqwest::Client, base: String, i: usize| async move {
        let answer = http
            .post(format!("{base}/runtime/requests"))
            .bearer_auth(CLIENT_KEY)
            .json(&json!({ "agentId": "assistant", "input": { "text": format!("meter {i}") }, "wait": true }))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        answer.json::<Value>().await.unwrap()
    };
    let mut lanes = std::collections::HashSet::new();
    let mut check = |view: &Value| {
        assert_eq!(view["status"], "completed", "{view}");
        assert_eq!(
            view["charged"]["calls"], 1,
            "the answer held its charge: {view}"
        );
        let request_id = view["requestId"].as_str().unwrap();
        lanes.insert(stable_harness::store::lane_of(request_id, LANES));
    };
    for i in 0..12 {
        check(&waited(app.http.clone(), app.base.clone(), i).await);
    }
    let together = (12..36).map(|i| tokio::spawn(waited(app.http.clone(), app.base.clone(), i)));
    for view in futures::future::join_all(together).await {
        check(&view.unwrap());
    }
    assert_eq!(lanes.len(), LANES, "the requests fell in every lane");
    let total = usage_total(&app).await;
    assert_eq!(total["calls"], 36, "{total}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_charged_from_its_final_usage_chunk_and_silence_is_estimated() {
    let upstream = MockUpstream::start().await;
    upstream.push([
        Reply::Metered {
            text: "a streamed answer in words".into(),
            usage: Some((123, 456)),
            pause: Duration::ZERO,
        },
        Reply::Metered {
            text: "an answer without usage".into(),
            usage: None,
            pause: Duration::ZERO,
        },
    ]);
    let app = TestApp::spawn(spend_workspace(&upstream, "", "")).await;
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (response, request_id) = app
            .chat(&json!({ "model": "assistant", "stream": true, "messages": [{ "role": "user", "content": "stream it" }] }))
            .await;
        assert_eq!(response.status(), 200);
        let text = response.text().await.unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        ids.push(request_id);
    }
    // The adapter always asks for usage in the stream.
    assert_eq!(
        upstream.calls()[0].body["stream_options"]["include_usage"],
        true
    );
    let (_, reported) = app
        .get(&format!("/admin/requests/{}", ids[0]), ADMIN_KEY)
        .await;
    assert_eq!(reported["charged"]["promptTokens"], 123, "{reported}");
    assert_eq!(reported["charged"]["completionTokens"], 456, "{reported}");
    assert_eq!(reported["charged"]["estimatedCalls"], 0, "{reported}");
    let expected = (123.0 + 2.0 * 456.0) / 1e6;
    assert!((reported["charged"]["cost"].as_f64().unwrap() - expected).abs() < 1e-12);
    let (_, silent) = app
        .get(&format!("/admin/requests/{}", ids[1]), ADMIN_KEY)
        .await;
    assert_eq!(silent["charged"]["estimatedCalls"], 1, "{silent}");
    // "an answer without usage" is 23 bytes: 8 tokens at one per three bytes.
    assert_eq!(silent["charged"]["completionTokens"], 8, "{silent}");
    assert!(
        silent["charged"]["promptTokens"].as_u64().unwrap() > 0,
        "{silent}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_request_stops_before_a_call_its_budget_cannot_fit() {
    let upstream = MockUpstream::start().await;
    upstream.push([Reply::call("clock_now", "{}"), metered(0), metered(0)]);
    // One reservation (10,050 to 10,200 tokens) fits beside what one request uses (its answer's
    // 10,010 tokens and its tool turn's estimate, about 100), not beside two.
    let budget = "    - { name: per-session, scope: session, maxTokens: 15000, window: total }\n";
    let app = TestApp::spawn(spend_workspace(&upstream, budget, "")).await;
    let ask = |content: &str| json!({ "model": "assistant", "user": "carol", "messages": [{ "role": "user", "content": content }] });
    let (response, _) = app.chat(&ask("what time is it?")).await;
    assert_eq!(response.status(), 200, "a tool turn and an answer fit");
    // The next request of the session is admitted (room is left), then its model call is
    // refused before it is sent.
    let (response, request_id) = app.chat(&ask("and now?")).await;
    assert_eq!(response.status(), 429);
    assert!(
        response.headers().get("retry-after").is_none(),
        "a `total` budget never resets: no retry-after"
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "budget_exceeded", "{body}");
    assert_eq!(body["error"]["param"], "per-session", "{body}");
    assert_eq!(
        upstream.calls().len(),
        2,
        "the refused call never reached the upstream"
    );
    let events = app.events(&request_id).await;
    let exceeded = events
        .iter()
        .find(|e| e["type"] == "runtime.budget.exceeded")
        .unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(exceeded["data"]["budget"], "per-session");
    assert_eq!(exceeded["data"]["scope"], "session");
    assert_eq!(exceeded["data"]["limit"]["tokens"], 15000);
    // The answer's 10,010 tokens and the tool turn's estimate.
    let used = exceeded["data"]["used"]["tokens"].as_u64().unwrap();
    assert!(used > 10_010 && used < 10_300, "{exceeded}");
    let view = app.wait_until_done(&request_id).await;
    assert_eq!(view["status"], "failed", "{view}");
    assert_eq!(view["error"]["kind"], "budget_exceeded", "{view}");
    // Another session has its own budget.
    let other = json!({ "model": "assistant", "user": "dave", "messages": [{ "role": "user", "content": "hi" }] });
    let (response, _) = app.chat(&other).await;
    assert_eq!(response.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_answer_429_with_retry_after() {
    let upstream = MockUpstream::start().await;
    let limits = "    - { name: two-a-minute, scope: apiKey, requestsPerMinute: 2 }\n    - { name: few-tokens, scope: agent, match: { agents: [assistant] }, tokensPerMinute: 20 }\n";
    let app = TestApp::spawn(spend_workspace(&upstream, "", limits)).await;
    let greet = json!({ "model": "greeter", "messages": [{ "role": "user", "content": "you" }] });
    for _ in 0..2 {
        let (status, body) = app.post("/v1/chat/completions", CLIENT_KEY, &greet).await;
        assert_eq!(status, 200, "{body}");
    }
    let response = app
        .http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEY)
        .json(&greet)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    let wait: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (1..=30).contains(&wait),
        "half a minute refills one request: {wait}"
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");
    assert_eq!(body["error"]["param"], "two-a-minute", "{body}");
    // The same limit on /runtime.
    let (status, body) = app
        .post(
            "/runtime/requests",
            CLIENT_KEY,
            &json!({ "agentId": "greeter", "input": { "text": "hi" } }),
        )
        .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokens_per_minute_limit_takes_each_calls_tokens() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(metered(0));
    let limits = "    - { name: few-tokens, scope: agent, match: { agents: [assistant] }, tokensPerMinute: 600 }\n";
    let app = TestApp::spawn(spend_workspace(&upstream, "", limits)).await;
    let (status, body, _) = chat_status(&app.http, &app.base, "spend them").await;
    assert_eq!(status, 200, "{body}");
    let (status, body, retry_after) = chat_status(&app.http, &app.base, "and again").await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");
    assert_eq!(body["error"]["param"], "few-tokens", "{body}");
    let wait: u64 = retry_after.unwrap().parse().unwrap();
    // 10,010 tokens taken from a bucket of 600 refilling 10 a second: about 16 minutes.
    assert!(wait > 900 && wait < 1_100, "{wait}");
    // Another agent is not limited.
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            CLIENT_KEY,
            &json!({ "model": "greeter", "messages": [{ "role": "user", "content": "you" }] }),
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_usage_command_reads_a_running_server() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(metered(0));
    let app = TestApp::spawn(spend_workspace(&upstream, "", "")).await;
    let (status, body, _) = chat_status(&app.http, &app.base, "count me").await;
    assert_eq!(status, 200, "{body}");
    let base = app.base.clone();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(crate::helpers::binary())
            .args(["usage", "--url", &base, "--by", "model", "--since", "1d"])
            .env("STABLE_HARNESS_ADMIN_KEY", ADMIN_KEY)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let header = stdout.lines().next().unwrap();
    assert!(
        header.starts_with("GROUP") && header.contains("ESTIMATED"),
        "{stdout}"
    );
    let row = stdout.lines().nth(1).unwrap();
    assert!(row.starts_with("main") && row.contains("10010"), "{stdout}");
    let base = app.base.clone();
    let bad = tokio::task::spawn_blocking(move || {
        std::process::Command::new(crate::helpers::binary())
            .args(["usage", "--url", &base, "--by", "colour"])
            .env("STABLE_HARNESS_ADMIN_KEY", ADMIN_KEY)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let (status, body) = app.get("/admin/usage?groupBy=colour", ADMIN_KEY).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["param"], "groupBy", "{body}");
    let (status, body) = app.get("/admin/usage?scope=agent", ADMIN_KEY).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["param"], "id", "{body}");
    let (status, _) = app.get("/admin/usage", CLIENT_KEY).await;
    assert_eq!(status, 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_that_is_not_a_positive_number_is_never_sent_upstream() {
    let upstream = MockUpstream::start().await;
    upstream.set_default(metered(0));
    // Room for one worst case of this model's 10,000-token answers, not two.
    let budget = "    - { name: tight, scope: workspace, maxTokens: 15000, window: 1h }\n";
    let app = TestApp::spawn(spend_workspace(&upstream, budget, "")).await;
    // `-1` reads as "no cap" on some servers: it never leaves; the model's cap was reserved.
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            CLIENT_KEY,
            &json!({ "model": "assistant", "max_tokens": -1, "max_completion_tokens": 0,
                     "messages": [{ "role": "user", "content": "no cap" }] }),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let sent = &upstream.calls()[0].body;
    assert!(sent.get("max_tokens").is_none(), "{sent}");
    assert!(sent.get("max_completion_tokens").is_none(), "{sent}");
    // A small cap beside a large one reserves the large one: 10,010 used + the larger cap's
    // worst case does not fit, though the smaller one's would.
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            CLIENT_KEY,
            &json!({ "model": "assistant", "max_completion_tokens": 1, "max_tokens": 9000,
                     "messages": [{ "role": "user", "content": "both caps" }] }),
        )
        .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "budget_exceeded", "{body}");
    assert_eq!(upstream.calls().len(), 1);
}
