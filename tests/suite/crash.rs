//! The randomized crash test (issue 8): the real binary is killed with SIGKILL at seeded random
//! moments while requests with tool calls (some slow, some high risk) come in, and restarted
//! on the same store each time, while an operator approves whatever waits. Then: no
//! acknowledged request is lost, every request ends, `seq` is gapless, no call ran again after
//! its result was recorded, every re-execution carried the call's idempotency key, and no
//! high-risk call ran again without a decision taken between its executions.
//!
//! Sizes and seed come from the environment (printed, so a failure can be replayed):
//! `STABLE_HARNESS_CRASH_SEED` (default: random), `STABLE_HARNESS_CRASH_REQUESTS` (N,
//! default 12) and `STABLE_HARNESS_CRASH_KILLS` (M, default 3). The moments of the kills and
//! each request's plan of tool calls follow from the seed; where a kill lands in the work also
//! depends on the machine's timing. It runs on the embedded store and on PostgreSQL.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::api::upstream::{MockUpstream, Reply, Responder};
use crate::api::{
    ADMIN_KEY, CLIENT_KEY, Execution, RecordingTools, ServerProcess, all_events, api_workspace,
    approve_pending, get_json,
};
use crate::helpers::{TestWorkspace, store_path, store_rows};

/// The test's sizes and seed.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    seed: u64,
    requests: usize,
    kills: usize,
}

impl Sizes {
    fn from_env() -> Self {
        let number = |name: &str| {
            std::env::var(name).ok().map(|v| {
                v.trim()
                    .parse::<u64>()
                    .unwrap_or_else(|e| panic!("{name}={v:?}: {e}"))
            })
        };
        Self {
            seed: number("STABLE_HARNESS_CRASH_SEED").unwrap_or_else(|| fastrand::u64(..)),
            requests: number("STABLE_HARNESS_CRASH_REQUESTS").map_or(12, |n| n as usize),
            kills: number("STABLE_HARNESS_CRASH_KILLS").map_or(3, |n| n as usize),
        }
    }
}

/// The tools: (function name the model uses, path on the tool service, risk). High risk
/// needs an approval by policy.
const FAST: (&str, &str, &str) = ("fast_note", "/fast", "low");
const SLOW: (&str, &str, &str) = ("slow_write", "/slow", "medium");
const RISKY: (&str, &str, &str) = ("risky_pay", "/risky", "high");

/// One call a job's model asks for.
#[derive(Debug, Clone)]
struct Planned {
    function: &'static str,
    sleep_ms: u64,
}

/// The model turns of job `job`: 1 to 3 turns of 1 or 2 calls, each fast, slow (100-500ms) or
/// high risk (slow too). The same for a job whenever it is asked: a resumed run that asks the
/// model again gets the same turn.
fn plan(seed: u64, job: u64) -> Vec<Vec<Planned>> {
    let mut rng = fastrand::Rng::with_seed(seed ^ job.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..rng.usize(1..=3))
        .map(|_| {
            (0..rng.usize(1..=2))
                .map(|_| {
                    let (function, _, _) = match rng.u8(0..10) {
                        0..4 => FAST,
                        4..8 => SLOW,
                        _ => RISKY,
                    };
                    let sleep_ms = if function == FAST.0 {
                        0
                    } else {
                        rng.u64(100..=500)
                    };
                    Planned { function, sleep_ms }
                })
                .collect()
        })
        .collect()
}

/// The model: reads the job number from the request's first user message and the turn from
/// the number of assistant messages so far, and plays that job's plan. Every turn reuses the
/// call ids `call_0`, `call_1`, as some providers do. Each call's arguments name it (`op`:
/// job, turn, position), an identity the tool service sees independently of the server.
fn responder(seed: u64) -> Responder {
    Responder::new(move |body: &Value| {
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let job = messages
            .iter()
            .find(|m| m["role"] == "user")
            .and_then(|m| m["content"].as_str())
            .and_then(|text| text.strip_prefix("job "))
            .and_then(|n| n.parse::<u64>().ok());
        let Some(job) = job else {
            return Reply::Text("not a job".into());
        };
        let turn = messages.iter().filter(|m| m["role"] == "assistant").count();
        match plan(seed, job).get(turn) {
            Some(calls) => Reply::ToolCallsWithIds(
                calls
                    .iter()
                    .enumerate()
                    .map(|(position, call)| {
                        (
                            format!("call_{position}"),
                            call.function.to_owned(),
                            json!({ "op": format!("{job}.{turn}.{position}"), "sleep_ms": call.sleep_ms }).to_string(),
                        )
                    })
                    .collect(),
            ),
            None => Reply::Text(format!("job {job} done")),
        }
    })
}

fn crash_workspace(upstream: &MockUpstream, tools: &RecordingTools) -> TestWorkspace {
    let runtime = "  limits: { maxConcurrentRuns: 8 }\n  store: { leaseDuration: 5s }\n  governance:\n    default: allow\n    rules:\n      - { name: high-risk-needs-human, match: { risk: [high] }, decision: needs_approval }\n";
    let workspace = api_workspace(upstream, runtime);
    let tool = |(function, path, risk): (&str, &str, &str)| {
        format!(
            "    - {{ id: {}, risk: {risk}, timeout: 10s, http: {{ method: POST, url: \"{}{path}\" }} }}\n",
            function.replace('_', "."),
            tools.url
        )
    };
    workspace.write(
        "config/catalogs/tools.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: {{ name: tools }}\nspec:\n  tools:\n{}{}{}",
            tool(FAST),
            tool(SLOW),
            tool(RISKY)
        ),
    );
    workspace.write(
        "config/agents/worker.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: worker }\nspec:\n  backend: openai\n  model: main\n  tools: [fast.note, slow.write, risky.pay]\n  maxIterations: 5\n",
    );
    workspace
}

/// What the clients saw while the server kept dying.
#[derive(Default)]
struct Traffic {
    /// Requests acknowledged with 202: (request id, run id).
    acknowledged: Mutex<Vec<(String, String)>>,
    /// Submissions not acknowledged (refused, or cut by a kill).
    unacknowledged: AtomicUsize,
    approved: AtomicUsize,
}

/// Each instance's base URL; `None` while it is down.
type Base = Arc<Mutex<Vec<Option<String>>>>;

/// One of the instances that are up, chosen at random.
fn current(base: &Base) -> Option<String> {
    let up: Vec<String> = base.lock().unwrap().iter().flatten().cloned().collect();
    (!up.is_empty()).then(|| up[fastrand::usize(..up.len())].clone())
}

/// Submits jobs until `count` are acknowledged, with seeded random pauses.
async fn submitter(base: Base, traffic: Arc<Traffic>, count: usize, seed: u64) {
    let http = reqwest::Client::new();
    let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(1));
    let mut job = 0_u64;
    while traffic.acknowledged.lock().unwrap().len() < count {
        let Some(url) = current(&base) else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        job += 1;
        let sent = http
            .post(format!("{url}/runtime/requests"))
            .bearer_auth(CLIENT_KEY)
            .json(&json!({ "agentId": "worker", "input": { "text": format!("job {job}") } }))
            .send()
            .await;
        let accepted = match sent {
            Ok(response) if response.status() == 202 => response.json::<Value>().await.ok(),
            _ => None,
        };
        match accepted {
            Some(body) => traffic.acknowledged.lock().unwrap().push((
                body["requestId"].as_str().unwrap().to_owned(),
                body["runId"].as_str().unwrap().to_owned(),
            )),
            None => {
                traffic.unacknowledged.fetch_add(1, Ordering::SeqCst);
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(0..=150))).await;
    }
}

/// The operator: approves every pending approval, policy and interrupted alike.
async fn operator(base: Base, traffic: Arc<Traffic>, stop: Arc<AtomicBool>) {
    let http = reqwest::Client::new();
    while !stop.load(Ordering::SeqCst) {
        if let Some(url) = current(&base) {
            let approved = approve_pending(&http, &url).await;
            traffic.approved.fetch_add(approved, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
}

/// A stored tool call: its final record.
#[derive(Debug)]
struct StoredCall {
    run_id: String,
    call_key: String,
    op: String,
    outcome: String,
    recorded_at: DateTime<Utc>,
}

/// A stored approval.
#[derive(Debug)]
struct StoredApproval {
    kind: String,
    status: String,
    decided_at: Option<DateTime<Utc>>,
}

fn time(value: &Value) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(value.as_str().unwrap())
        .unwrap()
        .with_timezone(&Utc)
}

/// The checks' outcomes: each check passes or collects what broke it.
#[derive(Default)]
struct Checks {
    results: Vec<(&'static str, Vec<String>)>,
}

impl Checks {
    fn check(&mut self, name: &'static str, problems: Vec<String>) {
        self.results.push((name, problems));
    }

    fn passed(&self) -> usize {
        self.results.iter().filter(|(_, p)| p.is_empty()).count()
    }

    fn failed(&self) -> usize {
        self.results.len() - self.passed()
    }

    fn report(&self) -> String {
        self.results
            .iter()
            .filter(|(_, p)| !p.is_empty())
            .map(|(name, problems)| format!("{name}:\n  {}", problems.join("\n  ")))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_random_moments_the_server_loses_nothing_and_runs_no_call_twice_unasked() {
    crash_test(None, 1).await;
}

/// The same crash test with the store on PostgreSQL: each restarted instance claims the runs
/// of the killed one once their leases (5s here) expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_killed_at_random_moments_the_server_loses_nothing_and_runs_no_call_twice_unasked()
 {
    crash_test(Some(crate::pg::fresh_database()), 1).await;
}

/// Two instances on one PostgreSQL database, either one killed at each moment: clients and the
/// operator use whichever is up, the survivor takes the dead one's runs over, and a run only
/// changes hands when the instance executing it died.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_postgres_killed_in_turn_lose_nothing_and_never_share_a_run() {
    crash_test(Some(crate::pg::fresh_database()), 2).await;
}

/// The store's rows `sql` selects, whichever store it is, as the embedded store reads them
/// (JSON columns as JSON text, times as RFC 3339 text).
fn rows(
    db: &std::path::Path,
    postgres: Option<&str>,
    sql: &str,
) -> Vec<serde_json::Map<String, Value>> {
    let Some(url) = postgres else {
        return store_rows(db, sql);
    };
    let out = crate::pg::psql(
        url,
        &format!("SELECT coalesce(json_agg(t), '[]') FROM ({sql}) t"),
    );
    let rows: Vec<serde_json::Map<String, Value>> = serde_json::from_str(out.trim()).unwrap();
    rows.into_iter()
        .map(|row| {
            row.into_iter()
                .map(|(column, value)| match value {
                    Value::Object(_) | Value::Array(_) => {
                        (column, Value::String(value.to_string()))
                    }
                    other => (column, other),
                })
                .collect()
        })
        .collect()
}

#[allow(clippy::print_stderr)]
async fn crash_test(postgres: Option<String>, instances: usize) {
    stable_harness::app::install_crypto_provider();
    let server_env: Vec<(&str, &str)> = postgres
        .as_deref()
        .map(|url| vec![("STABLE_HARNESS_DATABASE_URL", url)])
        .unwrap_or_default();
    let sizes = Sizes::from_env();
    eprintln!(
        "crash test: {instances} instance(s), seed {} (replay: STABLE_HARNESS_CRASH_SEED={} STABLE_HARNESS_CRASH_REQUESTS={} STABLE_HARNESS_CRASH_KILLS={})",
        sizes.seed, sizes.seed, sizes.requests, sizes.kills
    );
    let upstream = MockUpstream::start().await;
    upstream.set_responder(responder(sizes.seed));
    let tools = RecordingTools::start().await;
    let workspace = crash_workspace(&upstream, &tools);
    let http = reqwest::Client::new();

    let traffic = Arc::new(Traffic::default());
    let base: Base = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut servers: Vec<ServerProcess> = (0..instances)
        .map(|_| ServerProcess::start(workspace.path(), &server_env))
        .collect();
    *base.lock().unwrap() = servers.iter().map(|s| Some(s.base.clone())).collect();
    // When each killed instance died, by the id it held leases as.
    let mut killed_at: HashMap<String, DateTime<Utc>> = HashMap::new();
    let submitting = tokio::spawn(submitter(
        Arc::clone(&base),
        Arc::clone(&traffic),
        sizes.requests,
        sizes.seed,
    ));
    let operating = tokio::spawn(operator(
        Arc::clone(&base),
        Arc::clone(&traffic),
        Arc::clone(&stop),
    ));

    // Kill -9 at seeded random moments (one of the instances), restarting on the same store
    // each time.
    let mut rng = fastrand::Rng::with_seed(sizes.seed);
    for _ in 0..sizes.kills {
        tokio::time::sleep(Duration::from_millis(rng.u64(150..=1200))).await;
        let victim = rng.usize(..instances);
        base.lock().unwrap()[victim] = None;
        let dead = servers.remove(victim);
        killed_at.insert(dead.instance.clone(), Utc::now());
        dead.kill9();
        let restarted = ServerProcess::start(workspace.path(), &server_env);
        base.lock().unwrap()[victim] = Some(restarted.base.clone());
        servers.insert(victim, restarted);
    }
    let server = &servers[0];
    tokio::time::timeout(Duration::from_secs(300), submitting)
        .await
        .expect("the submitter got its requests acknowledged")
        .unwrap();
    let acknowledged = traffic.acknowledged.lock().unwrap().clone();

    // Every request ends (bounded): polled through the admin API while the operator decides.
    let mut ended: BTreeMap<String, Value> = BTreeMap::new();
    let mut lost = Vec::new();
    for _ in 0..2400 {
        for (request_id, _) in &acknowledged {
            if ended.contains_key(request_id) {
                continue;
            }
            let (status, view) = get_json(
                &http,
                &server.url(&format!("/admin/requests/{request_id}")),
                ADMIN_KEY,
            )
            .await;
            if status == 404 {
                lost.push(request_id.clone());
                ended.insert(request_id.clone(), view);
            } else if matches!(
                view["status"].as_str(),
                Some("completed" | "failed" | "cancelled")
            ) {
                ended.insert(request_id.clone(), view);
            }
        }
        if ended.len() == acknowledged.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A submission stored without its acknowledgement ends too, taken over and approved like
    // the rest: the operator keeps deciding until none is open (bounded).
    for _ in 0..1200 {
        if open_requests(&http, server).await.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::SeqCst);
    operating.await.unwrap();

    let mut checks = Checks::default();
    checks.check(
        "no acknowledged request lost",
        lost.iter()
            .map(|id| format!("{id} is not in the store"))
            .collect(),
    );
    checks.check(
        "every request ends",
        acknowledged
            .iter()
            .filter(|(id, _)| !ended.contains_key(id))
            .map(|(id, _)| format!("{id} did not end"))
            .collect(),
    );
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for view in ended.values() {
        *statuses
            .entry(view["status"].as_str().unwrap_or("lost").to_owned())
            .or_default() += 1;
    }
    let mut gaps = Vec::new();
    let mut shared = Vec::new();
    let mut handovers = 0;
    for (request_id, _) in &acknowledged {
        if lost.contains(request_id) {
            continue;
        }
        let events = all_events(&http, &server.base, request_id).await;
        // Each execution of the run announces the instance that claimed it: it may change
        // hands only after the instance executing it died.
        let starts: Vec<(String, DateTime<Utc>)> = events
            .iter()
            .filter(|e| e["type"] == "runtime.request.started")
            .map(|e| {
                (
                    e["data"]["instance"].as_str().unwrap_or("?").to_owned(),
                    time(&e["at"]),
                )
            })
            .collect();
        for pair in starts.windows(2) {
            let ((before, started), (after, taken)) = (&pair[0], &pair[1]);
            handovers += 1;
            match killed_at.get(before) {
                Some(died) if started < died && died < taken => {}
                _ => shared.push(format!(
                    "{request_id}: {after} started the run at {taken} while {before}, which started it at {started}, had not died"
                )),
            }
        }
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        if seqs != (1..=seqs.len() as i64).collect::<Vec<_>>() {
            gaps.push(format!("{request_id}: seq {seqs:?}"));
        }
        let last = events.last().and_then(|e| e["type"].as_str()).unwrap_or("");
        let terminal = [
            "runtime.request.completed",
            "runtime.request.failed",
            "runtime.request.cancelled",
        ];
        if ended.contains_key(request_id) && !terminal.contains(&last) {
            gaps.push(format!(
                "{request_id}: ends with {last}, not a terminal event"
            ));
        }
    }
    checks.check("seq gapless, ending in the terminal event", gaps);
    checks.check(
        "a run changes instance only when the one executing it died",
        shared,
    );
    // Submissions cut by a kill may have been stored without an acknowledgement: they end too.
    let stored_open = open_requests(&http, server).await;
    checks.check(
        "every stored request ends, acknowledged or not",
        stored_open,
    );
    let failures: Vec<String> = ended
        .iter()
        .filter(|(_, view)| view["status"] != "completed")
        .map(|(id, view)| format!("{id}: {} {}", view["status"], view["error"]))
        .collect();
    for server in servers {
        server.terminate();
    }

    // What the store recorded, and what the tool service saw.
    let db = store_path(workspace.path());
    let calls: Vec<StoredCall> = rows(
        &db,
        postgres.as_deref(),
        "SELECT run_id, call_key, idempotency_key, arguments, outcome, recorded_at FROM tool_calls",
    )
    .into_iter()
    .map(|row| {
        let arguments: Value =
            serde_json::from_str(row["arguments"].as_str().unwrap()).unwrap_or(Value::Null);
        StoredCall {
            run_id: row["run_id"].as_str().unwrap().to_owned(),
            call_key: row["call_key"].as_str().unwrap().to_owned(),
            op: arguments["op"].as_str().unwrap_or_default().to_owned(),
            outcome: row["outcome"].as_str().unwrap().to_owned(),
            recorded_at: time(&row["recorded_at"]),
        }
    })
    .collect();
    let by_key: HashMap<String, &StoredCall> = calls
        .iter()
        .map(|call| (format!("{}.{}", call.run_id, call.call_key), call))
        .collect();
    let mut approvals: HashMap<(String, String), Vec<StoredApproval>> = HashMap::new();
    for row in rows(
        &db,
        postgres.as_deref(),
        "SELECT run_id, call_key, kind, status, decided_at FROM approvals",
    ) {
        approvals
            .entry((
                row["run_id"].as_str().unwrap().to_owned(),
                row["call_key"].as_str().unwrap().to_owned(),
            ))
            .or_default()
            .push(StoredApproval {
                kind: row["kind"].as_str().unwrap().to_owned(),
                status: row["status"].as_str().unwrap().to_owned(),
                decided_at: row["decided_at"].as_str().map(|_| time(&row["decided_at"])),
            });
    }
    let interrupted_approvals = approvals
        .values()
        .flatten()
        .filter(|a| a.kind == "interrupted")
        .count();
    let executions = tools.executions();
    let mut by_op: BTreeMap<String, Vec<&Execution>> = BTreeMap::new();
    for execution in &executions {
        let op = execution.body["op"].as_str().unwrap_or("?").to_owned();
        by_op.entry(op).or_default().push(execution);
    }
    let reexecutions = executions.len() - by_op.len();

    // Every execution of one call carries one key: the key of the stored call it is.
    let mut keys = Vec::new();
    let mut key_owner: HashMap<&str, &str> = HashMap::new();
    for (op, runs_of_op) in &by_op {
        let distinct: Vec<Option<&str>> = {
            let mut seen: Vec<Option<&str>> = runs_of_op
                .iter()
                .map(|e| e.idempotency_key.as_deref())
                .collect();
            seen.sort_unstable();
            seen.dedup();
            seen
        };
        match distinct.as_slice() {
            [Some(key)] => {
                if let Some(other) = key_owner.insert(key, op) {
                    keys.push(format!("ops {other} and {op} share the key {key}"));
                }
                match by_key.get(*key) {
                    Some(stored) if stored.op == *op => {}
                    Some(stored) => {
                        keys.push(format!("{op}: key {key} is stored for op {}", stored.op))
                    }
                    None => keys.push(format!("{op}: key {key} has no stored call")),
                }
            }
            other => keys.push(format!("{op}: executions carried the keys {other:?}")),
        }
    }
    checks.check(
        "every re-execution carried the call's idempotency key",
        keys,
    );

    // No execution began after the call's result was recorded.
    let mut after_result = Vec::new();
    for (op, runs_of_op) in &by_op {
        let Some(stored) = runs_of_op[0]
            .idempotency_key
            .as_deref()
            .and_then(|key| by_key.get(key))
        else {
            continue;
        };
        if stored.outcome == "started" {
            continue;
        }
        for execution in runs_of_op {
            if execution.at >= stored.recorded_at {
                after_result.push(format!(
                    "{op}: executed at {} after its result ({}) was recorded at {}",
                    execution.at, stored.outcome, stored.recorded_at
                ));
            }
        }
    }
    checks.check(
        "no call executed after its result was recorded",
        after_result,
    );

    // A high-risk call runs only after an approval, and again only after a decision taken
    // between the earlier execution and this one.
    let mut unasked = Vec::new();
    for (op, runs_of_op) in &by_op {
        if runs_of_op[0].path != RISKY.1 {
            continue;
        }
        let Some(stored) = runs_of_op[0]
            .idempotency_key
            .as_deref()
            .and_then(|key| by_key.get(key))
        else {
            continue;
        };
        let decisions = approvals
            .get(&(stored.run_id.clone(), stored.call_key.clone()))
            .map(Vec::as_slice)
            .unwrap_or_default();
        let decided_between = |kind: &str, from: Option<DateTime<Utc>>, to: DateTime<Utc>| {
            decisions.iter().any(|a| {
                a.kind == kind
                    && a.status == "approved"
                    && a.decided_at
                        .is_some_and(|at| at < to && from.is_none_or(|from| at > from))
            })
        };
        let mut previous = None;
        for (index, execution) in runs_of_op.iter().enumerate() {
            let kind = if index == 0 { "policy" } else { "interrupted" };
            if !decided_between(kind, previous, execution.at) {
                unasked.push(format!(
                    "{op}: execution {} at {} had no {kind} approval decided since {previous:?}",
                    index + 1,
                    execution.at
                ));
            }
            previous = Some(execution.at);
        }
    }
    checks.check("no high-risk call re-executed without a decision", unasked);

    eprintln!(
        "crash test summary: seed={} N={} M={} acknowledged={} unacknowledged={} executions={} re-executions={} interrupted-approvals={} approved-by-operator={} runs-taken-over={handovers}; requests: {} completed, {} failed, {} cancelled; checks: {} passed, {} failed",
        sizes.seed,
        sizes.requests,
        sizes.kills,
        acknowledged.len(),
        traffic.unacknowledged.load(Ordering::SeqCst),
        executions.len(),
        reexecutions,
        interrupted_approvals,
        traffic.approved.load(Ordering::SeqCst),
        statuses.get("completed").copied().unwrap_or(0),
        statuses.get("failed").copied().unwrap_or(0),
        statuses.get("cancelled").copied().unwrap_or(0),
        checks.passed(),
        checks.failed(),
    );
    if !failures.is_empty() {
        eprintln!(
            "requests that did not complete:\n  {}",
            failures.join("\n  ")
        );
    }
    assert_eq!(
        checks.failed(),
        0,
        "seed {}: {}",
        sizes.seed,
        checks.report()
    );
}

/// The stored requests that have not ended, as "id is status", read through the admin API.
async fn open_requests(http: &reqwest::Client, server: &ServerProcess) -> Vec<String> {
    let mut open = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page_url = match &cursor {
            Some(cursor) => format!("/admin/requests?limit=200&cursor={cursor}"),
            None => "/admin/requests?limit=200".to_owned(),
        };
        let (status, page) = get_json(http, &server.url(&page_url), ADMIN_KEY).await;
        assert_eq!(status, 200, "{page}");
        for view in page["data"].as_array().cloned().unwrap_or_default() {
            if !matches!(
                view["status"].as_str(),
                Some("completed" | "failed" | "cancelled")
            ) {
                open.push(format!("{} is {}", view["requestId"], view["status"]));
            }
        }
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    open
}
