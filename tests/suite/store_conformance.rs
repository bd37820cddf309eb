//! One conformance suite for the `Store` interface, run against both stores: the embedded
//! SQLite file and a real PostgreSQL (see `pg.rs`). Every test here runs twice, once per
//! store, from the same body: no behaviour is tested on one store only.

use std::sync::Arc;

use chrono::{Duration as Age, Utc};
use serde_json::json;
use stable_harness::store::{
    ApprovalDecision, ApprovalKind, ApprovalRecord, ApprovalStatus, EventRecord, MemoryFilter,
    MemoryRecord, MemoryStatus, MemoryTransition, MessageRecord, PageRequest, RequestFilter,
    RequestInput, RequestRecord, RunRecord, RunStatus, SessionRecord, Store, StoreError,
    ToolCallRecord, WriteOp,
};

/// Runs are leased for 5s in this suite, so expiry is seen within the tests (with a second of
/// margin either side of every expiry the tests look at).
const LEASE: std::time::Duration = std::time::Duration::from_secs(5);

fn options() -> stable_harness::store::OpenOptions {
    stable_harness::store::OpenOptions {
        lease: LEASE,
        ..Default::default()
    }
}

async fn sqlite_store() -> (Arc<dyn Store>, Option<tempfile::TempDir>) {
    let dir = tempfile::tempdir().unwrap();
    let store = stable_harness::store::open(None, dir.path(), &options())
        .await
        .unwrap();
    (store, Some(dir))
}

/// A store on the PostgreSQL database at `url`.
async fn postgres_store_at(url: &str) -> Arc<dyn Store> {
    stable_harness::store::open(Some(url), std::path::Path::new("."), &options())
        .await
        .unwrap()
}

async fn postgres_store() -> (Arc<dyn Store>, Option<tempfile::TempDir>) {
    (postgres_store_at(&crate::pg::fresh_database()).await, None)
}

/// A store on a fresh PostgreSQL database, and a connection of the test's own to it.
async fn postgres_store_and_probe() -> (Arc<dyn Store>, sqlx::PgConnection) {
    use sqlx::Connection;
    let url = crate::pg::fresh_database();
    let store = postgres_store_at(&url).await;
    let probe = sqlx::PgConnection::connect(&url).await.unwrap();
    (store, probe)
}

/// Ends every backend of the probe's database but the probe's own, as a database restart
/// would.
async fn end_every_other_backend(probe: &mut sqlx::PgConnection) {
    let ended: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(probe)
    .await
    .unwrap();
    assert!(!ended.is_empty() && ended.iter().all(|ended| *ended));
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let (store, _dir) = super::sqlite_store().await;
                super::$name(store).await;
            })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let (store, _dir) = super::postgres_store().await;
                super::$name(store).await;
            })*
        }
    };
}

conformance!(
    seq_stays_gapless_under_concurrent_appends,
    a_batch_of_many_events_keeps_each_events_fields_and_order,
    every_cursor_and_limit_reads_the_events_after_it,
    an_event_holding_u0000_is_stored_whole,
    pages_and_filters_list_requests_newest_first,
    an_approval_is_decided_once_under_concurrent_deciders,
    messages_form_a_tree_read_in_order,
    a_requests_last_message_is_its_newest_own_one_not_its_answer,
    a_sessions_newest_answers_come_newest_first_and_alone,
    a_long_history_is_read_root_first_and_whole,
    tool_call_records_count_executions_and_keep_results,
    client_calls_are_found_by_id_for_their_owner_and_completed_once,
    a_batch_is_all_or_nothing,
    pruning_takes_idle_sessions_whole_and_judges_again_before_deleting,
    approvals_page_newest_first_by_status,
    maintenance_records_and_stats_are_kept,
    a_runs_changes_and_tool_starts_are_fenced_to_its_lease_holder,
    claims_take_free_or_expired_runs_once_and_renewals_keep_them,
    memory_merges_duplicates_and_recalls_by_relevance_within_scope,
    an_import_merges_as_one_write_after_another_would,
    recall_keeps_the_best_in_order_and_reads_them_whole,
    memory_decisions_compaction_and_deletion,
    a_charge_counts_once_and_the_ledger_adds_up_by_group,
    a_charge_commits_with_the_next_batch_or_alone,
    a_request_is_read_in_full_with_runs_approvals_and_charges,
    a_view_never_shows_an_ended_request_with_a_live_run,
    updates_in_the_batch_that_inserts_leave_what_separate_transactions_leave,
    a_batch_of_many_submits_writes_what_one_op_at_a_time_writes,
    an_archive_reads_each_table_once_for_many_sessions_and_finds_what_single_reads_find,
    a_transcripts_holder_is_found_by_its_digest_and_kept_while_named,
);

fn session(id: &str, owner: &str, age: Age) -> WriteOp {
    let at = Utc::now() - age;
    WriteOp::TouchSession(SessionRecord {
        id: id.into(),
        agent_id: "assistant".into(),
        owner: owner.into(),
        metadata: json!({}),
        created_at: at,
        updated_at: at,
    })
}

fn request(id: &str, session: &str, owner: &str, status: RunStatus, age: Age) -> WriteOp {
    let at = Utc::now() - age;
    WriteOp::InsertRequest(RequestRecord {
        id: id.into(),
        session_id: session.into(),
        agent_id: if id.ends_with('b') {
            "billing"
        } else {
            "assistant"
        }
        .into(),
        protocol: "runtime".into(),
        owner: owner.into(),
        status,
        input: json!({ "messages": [{ "role": "user", "content": "hi\u{0}there" }] }),
        output: None,
        error: None,
        usage: None,
        metadata: json!({}),
        created_at: at,
        updated_at: at,
    })
}

fn run(id: &str, request: &str, status: RunStatus) -> WriteOp {
    let now = Utc::now();
    WriteOp::InsertRun(RunRecord {
        id: id.into(),
        request_id: request.into(),
        attempt: 1,
        status,
        state: None,
        error: None,
        created_at: now,
        updated_at: now,
        started_at: None,
        ended_at: None,
        lease: None,
        cancel_requested_by: None,
    })
}

/// A message of `session` saying its own id, as `role`: stored under `parent`, by `request`.
fn message_op(
    id: &str,
    session: &str,
    parent: Option<&str>,
    request: Option<&str>,
    role: &str,
    created_at: chrono::DateTime<Utc>,
) -> WriteOp {
    WriteOp::InsertMessage(MessageRecord {
        id: id.into(),
        session_id: session.into(),
        parent_id: parent.map(str::to_owned),
        request_id: request.map(str::to_owned),
        role: role.into(),
        content: json!({ "role": role, "content": id }),
        created_at,
    })
}

fn event(request: &str, run: &str, seq: i64) -> WriteOp {
    WriteOp::AppendEvent(EventRecord {
        id: stable_harness::runtime::new_id("evt"),
        request_id: request.into(),
        run_id: run.into(),
        session_id: "".into(),
        agent_id: "".into(),
        seq,
        event_type: "runtime.adapter.event".into(),
        at: Utc::now(),
        data: json!({ "n": seq }),
    })
}

/// The highest `seq` of a request (0 when it has none), from its last event.
async fn last_seq(store: &Arc<dyn Store>, request_id: &str) -> i64 {
    store
        .last_event(request_id)
        .await
        .unwrap()
        .map_or(0, |event| event.seq)
}

/// A session with one request and its run.
async fn seed(store: &Arc<dyn Store>, name: &str, status: RunStatus) {
    store
        .apply(&[
            session(&format!("ses_{name}"), "alice", Age::zero()),
            request(
                &format!("req_{name}"),
                &format!("ses_{name}"),
                "alice",
                status,
                Age::zero(),
            ),
            run(&format!("run_{name}"), &format!("req_{name}"), status),
        ])
        .await
        .unwrap();
}

/// The runtime's journal writing to `store`, as a server's would.
fn journal_on(store: &Arc<dyn Store>) -> stable_harness::runtime::Journal {
    stable_harness::runtime::Journal::start(
        Arc::clone(store),
        Arc::new(stable_harness::runtime::EventHub::default()),
        stable_harness::redact::Redactor::default(),
        &tokio_util::task::TaskTracker::new(),
    )
}

async fn seq_stays_gapless_under_concurrent_appends(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Running).await;
    let journal = journal_on(&store);
    let mut writers = Vec::new();
    for _ in 0..8 {
        let journal = journal.clone();
        writers.push(tokio::spawn(async move {
            for _ in 0..25 {
                journal
                    .write(Some("req_a"), event("req_a", "run_a", 0))
                    .await
                    .unwrap();
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    journal.flush().await.unwrap();
    let events = store.events("req_a", 0, 1_000).await.unwrap();
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=200).collect::<Vec<_>>());
    assert_eq!(last_seq(&store, "req_a").await, 200);
    // Events carry their request's session and agent, and are read by run too.
    assert_eq!(&*events[0].session_id, "ses_a");
    assert_eq!(&*events[0].agent_id, "assistant");
    assert_eq!(store.run_events("run_a", 190, 100).await.unwrap().len(), 10);

    // Writers with no journal in common (two instances: a run's holder and an operator's
    // decision elsewhere) append to one request at once: the store numbers them gaplessly.
    let mut writers = Vec::new();
    for _ in 0..8 {
        let store = Arc::clone(&store);
        writers.push(tokio::spawn(async move {
            let mut numbers = Vec::new();
            for _ in 0..25 {
                numbers.extend(store.apply(&[event("req_a", "run_a", 0)]).await.unwrap());
            }
            numbers
        }));
    }
    let mut numbers = Vec::new();
    for writer in writers {
        numbers.extend(writer.await.unwrap());
    }
    numbers.sort_unstable();
    assert_eq!(numbers, (201..=400).collect::<Vec<_>>());
    let seqs: Vec<i64> = store
        .events("req_a", 0, 1_000)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, (1..=400).collect::<Vec<_>>());
}

/// One batch appends many events to two requests, interleaved and split by another op: each
/// is stored with its own id, data and run, numbered in the order appended per request.
async fn a_batch_of_many_events_keeps_each_events_fields_and_order(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Running).await;
    seed(&store, "b", RunStatus::Running).await;
    let mut ops = Vec::new();
    let mut expected: Vec<(&str, String, i64)> = Vec::new();
    for n in 1..=23 {
        // Requests alternate every few events, and an update splits the batch.
        let request = if (n / 3) % 2 == 0 { "a" } else { "b" };
        let op = event(&format!("req_{request}"), &format!("run_{request}"), n);
        if let WriteOp::AppendEvent(record) = &op {
            expected.push((request, record.id.clone(), n));
        }
        ops.push(op);
        if n == 11 {
            ops.push(update_run("run_b", RunStatus::Running));
        }
    }
    let numbers = store.apply(&ops).await.unwrap();
    let mut next = std::collections::HashMap::new();
    let numbered: Vec<i64> = expected
        .iter()
        .map(|(request, _, _)| {
            let seq = next.entry(*request).or_insert(0);
            *seq += 1;
            *seq
        })
        .collect();
    assert_eq!(numbers, numbered);
    for request in ["a", "b"] {
        let stored = store
            .events(&format!("req_{request}"), 0, 100)
            .await
            .unwrap();
        let wanted: Vec<(String, i64)> = expected
            .iter()
            .filter(|(r, _, _)| *r == request)
            .map(|(_, id, n)| (id.clone(), *n))
            .collect();
        let found: Vec<(String, i64)> = stored
            .iter()
            .map(|e| (e.id.clone(), e.data["n"].as_i64().unwrap()))
            .collect();
        assert_eq!(found, wanted, "request {request}");
        let seqs: Vec<i64> = stored.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=wanted.len() as i64).collect::<Vec<_>>());
        assert!(
            stored.iter().all(|e| *e.run_id == format!("run_{request}")
                && e.event_type == "runtime.adapter.event")
        );
        // The last event is the last of its row, read alone.
        let last = store.last_event(&format!("req_{request}")).await.unwrap();
        assert_eq!(last.as_ref(), stored.last());
        // And read with its request, the same.
        let (read, with_request) = store
            .request_and_last_event(&format!("req_{request}"))
            .await
            .unwrap()
            .expect("the request");
        assert_eq!(read.id, format!("req_{request}"));
        assert_eq!(read.status, RunStatus::Running);
        assert_eq!(with_request, last);
    }
    assert_eq!(store.last_event("req_missing").await.unwrap(), None);
    let missing = store.request_and_last_event("req_missing").await.unwrap();
    assert!(missing.is_none(), "{missing:?}");
    seed(&store, "c", RunStatus::Queued).await;
    let (read, last) = store
        .request_and_last_event("req_c")
        .await
        .unwrap()
        .expect("the request");
    assert_eq!(
        (read.id.as_str(), last),
        ("req_c", None),
        "a request with no events"
    );
}

/// A request's events, written by two runs in batches of several (split by other ops and by
/// commits), are read back from every cursor with every limit, by request and by run: each
/// read is exactly the events after the cursor, in order, up to the limit.
async fn every_cursor_and_limit_reads_the_events_after_it(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Running).await;
    let mut second_run = run("run_a2", "req_a", RunStatus::Running);
    if let WriteOp::InsertRun(record) = &mut second_run {
        record.attempt = 2;
    }
    // (run, n) in the order appended; n is also what each event's data says.
    let order: Vec<(&str, i64)> = (1..=6)
        .map(|n| ("run_a", n))
        .chain((7..=11).map(|n| ("run_a2", n)))
        .chain((12..=15).map(|n| ("run_a", n)))
        .chain((16..=18).map(|n| ("run_a2", n)))
        .collect();
    let mut first = Vec::new();
    for &(run_id, n) in &order[..15] {
        if n == 7 {
            first.push(second_run.clone());
        }
        first.push(event("req_a", run_id, n));
    }
    store.apply(&first).await.unwrap();
    let rest: Vec<WriteOp> = order[15..]
        .iter()
        .map(|&(run_id, n)| event("req_a", run_id, n))
        .collect();
    store.apply(&rest).await.unwrap();
    assert_eq!(last_seq(&store, "req_a").await, 18);

    let read = |events: Vec<EventRecord>| -> Vec<(i64, String, i64)> {
        events
            .into_iter()
            .map(|e| {
                (
                    e.seq,
                    e.run_id.to_string(),
                    e.data["n"].as_i64().unwrap_or(-1),
                )
            })
            .collect()
    };
    // The n-th appended event is number n.
    let all: Vec<(i64, String, i64)> = order
        .iter()
        .map(|&(run_id, n)| (n, run_id.to_owned(), n))
        .collect();
    for after in 0..=18 {
        for limit in [1, 2, 3, 5, 7, 100] {
            let wanted: Vec<_> = all
                .iter()
                .filter(|(seq, _, _)| *seq > after)
                .take(limit as usize)
                .cloned()
                .collect();
            let found = read(store.events("req_a", after, limit).await.unwrap());
            assert_eq!(found, wanted, "request, after {after}, limit {limit}");
            for run_id in ["run_a", "run_a2"] {
                let wanted: Vec<_> = all
                    .iter()
                    .filter(|(seq, run, _)| *seq > after && run == run_id)
                    .take(limit as usize)
                    .cloned()
                    .collect();
                let found = read(store.run_events(run_id, after, limit).await.unwrap());
                assert_eq!(found, wanted, "{run_id}, after {after}, limit {limit}");
            }
        }
    }
}

/// An event whose data holds U+0000 in strings and keys, at any depth, is stored and read
/// back whole: as sent (SQLite), or with U+FFFD in its place and nothing else changed
/// (PostgreSQL, whose text cannot hold it), whether it is its row's first or in its `more`.
/// The batch never fails for it.
async fn an_event_holding_u0000_is_stored_whole(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Running).await;
    let with = |nul: &str| {
        let mut inner = serde_json::Map::new();
        inner.insert(format!("k{nul}"), json!(format!("v{nul}")));
        json!({ "text": format!("a{nul}b"), "list": [nul, 1, null, 2.5, true, inner], "n": 1 })
    };
    // Two of one run in one batch: the second is stored in its row's `more`.
    let ops: Vec<WriteOp> = (1..=2)
        .map(|n| {
            let mut op = event("req_a", "run_a", n);
            if let WriteOp::AppendEvent(record) = &mut op {
                record.data = with("\u{0}");
            }
            op
        })
        .collect();
    assert_eq!(store.apply(&ops).await.unwrap(), vec![1, 2]);
    let stored = store.events("req_a", 0, 10).await.unwrap();
    assert_eq!(stored.len(), 2);
    for event in &stored {
        let data = &event.data;
        let kept = data["text"].as_str().is_some_and(|t| t.contains('\0'));
        assert_eq!(data, &with(if kept { "\u{0}" } else { "\u{FFFD}" }));
    }
}

fn update_run(id: &str, status: RunStatus) -> WriteOp {
    WriteOp::UpdateRun {
        id: id.into(),
        status,
        error: None,
        state: Some(json!({ "messages": [] })),
        at: Utc::now(),
    }
}

fn start_call(run: &str, request: &str, key: &str) -> WriteOp {
    WriteOp::StartToolCall(ToolCallRecord {
        run_id: run.into(),
        call_key: key.into(),
        model_call_id: String::new(),
        request_id: request.into(),
        tool_id: "ledger.write".into(),
        arguments: json!({}),
        idempotency_key: format!("{run}.{key}"),
        executions: 0,
        outcome: "started".into(),
        result: json!(null),
        duration_ms: 0,
        recorded_at: Utc::now(),
    })
}

async fn a_runs_changes_and_tool_starts_are_fenced_to_its_lease_holder(store: Arc<dyn Store>) {
    seed(&store, "f", RunStatus::Running).await;
    let leased = store.run("run_f").await.unwrap().unwrap().lease.unwrap();
    assert_eq!(
        leased.holder,
        store.holder(),
        "a new run is leased to its inserter"
    );
    store
        .apply(&[
            update_run("run_f", RunStatus::Running),
            start_call("run_f", "req_f", "t1.0"),
        ])
        .await
        .unwrap();

    // Given back (a graceful shutdown): the run is nobody's, and its writes are refused.
    assert_eq!(store.release_leases().await.unwrap(), 1);
    assert_eq!(store.run("run_f").await.unwrap().unwrap().lease, None);
    for op in [
        update_run("run_f", RunStatus::Running),
        start_call("run_f", "req_f", "t1.1"),
    ] {
        let refused = store.apply(&[op]).await.unwrap_err();
        assert!(matches!(refused, StoreError::LeaseLost(_)), "{refused:?}");
        assert!(!refused.is_transient());
    }
    let calls = store.tool_calls_of_run("run_f").await.unwrap();
    assert_eq!(calls.len(), 1, "the refused start left no record");

    // Claimed again, it may change; ended, it keeps no lease and is claimed by nobody.
    let claimed = store.claim_runs(10).await.unwrap();
    assert_eq!(
        claimed.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["run_f"]
    );
    assert_eq!(claimed[0].lease.as_ref().unwrap().holder, store.holder());
    store
        .apply(&[update_run("run_f", RunStatus::Completed)])
        .await
        .unwrap();
    let ended = store.run("run_f").await.unwrap().unwrap();
    assert_eq!((ended.status, ended.lease), (RunStatus::Completed, None));
    assert!(store.claim_runs(10).await.unwrap().is_empty());
    assert_eq!(store.release_leases().await.unwrap(), 0);
}

/// The ids of the runs a claim takes now, sorted.
async fn claimed_ids(store: &Arc<dyn Store>) -> Vec<String> {
    let mut ids: Vec<String> = store
        .claim_runs(100)
        .await
        .unwrap()
        .into_iter()
        .map(|run| run.id)
        .collect();
    ids.sort();
    ids
}

async fn claims_take_free_or_expired_runs_once_and_renewals_keep_them(store: Arc<dyn Store>) {
    for n in 0..20 {
        seed(&store, &format!("c{n:02}"), RunStatus::Queued).await;
    }
    seed(&store, "done", RunStatus::Completed).await;
    store
        .apply(&[update_run("run_done", RunStatus::Completed)])
        .await
        .unwrap();
    // Leased to their inserter and not expired: nobody may claim them.
    assert!(store.claim_runs(100).await.unwrap().is_empty());

    // Free: eight concurrent claimers share them out, never one run twice.
    assert_eq!(store.release_leases().await.unwrap(), 20);
    let mut claimers = Vec::new();
    for _ in 0..8 {
        let store = Arc::clone(&store);
        claimers.push(tokio::spawn(
            async move { store.claim_runs(5).await.unwrap() },
        ));
    }
    let mut claimed = Vec::new();
    for claimer in claimers {
        let runs = claimer.await.unwrap();
        assert!(runs.len() <= 5);
        claimed.extend(runs.into_iter().map(|r| r.id));
    }
    claimed.sort();
    let expected: Vec<String> = (0..20).map(|n| format!("run_c{n:02}")).collect();
    assert_eq!(
        claimed, expected,
        "every live run once, the ended one never"
    );

    // Renewed before they expire, they stay; left alone, they expire and are free again.
    tokio::time::sleep(LEASE * 6 / 10).await;
    let (first, second) = expected.split_at(10);
    let mut asked = first.to_vec();
    asked.push("run_done".into());
    asked.push("run_nobody".into());
    let mut renewed = store.renew_leases(&asked).await.unwrap();
    renewed.sort();
    assert_eq!(renewed, first, "only live runs of its own are renewed");
    tokio::time::sleep(LEASE * 6 / 10).await;
    assert_eq!(
        claimed_ids(&store).await,
        second,
        "the leases not renewed expired"
    );
    tokio::time::sleep(LEASE * 6 / 10).await;
    assert_eq!(
        claimed_ids(&store).await,
        first,
        "renewed leases expire a lease after their renewal"
    );
}

async fn pages_and_filters_list_requests_newest_first(store: Arc<dyn Store>) {
    for (name, owner, status) in [
        ("1", "alice", RunStatus::Completed),
        ("2b", "bob", RunStatus::Failed),
        ("3", "alice", RunStatus::Completed),
        ("4b", "alice", RunStatus::Running),
        ("5", "bob", RunStatus::Completed),
    ] {
        store
            .apply(&[
                session(&format!("ses_{name}"), owner, Age::zero()),
                request(
                    &format!("req_{name}"),
                    &format!("ses_{name}"),
                    owner,
                    status,
                    Age::zero(),
                ),
            ])
            .await
            .unwrap();
    }
    let mut page = PageRequest {
        limit: 2,
        cursor: None,
    };
    let mut seen = Vec::new();
    loop {
        let found = store
            .requests(&RequestFilter::default(), &page, RequestInput::Read)
            .await
            .unwrap();
        seen.extend(found.items.iter().map(|r| r.id.clone()));
        match found.next_cursor {
            Some(cursor) => page.cursor = Some(cursor),
            None => break,
        }
    }
    assert_eq!(seen, ["req_5", "req_4b", "req_3", "req_2b", "req_1"]);
    let all = PageRequest {
        limit: 50,
        cursor: None,
    };
    let ids = |items: Vec<RequestRecord>| items.into_iter().map(|r| r.id).collect::<Vec<_>>();
    let alice = RequestFilter {
        owner: Some("alice".into()),
        ..RequestFilter::default()
    };
    assert_eq!(
        ids(store
            .requests(&alice, &all, RequestInput::Skipped)
            .await
            .unwrap()
            .items),
        ["req_4b", "req_3", "req_1"]
    );
    let completed_alice = RequestFilter {
        status: Some(RunStatus::Completed),
        owner: Some("alice".into()),
        ..RequestFilter::default()
    };
    assert_eq!(
        ids(store
            .requests(&completed_alice, &all, RequestInput::Skipped)
            .await
            .unwrap()
            .items),
        ["req_3", "req_1"]
    );
    let billing = RequestFilter {
        agent_id: Some("billing".into()),
        ..RequestFilter::default()
    };
    assert_eq!(
        ids(store
            .requests(&billing, &all, RequestInput::Skipped)
            .await
            .unwrap()
            .items),
        ["req_4b", "req_2b"]
    );
    let one_session = RequestFilter {
        session_id: Some("ses_3".into()),
        ..RequestFilter::default()
    };
    assert_eq!(
        ids(store
            .requests(&one_session, &all, RequestInput::Skipped)
            .await
            .unwrap()
            .items),
        ["req_3"]
    );
    // A listing that skips the input reads each request as a full one does but for its
    // input, left `Null`; a full listing reads the input as the request alone does.
    let full = store
        .requests(&RequestFilter::default(), &all, RequestInput::Read)
        .await
        .unwrap()
        .items;
    let skipped = store
        .requests(&RequestFilter::default(), &all, RequestInput::Skipped)
        .await
        .unwrap()
        .items;
    assert_eq!(full.len(), 5);
    assert_eq!(full.len(), skipped.len());
    for (full, skipped) in full.iter().zip(&skipped) {
        assert_eq!(full, &store.request(&full.id).await.unwrap().unwrap());
        assert!(!full.input.is_null(), "{}: the input was read", full.id);
        assert_eq!(skipped.input, serde_json::Value::Null);
        assert_eq!(
            skipped,
            &RequestRecord {
                input: serde_json::Value::Null,
                ..full.clone()
            }
        );
    }
    // Ownership is kept as given, and text a client sent survives the store.
    let stored = store.request("req_1").await.unwrap().unwrap();
    assert_eq!(stored.owner, "alice");
    assert_eq!(store.session("ses_2b").await.unwrap().unwrap().owner, "bob");
    assert!(
        stored.input["messages"][0]["content"]
            .as_str()
            .unwrap()
            .starts_with("hi")
    );
}

async fn an_approval_is_decided_once_under_concurrent_deciders(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::WaitingApproval).await;
    store
        .apply(&[WriteOp::InsertApproval(ApprovalRecord {
            id: "apr_1".into(),
            request_id: "req_a".into(),
            run_id: "run_a".into(),
            session_id: "ses_a".into(),
            agent_id: "assistant".into(),
            call_key: "t1.0".into(),
            kind: ApprovalKind::Policy,
            execution: 0,
            tool_call_id: "call_0".into(),
            tool_id: "payments.refund".into(),
            arguments: json!({ "amount": 12.5 }),
            rule: Some("high-risk".into()),
            status: ApprovalStatus::Pending,
            reason: None,
            decided_by: None,
            created_at: Utc::now(),
            expires_at: None,
            decided_at: None,
        })])
        .await
        .unwrap();
    let mut deciders = Vec::new();
    for index in 0..8 {
        let store = Arc::clone(&store);
        deciders.push(tokio::spawn(async move {
            store
                .apply(&[WriteOp::DecideApproval(ApprovalDecision {
                    id: "apr_1".into(),
                    status: if index % 2 == 0 {
                        ApprovalStatus::Approved
                    } else {
                        ApprovalStatus::Denied
                    },
                    reason: Some(format!("decider {index}")),
                    decided_by: format!("op{index}"),
                    at: Utc::now(),
                })])
                .await
        }));
    }
    let mut won = 0;
    for decider in deciders {
        match decider.await.unwrap() {
            Ok(_) => won += 1,
            Err(StoreError::Conflict(_)) => {}
            Err(other) => panic!("a decider failed otherwise: {other}"),
        }
    }
    assert_eq!(won, 1, "exactly one decision is taken");
    let approval = store.approval("apr_1").await.unwrap().unwrap();
    assert_ne!(approval.status, ApprovalStatus::Pending);
    assert_eq!(store.approvals_of_run("run_a").await.unwrap().len(), 1);
    let pending = store
        .approvals(
            Some(ApprovalStatus::Pending),
            &PageRequest {
                limit: 10,
                cursor: None,
            },
        )
        .await
        .unwrap();
    assert!(pending.items.is_empty());
}

async fn messages_form_a_tree_read_in_order(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Completed).await;
    let now = Utc::now();
    let message = |id: &str, parent: Option<&str>, offset: i64| {
        message_op(
            id,
            "ses_a",
            parent,
            Some("req_a"),
            "user",
            now + Age::milliseconds(offset),
        )
    };
    // A fork: two children of the same message.
    store
        .apply(&[
            message("msg_1", None, 0),
            message("msg_2", Some("msg_1"), 1),
            message("msg_3", Some("msg_1"), 10),
        ])
        .await
        .unwrap();
    let messages = store.messages("ses_a").await.unwrap();
    let tree: Vec<(String, Option<String>)> = messages
        .iter()
        .map(|m| (m.id.clone(), m.parent_id.clone()))
        .collect();
    assert_eq!(
        tree,
        [
            ("msg_1".to_owned(), None),
            ("msg_2".to_owned(), Some("msg_1".to_owned())),
            ("msg_3".to_owned(), Some("msg_1".to_owned())),
        ]
    );
    // The head is the newest leaf; the history is the path from the root to it.
    assert_eq!(
        store.session_head("ses_a").await.unwrap().as_deref(),
        Some("msg_3")
    );
    // A child stamped before its parent (another instance's clock lags): the head is still
    // the leaf, never the parent that merely looks newer.
    store
        .apply(&[message("msg_5", Some("msg_3"), 5)])
        .await
        .unwrap();
    assert_eq!(
        store.session_head("ses_a").await.unwrap().as_deref(),
        Some("msg_5")
    );
    let path: Vec<String> = store
        .message_path("msg_5")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(path, ["msg_1", "msg_3", "msg_5"]);
    // The head and its path in one read, or only what is below a known message of it.
    let below = |known: Option<&'static str>| {
        let store = Arc::clone(&store);
        async move {
            let (head, path) = store
                .session_path_below("ses_a", known)
                .await
                .unwrap()
                .unwrap();
            let ids: Vec<String> = path.messages.into_iter().map(|m| m.id).collect();
            (head, ids, path.below_known)
        }
    };
    assert_eq!(below(None).await, ("msg_5".to_owned(), path.clone(), false));
    assert_eq!(
        below(Some("msg_1")).await,
        (
            "msg_5".to_owned(),
            vec!["msg_3".to_owned(), "msg_5".to_owned()],
            true
        )
    );
    assert_eq!(
        below(Some("msg_2")).await.1,
        path,
        "a known message off the path"
    );
    assert!(
        store
            .session_path_below("ses_none", None)
            .await
            .unwrap()
            .is_none()
    );
    // With the session, in the same read.
    let (session, read) = store
        .session_and_path("ses_a", Some("msg_3"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(session.id, "ses_a");
    let (head, read) = read.unwrap();
    assert_eq!(head, "msg_5");
    assert_eq!(read.messages.len(), 1);
    assert!(read.below_known);
    assert!(
        store
            .session_and_path("ses_none", None)
            .await
            .unwrap()
            .is_none()
    );
    // A parent that does not exist is refused.
    assert!(
        store
            .apply(&[message("msg_4", Some("msg_missing"), 3)])
            .await
            .is_err()
    );
}

async fn a_requests_last_message_is_its_newest_own_one_not_its_answer(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Completed).await;
    store
        .apply(&[request(
            "req_b",
            "ses_a",
            "alice",
            RunStatus::Completed,
            Age::seconds(5),
        )])
        .await
        .unwrap();
    let at = store.request("req_a").await.unwrap().unwrap().created_at;
    let since_b = store.request("req_b").await.unwrap().unwrap().created_at;
    let message = |id: &str, request: &str, role: &str, offset: i64| {
        message_op(
            id,
            "ses_a",
            None,
            Some(request),
            role,
            at + Age::seconds(offset),
        )
    };
    store
        .apply(&[
            // An earlier turn's, another request's.
            message("msg_1", "req_b", "user", -2),
            message("msg_2", "req_b", "assistant", -1),
            // The request's own two, stamped with it, then its answer.
            message("msg_3", "req_a", "user", 0),
            message("msg_4", "req_a", "tool", 0),
            message("msg_5", "req_a", "assistant", 1),
            // A later turn's.
            message("msg_6", "req_b", "user", 2),
            message("msg_7", "req_b", "assistant", 3),
        ])
        .await
        .unwrap();
    let last = |session: &'static str, request: &'static str, since| {
        let store = Arc::clone(&store);
        async move {
            store
                .request_last_message(session, request, since)
                .await
                .unwrap()
        }
    };
    assert_eq!(last("ses_a", "req_a", at).await.as_deref(), Some("msg_4"));
    assert_eq!(
        last("ses_a", "req_b", since_b).await.as_deref(),
        Some("msg_6")
    );
    // Only what came since the stamp is looked at.
    assert_eq!(
        last("ses_a", "req_b", at - Age::seconds(1))
            .await
            .as_deref(),
        Some("msg_6")
    );
    assert_eq!(last("ses_a", "req_b", at + Age::seconds(3)).await, None);
    assert_eq!(last("ses_a", "req_none", since_b).await, None);
    assert_eq!(last("ses_none", "req_a", since_b).await, None);
}

async fn a_sessions_newest_answers_come_newest_first_and_alone(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Completed).await;
    seed(&store, "b", RunStatus::Completed).await;
    let at = store.request("req_a").await.unwrap().unwrap().created_at;
    let message = |id: &str, session: &str, role: &str, offset: i64| {
        message_op(id, session, None, None, role, at + Age::seconds(offset))
    };
    store
        .apply(&[
            message("msg_1", "ses_a", "user", 0),
            message("msg_2", "ses_a", "assistant", 1),
            message("msg_3", "ses_a", "user", 2),
            // Stamped alike: the id orders them.
            message("msg_4", "ses_a", "assistant", 3),
            message("msg_5", "ses_a", "assistant", 3),
            message("msg_6", "ses_a", "tool", 4),
            message("msg_7", "ses_b", "assistant", 5),
        ])
        .await
        .unwrap();
    let ids = |limit: u32, session: &'static str| {
        let store = Arc::clone(&store);
        async move {
            let answers = store.newest_answers(session, limit).await.unwrap();
            answers.into_iter().map(|m| m.id).collect::<Vec<_>>()
        }
    };
    assert_eq!(ids(10, "ses_a").await, ["msg_5", "msg_4", "msg_2"]);
    assert_eq!(ids(2, "ses_a").await, ["msg_5", "msg_4"]);
    assert_eq!(ids(10, "ses_b").await, ["msg_7"]);
    assert!(ids(10, "ses_none").await.is_empty());
    assert!(ids(0, "ses_a").await.is_empty());
}

async fn a_long_history_is_read_root_first_and_whole(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Completed).await;
    // In whole microseconds, as both stores keep a time.
    let now = chrono::DateTime::from_timestamp_micros(Utc::now().timestamp_micros()).unwrap();
    // A conversation of 2,600 messages (more than a read's page), seven at a time stamped
    // alike (ordered by their parents alone) and one stamped before its parent (another
    // instance's clock lagging), with a branch off every hundredth message that no path
    // through the main line may cross into.
    let mut ops = Vec::new();
    let mut expected = Vec::new();
    let mut parent: Option<String> = None;
    for n in 0..2600_usize {
        let id = format!("msg_{n:04}");
        let role = if n % 2 == 0 { "user" } else { "assistant" };
        let record = MessageRecord {
            id: id.clone(),
            session_id: "ses_a".into(),
            parent_id: parent.replace(id.clone()),
            request_id: Some(format!("req_{}", n / 2)),
            role: role.into(),
            content: json!({ "role": role, "content": format!("turn {n}: {}", "é\"\\ ".repeat(n % 7)) }),
            created_at: now
                + Age::milliseconds(i64::try_from(n / 7).unwrap() - i64::from(n == 1234) * 3),
        };
        expected.push(record.clone());
        ops.push(WriteOp::InsertMessage(record));
        if n % 100 == 0 {
            ops.push(WriteOp::InsertMessage(MessageRecord {
                id: format!("msg_{n:04}_branch"),
                parent_id: Some(id),
                content: json!({ "role": "user", "content": "a branch" }),
                ..expected[n].clone()
            }));
        }
    }
    store.apply(&ops).await.unwrap();
    let path = store.message_path("msg_2599").await.unwrap();
    assert_eq!(path.len(), 2600);
    for (read, stored) in path.iter().zip(&expected) {
        assert_eq!(read.id, stored.id);
        assert_eq!(read.parent_id, stored.parent_id);
        assert_eq!(read.session_id, stored.session_id);
        assert_eq!(read.request_id, stored.request_id);
        assert_eq!(read.role, stored.role);
        assert_eq!(read.content, stored.content);
        assert_eq!(read.created_at, stored.created_at);
    }
    // A path from inside the conversation ends there; one from a branch runs through its fork.
    let ids = |path: Vec<MessageRecord>| path.into_iter().map(|m| m.id).collect::<Vec<_>>();
    let through_250 = ids(store.message_path("msg_0250").await.unwrap());
    assert_eq!(through_250.len(), 251);
    assert_eq!(through_250.last().map(String::as_str), Some("msg_0250"));
    let branch = ids(store.message_path("msg_0300_branch").await.unwrap());
    assert_eq!(branch.len(), 302);
    assert_eq!(branch[300], "msg_0300");
    assert_eq!(branch[301], "msg_0300_branch");
    // A fork: another session whose first message hangs under one of this session's; its
    // path crosses into this session there.
    seed(&store, "b", RunStatus::Completed).await;
    let forked = |n: usize, parent: &str| {
        WriteOp::InsertMessage(MessageRecord {
            id: format!("msg_b{n}"),
            session_id: "ses_b".into(),
            parent_id: Some(parent.to_owned()),
            request_id: Some("req_b".into()),
            content: json!({ "role": "user", "content": format!("forked {n}") }),
            ..expected[0].clone()
        })
    };
    store
        .apply(&[
            forked(0, "msg_0400"),
            forked(1, "msg_b0"),
            forked(2, "msg_b1"),
        ])
        .await
        .unwrap();
    let fork = store.message_path("msg_b2").await.unwrap();
    assert_eq!(fork.len(), 404);
    assert_eq!(ids(fork[..401].to_vec()), ids(expected[..401].to_vec()));
    assert_eq!(ids(fork[401..].to_vec()), ["msg_b0", "msg_b1", "msg_b2"]);
    assert!(fork[401..].iter().all(|m| m.session_id == "ses_b"));
    // A message that does not exist has no path.
    assert!(store.message_path("msg_none").await.unwrap().is_empty());
}

async fn tool_call_records_count_executions_and_keep_results(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Running).await;
    let call = |outcome: &str, result: serde_json::Value| ToolCallRecord {
        run_id: "run_a".into(),
        call_key: "t1.0".into(),
        model_call_id: "call_0".into(),
        request_id: "req_a".into(),
        tool_id: "weather.lookup".into(),
        arguments: json!({ "city": "Oslo" }),
        idempotency_key: "run_a.t1.0".into(),
        executions: 0,
        outcome: outcome.into(),
        result,
        duration_ms: 12,
        recorded_at: Utc::now(),
    };
    store
        .apply(&[WriteOp::StartToolCall(call("started", json!(null)))])
        .await
        .unwrap();
    store
        .apply(&[WriteOp::StartToolCall(call("started", json!(null)))])
        .await
        .unwrap();
    let started = store.tool_calls_of_run("run_a").await.unwrap();
    assert_eq!(
        (started[0].outcome.as_str(), started[0].executions),
        ("started", 2)
    );
    store
        .apply(&[WriteOp::RecordToolCall(call("ok", json!({ "temp": 3 })))])
        .await
        .unwrap();
    let recorded = store.tool_calls_of_run("run_a").await.unwrap();
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].outcome, "ok");
    assert_eq!(recorded[0].result, json!({ "temp": 3 }));
    assert_eq!(recorded[0].executions, 2);
    assert_eq!(recorded[0].idempotency_key, "run_a.t1.0");
}

async fn client_calls_are_found_by_id_for_their_owner_and_completed_once(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Running).await;
    seed(&store, "b", RunStatus::Running).await;
    let call = |run: &str, key: &str, id: &str, tool: &str, outcome: &str| ToolCallRecord {
        run_id: format!("run_{run}"),
        call_key: key.into(),
        model_call_id: id.into(),
        request_id: format!("req_{run}"),
        tool_id: tool.into(),
        arguments: json!({}),
        idempotency_key: format!("run_{run}.{key}"),
        executions: 0,
        outcome: outcome.into(),
        result: json!(null),
        duration_ms: 0,
        recorded_at: Utc::now(),
    };
    store
        .apply(&[
            WriteOp::RecordToolCall(call("a", "t1.0", "call_0", "weather.lookup", "completed")),
            WriteOp::RecordToolCall(call(
                "a",
                "t1.1",
                "call_sh_1",
                "client.apply_patch",
                "client",
            )),
            WriteOp::RecordToolCall(call("b", "t1.0", "call_sh_2", "client.shell", "client")),
        ])
        .await
        .unwrap();
    let ids = ["call_sh_1", "call_sh_2", "call_0", "call_sh_unknown"].map(String::from);
    let mut found = store.client_calls(&ids, "alice").await.unwrap();
    found.sort_by(|x, y| x.call.model_call_id.cmp(&y.call.model_call_id));
    let summary: Vec<(&str, &str, bool)> = found
        .iter()
        .map(|c| {
            (
                c.call.model_call_id.as_str(),
                c.call.run_id.as_str(),
                c.server_calls,
            )
        })
        .collect();
    // Only client tools' calls; whether their run also called server tools.
    assert_eq!(
        summary,
        [("call_sh_1", "run_a", true), ("call_sh_2", "run_b", false)]
    );
    assert!(
        store
            .client_calls(&ids, "mallory")
            .await
            .unwrap()
            .is_empty()
    );
    assert!(store.client_calls(&[], "alice").await.unwrap().is_empty());

    let result = json!("patched");
    assert!(
        store
            .complete_client_call("run_a", "t1.1", &result, Utc::now())
            .await
            .unwrap()
    );
    assert!(
        !store
            .complete_client_call("run_a", "t1.1", &json!("again"), Utc::now())
            .await
            .unwrap()
    );
    // A server tool's call is never completed this way.
    assert!(
        !store
            .complete_client_call("run_a", "t1.0", &result, Utc::now())
            .await
            .unwrap()
    );
    let recorded = store.tool_calls_of_run("run_a").await.unwrap();
    let patched = recorded.iter().find(|c| c.call_key == "t1.1").unwrap();
    assert_eq!(
        (patched.outcome.as_str(), &patched.result),
        ("completed", &result)
    );
}

async fn a_batch_is_all_or_nothing(store: Arc<dyn Store>) {
    // The second op refers to a request that does not exist: nothing of the batch stays.
    let result = store
        .apply(&[
            session("ses_x", "alice", Age::zero()),
            run("run_x", "req_missing", RunStatus::Running),
        ])
        .await;
    assert!(result.is_err());
    assert!(store.session("ses_x").await.unwrap().is_none());
    // Runs left live are found for resuming; ended ones are not.
    seed(&store, "live", RunStatus::Running).await;
    seed(&store, "done", RunStatus::Completed).await;
    let live = store
        .runs_with_status(&[RunStatus::Queued, RunStatus::Running])
        .await
        .unwrap();
    assert_eq!(
        live.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["run_live"]
    );
    store
        .apply(&[WriteOp::UpdateRun {
            id: "run_live".into(),
            status: RunStatus::Completed,
            error: None,
            state: Some(json!({ "messages": [] })),
            at: Utc::now(),
        }])
        .await
        .unwrap();
    let ended = store.run("run_live").await.unwrap().unwrap();
    assert_eq!(ended.status, RunStatus::Completed);
    assert!(ended.state.is_none(), "an ended run keeps no checkpoint");
    assert!(ended.ended_at.is_some());
}

async fn pruning_takes_idle_sessions_whole_and_judges_again_before_deleting(store: Arc<dyn Store>) {
    let old = Age::hours(2);
    // Ids sort by age: old1 < old2 < old3.
    for name in ["old1", "old2", "old3"] {
        store
            .apply(&[
                session(&format!("ses_{name}"), "alice", old),
                request(
                    &format!("req_{name}"),
                    &format!("ses_{name}"),
                    "alice",
                    RunStatus::Completed,
                    old,
                ),
                run(
                    &format!("run_{name}"),
                    &format!("req_{name}"),
                    RunStatus::Completed,
                ),
                // Three events of one run in one batch (one row of them): each
                // counts.
                event(&format!("req_{name}"), &format!("run_{name}"), 1),
                event(&format!("req_{name}"), &format!("run_{name}"), 2),
                event(&format!("req_{name}"), &format!("run_{name}"), 3),
            ])
            .await
            .unwrap();
    }
    // A live one and a recent one stay whatever happens.
    seed(&store, "live", RunStatus::Running).await;
    let policy = stable_harness::store::retention::RetentionPolicy {
        default_window: Some(std::time::Duration::from_secs(3_600)),
        min_keep: 3,
        ..Default::default()
    };
    let filter = policy.filter(Utc::now());
    // minKeep 3 keeps the three ended requests there are: nothing goes.
    assert!(
        store
            .prunable_sessions(&filter, None, 10)
            .await
            .unwrap()
            .is_empty()
    );
    let policy = stable_harness::store::retention::RetentionPolicy {
        min_keep: 1,
        ..policy
    };
    let filter = policy.filter(Utc::now());
    let listed = store.prunable_sessions(&filter, None, 10).await.unwrap();
    assert_eq!(listed, ["ses_old1", "ses_old2"]);
    let counts = store.count_owned(&listed).await.unwrap();
    assert_eq!((counts.sessions, counts.requests, counts.events), (2, 2, 6));
    // ses_old2 is continued before the delete: it stays.
    store
        .apply(&[
            session("ses_old2", "alice", Age::zero()),
            request(
                "req_new",
                "ses_old2",
                "alice",
                RunStatus::Running,
                Age::zero(),
            ),
        ])
        .await
        .unwrap();
    let removed = store.delete_sessions(&filter, &listed).await.unwrap();
    assert_eq!(
        (
            removed.sessions,
            removed.requests,
            removed.events,
            removed.runs
        ),
        (1, 1, 3, 1)
    );
    assert!(store.request("req_old1").await.unwrap().is_none());
    assert!(store.request("req_old2").await.unwrap().is_some());
    assert!(
        store.request("req_old3").await.unwrap().is_some(),
        "the newest ended stays (minKeep 1)"
    );
    assert!(store.request("req_live").await.unwrap().is_some());
    assert!(store.events("req_old1", 0, 10).await.unwrap().is_empty());
}

/// A request of `owner` in its own session, two hours old, whose input is `input`.
fn request_with_input(id: &str, owner: &str, input: serde_json::Value) -> [WriteOp; 2] {
    let session_id = format!("ses_{id}");
    let WriteOp::InsertRequest(mut record) =
        request(id, &session_id, owner, RunStatus::Completed, Age::hours(2))
    else {
        unreachable!("request() inserts a request")
    };
    record.input = input;
    [
        session(&session_id, owner, Age::hours(2)),
        WriteOp::InsertRequest(record),
    ]
}

/// A chat turn with no session finds the request its transcript continues by the digest of
/// that request's messages, among its own key's and agent's requests alone, the newest
/// first, with where that request's first messages are held and the digest of the leading
/// messages held there for it. A request named by a request of another session is kept by
/// the prune until that one is gone.
async fn a_transcripts_holder_is_found_by_its_digest_and_kept_while_named(store: Arc<dyn Store>) {
    let hi = json!([{ "role": "user", "content": "hi" }]);
    let rules = json!([{ "role": "system", "content": "Be brief." }]);
    let more =
        json!([{ "role": "assistant", "content": "hello" }, { "role": "user", "content": "more" }]);
    for ops in [
        request_with_input(
            "req_1",
            "ada",
            json!({ "messages": hi, "inputDigest": "d1", "leading": rules, "leadingDigest": "l1" }),
        ),
        request_with_input(
            "req_2",
            "ada",
            json!({ "messages": more, "inputDigest": "d2", "prefixOf": "req_1", "prefixLen": 1,
                    "leadingOf": "req_1", "leadingDigest": "l1" }),
        ),
        // The same transcript: another key's, and another agent's (`billing`).
        request_with_input(
            "req_3",
            "bob",
            json!({ "messages": hi, "inputDigest": "d1" }),
        ),
        request_with_input(
            "req_4b",
            "ada",
            json!({ "messages": hi, "inputDigest": "d1" }),
        ),
    ] {
        store.apply(&ops).await.unwrap();
    }
    // With when it was last written (two hours ago, `request_with_input`).
    let found = async |owner: &str, agent: &str, digest: &str| {
        let holder = store.input_holder(owner, agent, digest).await.unwrap();
        holder.map(|h| {
            let age = Utc::now() - h.updated_at;
            assert!(age > Age::minutes(119) && age < Age::minutes(121), "{age}");
            (h.request_id, h.prefix_of, h.prefix_len, h.leading_digest)
        })
    };
    let whole = |id: &str| Some((id.to_owned(), None, None, None));
    let leading = Some("l1".to_owned());
    assert_eq!(
        found("ada", "assistant", "d1").await,
        Some(("req_1".into(), None, None, leading.clone()))
    );
    assert_eq!(
        found("ada", "assistant", "d2").await,
        Some(("req_2".into(), Some("req_1".into()), Some(1), leading))
    );
    assert_eq!(found("bob", "assistant", "d1").await, whole("req_3"));
    assert_eq!(found("ada", "billing", "d1").await, whole("req_4b"));
    assert_eq!(found("carol", "assistant", "d1").await, None);
    assert_eq!(found("ada", "assistant", "d3").await, None);
    // The newest of those alike.
    store
        .apply(&request_with_input(
            "req_5",
            "ada",
            json!({ "messages": hi, "inputDigest": "d1", "leading": rules }),
        ))
        .await
        .unwrap();
    assert_eq!(found("ada", "assistant", "d1").await, whole("req_5"));
    // Read back whole through what it names.
    let second = store.request("req_2").await.unwrap().unwrap();
    let messages = stable_harness::store::named_input::stored_messages(store.as_ref(), &second)
        .await
        .unwrap();
    assert_eq!(json!(messages), json!([hi[0], more[0], more[1]]));
    // Its leading messages held there for it, the digest the same; not by another.
    let first = store.request("req_1").await.unwrap().unwrap();
    let held = stable_harness::store::named_input::joined_leading(&second, Some(&first));
    assert_eq!(held.ok().map(|held| json!(held)), Some(rules.clone()));
    let other = store.request("req_5").await.unwrap().unwrap();
    let held = stable_harness::store::named_input::joined_leading(&second, Some(&other));
    assert!(held.is_err());

    // All past the window: req_1's session stays while req_2 names it.
    let policy = stable_harness::store::retention::RetentionPolicy {
        default_window: Some(std::time::Duration::from_secs(3_600)),
        ..Default::default()
    };
    let filter = policy.filter(Utc::now());
    let listed = store.prunable_sessions(&filter, None, 10).await.unwrap();
    assert_eq!(
        listed,
        ["ses_req_2", "ses_req_3", "ses_req_4b", "ses_req_5"]
    );
    store.delete_sessions(&filter, &listed).await.unwrap();
    let listed = store.prunable_sessions(&filter, None, 10).await.unwrap();
    assert_eq!(listed, ["ses_req_1"]);
    // Judged again when deleting: a request naming it meanwhile keeps it.
    store
        .apply(&request_with_input(
            "req_6",
            "ada",
            json!({ "messages": [], "inputDigest": "d6", "prefixOf": "req_1", "prefixLen": 1 }),
        ))
        .await
        .unwrap();
    let removed = store.delete_sessions(&filter, &listed).await.unwrap();
    assert_eq!(removed.sessions, 0);
    assert!(store.request("req_1").await.unwrap().is_some());
}

/// A second attempt of `req_a` (`run_id`, queued) and a pending approval `apr_0` on it.
fn retry_of_run_a(run_id: &str) -> (RunRecord, ApprovalRecord) {
    let WriteOp::InsertRun(mut retry) = run(run_id, "req_a", RunStatus::Queued) else {
        unreachable!("run() inserts a run")
    };
    retry.attempt = 2;
    let WriteOp::InsertApproval(mut on_retry) = approval("apr_0", ApprovalStatus::Pending) else {
        unreachable!("approval() inserts an approval")
    };
    on_retry.run_id = run_id.into();
    (retry, on_retry)
}

fn approval(id: &str, status: ApprovalStatus) -> WriteOp {
    WriteOp::InsertApproval(ApprovalRecord {
        id: id.into(),
        request_id: "req_a".into(),
        run_id: "run_a".into(),
        session_id: "ses_a".into(),
        agent_id: "assistant".into(),
        call_key: format!("t1.{id}"),
        kind: ApprovalKind::Policy,
        execution: 0,
        tool_call_id: "call_0".into(),
        tool_id: "payments.refund".into(),
        arguments: json!({}),
        rule: None,
        status,
        reason: None,
        decided_by: None,
        created_at: Utc::now(),
        expires_at: None,
        decided_at: None,
    })
}

async fn approvals_page_newest_first_by_status(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::WaitingApproval).await;
    store
        .apply(&[
            approval("apr_1", ApprovalStatus::Pending),
            approval("apr_2", ApprovalStatus::Approved),
            approval("apr_3", ApprovalStatus::Pending),
            approval("apr_4", ApprovalStatus::Pending),
        ])
        .await
        .unwrap();
    let mut page = PageRequest {
        limit: 2,
        cursor: None,
    };
    let mut pending = Vec::new();
    loop {
        let found = store
            .approvals(Some(ApprovalStatus::Pending), &page)
            .await
            .unwrap();
        pending.extend(found.items.into_iter().map(|a| a.id));
        match found.next_cursor {
            Some(cursor) => page.cursor = Some(cursor),
            None => break,
        }
    }
    assert_eq!(pending, ["apr_4", "apr_3", "apr_1"]);
    let all = store
        .approvals(
            None,
            &PageRequest {
                limit: 10,
                cursor: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(all.items.len(), 4);
    assert!(store.approval("apr_missing").await.unwrap().is_none());
    // A key no store holds (U+0000) reads as not found, never as an error.
    assert!(store.request("req_\u{0}").await.unwrap().is_none());
}

async fn maintenance_records_and_stats_are_kept(store: Arc<dyn Store>) {
    seed(&store, "a", RunStatus::Completed).await;
    for (index, operation) in ["prune", "backup", "prune"].into_iter().enumerate() {
        let at = Utc::now() + Age::milliseconds(index as i64);
        store
            .record_maintenance(&stable_harness::store::MaintenanceRecord {
                id: stable_harness::runtime::new_id("mnt"),
                operation: operation.into(),
                status: "completed".into(),
                started_at: at,
                ended_at: at,
                report: json!({ "index": index }),
            })
            .await
            .unwrap();
    }
    let records = store.maintenance(2).await.unwrap();
    assert_eq!(records.len(), 2);
    assert_eq!(records[0].report, json!({ "index": 2 }), "newest first");
    assert_eq!(records[1].operation, "backup");
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.requests, stats.sessions), (1, 1));
    assert!(stats.database_bytes > 0);
}

fn memory(id: &str, namespace: &str, scope: &str, content: &str, age: Age) -> MemoryRecord {
    let at = Utc::now() - age;
    MemoryRecord {
        id: id.into(),
        namespace: namespace.into(),
        scope: scope.into(),
        owner: if scope.is_empty() { "key-a" } else { scope }.into(),
        content: content.into(),
        metadata: json!({ "source": "test" }),
        status: MemoryStatus::Active,
        content_hash: stable_harness::memory::content_hash(content),
        near_hash: stable_harness::memory::near_hash(content),
        source_request_id: None,
        source_run_id: None,
        decided_by: None,
        created_at: at,
        updated_at: at,
    }
}

fn words(text: &str) -> Vec<String> {
    stable_harness::memory::search_words(text)
}

async fn memory_merges_duplicates_and_recalls_by_relevance_within_scope(store: Arc<dyn Store>) {
    let (stored, merged) = store
        .put_memory(&memory(
            "mem_1",
            "user/ada",
            "key-a",
            "Ada drinks oolong tea",
            Age::days(40),
        ))
        .await
        .unwrap();
    assert!(!merged);
    assert_eq!(stored.id, "mem_1");
    // The same content again is the same record: only its `updated_at` moves.
    let (again, merged) = store
        .put_memory(&memory(
            "mem_2",
            "user/ada",
            "key-a",
            "Ada drinks oolong tea",
            Age::zero(),
        ))
        .await
        .unwrap();
    assert!(merged);
    assert_eq!(again.id, "mem_1");
    assert!(again.updated_at > stored.updated_at);
    // The same words for another key, and in another namespace, are other records.
    for record in [
        memory(
            "mem_3",
            "user/ada",
            "key-b",
            "Ada drinks oolong tea",
            Age::zero(),
        ),
        memory(
            "mem_4",
            "user/ada",
            "key-a",
            "Ada dislikes coffee and tea bags",
            Age::zero(),
        ),
        memory(
            "mem_5",
            "user/ada",
            "key-a",
            "The office is in Lyon",
            Age::zero(),
        ),
        memory(
            "mem_6",
            "agent/support",
            "",
            "Refunds take five days",
            Age::zero(),
        ),
    ] {
        assert!(!store.put_memory(&record).await.unwrap().1);
    }
    let ids = |records: Vec<MemoryRecord>| records.into_iter().map(|m| m.id).collect::<Vec<_>>();
    // Relevance first (both tea words beat one), stemming (`drinking` finds `drinks`), and
    // only the asking key's records.
    let found = store
        .recall_memories(
            "user/ada",
            "key-a",
            &words("What is Ada drinking? oolong?"),
            5,
        )
        .await
        .unwrap();
    assert_eq!(ids(found), ["mem_1", "mem_4"]);
    let found = store
        .recall_memories("user/ada", "key-b", &words("oolong"), 5)
        .await
        .unwrap();
    assert_eq!(ids(found), ["mem_3"]);
    // Recency weighs in: of two equally relevant records, the fresher one comes first.
    store
        .put_memory(&memory(
            "mem_7",
            "user/ada",
            "key-a",
            "Lyon weather is mild",
            Age::days(90),
        ))
        .await
        .unwrap();
    let found = store
        .recall_memories("user/ada", "key-a", &words("Lyon"), 5)
        .await
        .unwrap();
    assert_eq!(ids(found), ["mem_5", "mem_7"]);
    // Without words: the most recent ones. Limits hold.
    let found = store
        .recall_memories("user/ada", "key-a", &[], 2)
        .await
        .unwrap();
    assert_eq!(found.len(), 2);
    assert!(found.iter().all(|m| m.id != "mem_7"));
    // Search words cannot inject query syntax.
    let hostile = vec![
        "\"oolong\" OR *".to_owned(),
        "a'b|c".to_owned(),
        "NEAR(x".to_owned(),
    ];
    store
        .recall_memories("user/ada", "key-a", &hostile, 5)
        .await
        .unwrap();

    // Listing: newest id first, filters, full-text, pages.
    let page = |limit, cursor: Option<String>| PageRequest { limit, cursor };
    let listed = store
        .memories(
            &MemoryFilter {
                namespace: Some("user/ada".into()),
                ..MemoryFilter::default()
            },
            &page(2, None),
        )
        .await
        .unwrap();
    assert_eq!(ids(listed.items), ["mem_7", "mem_5"]);
    let rest = store
        .memories(
            &MemoryFilter {
                namespace: Some("user/ada".into()),
                ..MemoryFilter::default()
            },
            &page(10, listed.next_cursor),
        )
        .await
        .unwrap();
    assert_eq!(ids(rest.items), ["mem_4", "mem_3", "mem_1"]);
    let searched = store
        .memories(
            &MemoryFilter {
                words: words("coffee"),
                owner: Some("key-a".into()),
                ..MemoryFilter::default()
            },
            &page(10, None),
        )
        .await
        .unwrap();
    assert_eq!(ids(searched.items), ["mem_4"]);
    // An import is one transaction, merged by content.
    let merged = store
        .import_memories(&[
            memory(
                "mem_8",
                "agent/support",
                "",
                "Refunds take five days",
                Age::zero(),
            ),
            memory(
                "mem_9",
                "agent/support",
                "",
                "Invoices are monthly",
                Age::zero(),
            ),
        ])
        .await
        .unwrap();
    assert_eq!(merged, 1);
    assert!(store.memory("mem_9").await.unwrap().is_some());
    assert!(store.memory("mem_8").await.unwrap().is_none());
}

/// An import of many records (past one statement's share) leaves what writing them one after
/// another leaves: a record whose namespace, scope and content are already stored, or come
/// earlier in the import, merges into that one (its fields kept, the last `updated_at`
/// taken), and every merge is counted.
async fn an_import_merges_as_one_write_after_another_would(store: Arc<dyn Store>) {
    let close =
        |a: chrono::DateTime<Utc>, b: chrono::DateTime<Utc>| (a - b).num_milliseconds().abs() <= 1;
    let (old, _) = store
        .put_memory(&memory(
            "mem_old",
            "agent/a",
            "",
            "An old fact",
            Age::days(5),
        ))
        .await
        .unwrap();
    let mut batch = vec![
        memory("mem_a1", "agent/a", "", "A shared fact", Age::days(3)),
        memory("mem_b", "agent/a", "", "An old fact", Age::days(2)),
    ];
    batch.extend((0..2_500).map(|i| {
        memory(
            &format!("mem_bulk_{i}"),
            "agent/bulk",
            "",
            &format!("Bulk fact {i}"),
            Age::zero(),
        )
    }));
    batch.push(memory(
        "mem_a2",
        "agent/a",
        "",
        "A shared fact",
        Age::days(1),
    ));
    batch.push(memory(
        "mem_a3",
        "agent/a",
        "",
        "A shared fact",
        Age::hours(1),
    ));
    // The same content in another scope is another record.
    batch.push(memory(
        "mem_c",
        "agent/a",
        "key-b",
        "A shared fact",
        Age::days(4),
    ));
    let merged = store.import_memories(&batch).await.unwrap();
    assert_eq!(
        merged, 3,
        "mem_b into mem_old, mem_a2 and mem_a3 into mem_a1"
    );
    let shared = store
        .memory("mem_a1")
        .await
        .unwrap()
        .expect("the first one stays");
    assert_eq!(
        (
            shared.content.as_str(),
            shared.owner.as_str(),
            &shared.metadata
        ),
        ("A shared fact", "key-a", &json!({ "source": "test" }))
    );
    assert!(close(shared.created_at, batch[0].created_at));
    assert!(
        close(shared.updated_at, batch[2_503].updated_at),
        "the last one's time"
    );
    let kept_old = store.memory("mem_old").await.unwrap().unwrap();
    assert_eq!(kept_old.content, old.content);
    assert!(close(kept_old.updated_at, batch[1].updated_at));
    for merged_away in ["mem_a2", "mem_a3", "mem_b"] {
        assert!(
            store.memory(merged_away).await.unwrap().is_none(),
            "{merged_away}"
        );
    }
    for stored in [
        "mem_bulk_0",
        "mem_bulk_999",
        "mem_bulk_1000",
        "mem_bulk_2499",
        "mem_c",
    ] {
        assert!(store.memory(stored).await.unwrap().is_some(), "{stored}");
    }
    // Imported again, a record stored under its own id is no merge: the same three merge.
    let again = store.import_memories(&batch).await.unwrap();
    assert_eq!(again, 3);
    assert!(store.memory("mem_a2").await.unwrap().is_none());
}

/// Of more matches than asked for, recall keeps the best ones, in their order, and reads each
/// whole; other scopes and inactive records stay out however fresh they are.
async fn recall_keeps_the_best_in_order_and_reads_them_whole(store: Arc<dyn Store>) {
    // Equally relevant records (one word matched, as many words each), so age decides; ids
    // in another order than age, so an order by id would not pass.
    let days_old = [
        (3, 1),
        (7, 2),
        (1, 3),
        (5, 4),
        (8, 5),
        (2, 6),
        (6, 7),
        (4, 8),
    ];
    let mut written = Vec::new();
    for (number, days) in days_old {
        let mut record = memory(
            &format!("rank_{number}"),
            "agent/ranked",
            "",
            &format!("Zephyr relay fact {number}"),
            Age::days(days),
        );
        record.metadata = json!({ "number": number });
        written.push(record.clone());
        store.put_memory(&record).await.unwrap();
    }
    // As relevant and fresher than all of them, but another scope's or archived.
    for (id, scope, number, status) in [
        ("rank_other", "key-b", 0, MemoryStatus::Active),
        ("rank_archived", "", 9, MemoryStatus::Archived),
    ] {
        let content = format!("Zephyr relay fact {number}");
        let mut record = memory(id, "agent/ranked", scope, &content, Age::zero());
        record.status = status;
        store.put_memory(&record).await.unwrap();
    }

    let found = store
        .recall_memories("agent/ranked", "", &words("zephyr?"), 5)
        .await
        .unwrap();
    let ids: Vec<&str> = found.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["rank_3", "rank_7", "rank_1", "rank_5", "rank_8"]);
    for record in &found {
        let stored = written.iter().find(|w| w.id == record.id).unwrap();
        assert_eq!(
            (&record.content, &record.metadata, &record.owner),
            (&stored.content, &stored.metadata, &stored.owner)
        );
        assert_eq!(record.content_hash, stored.content_hash);
        assert_eq!(record.status, MemoryStatus::Active);
    }
}

async fn memory_decisions_compaction_and_deletion(store: Arc<dyn Store>) {
    let mut pending = memory("mem_p", "agent/support", "", "Ship on Mondays", Age::zero());
    pending.status = MemoryStatus::Pending;
    store.put_memory(&pending).await.unwrap();
    // Pending records are never recalled.
    assert!(
        store
            .recall_memories("agent/support", "", &words("ship"), 5)
            .await
            .unwrap()
            .is_empty()
    );
    let decided = store
        .set_memory_status(
            "mem_p",
            &[MemoryStatus::Pending],
            MemoryStatus::Rejected,
            "ops",
            Utc::now(),
        )
        .await
        .unwrap();
    let MemoryTransition::Changed(rejected) = decided else {
        panic!("{decided:?}");
    };
    assert_eq!(
        (rejected.status, rejected.decided_by.as_deref()),
        (MemoryStatus::Rejected, Some("ops"))
    );
    // Deciding again finds it decided; an unknown id is not found.
    assert_eq!(
        store
            .set_memory_status(
                "mem_p",
                &[MemoryStatus::Pending],
                MemoryStatus::Active,
                "ops",
                Utc::now()
            )
            .await
            .unwrap(),
        MemoryTransition::Refused(MemoryStatus::Rejected)
    );
    assert_eq!(
        store
            .set_memory_status(
                "mem_x",
                &[MemoryStatus::Pending],
                MemoryStatus::Active,
                "ops",
                Utc::now()
            )
            .await
            .unwrap(),
        MemoryTransition::NotFound
    );
    assert!(
        store
            .recall_memories("agent/support", "", &words("ship"), 5)
            .await
            .unwrap()
            .is_empty()
    );

    // Near-duplicates: the newest stays; records past the TTL are archived.
    for record in [
        memory(
            "mem_a",
            "agent/support",
            "",
            "Refunds take 5 days.",
            Age::days(3),
        ),
        memory(
            "mem_b",
            "agent/support",
            "",
            "refunds take 5 days",
            Age::days(2),
        ),
        memory(
            "mem_c",
            "agent/support",
            "",
            "REFUNDS  take 5 days!",
            Age::days(1),
        ),
        memory(
            "mem_d",
            "agent/support",
            "",
            "Invoices are monthly",
            Age::days(400),
        ),
        memory(
            "mem_e",
            "agent/other",
            "",
            "refunds take 5 days",
            Age::days(3),
        ),
    ] {
        store.put_memory(&record).await.unwrap();
    }
    let report = store
        .compact_memories(
            Some("agent/support"),
            Some(Utc::now() - Age::days(365)),
            Utc::now(),
        )
        .await
        .unwrap();
    assert_eq!((report.merged, report.expired), (2, 1));
    let status = async |id: &str| store.memory(id).await.unwrap().unwrap().status;
    assert_eq!(status("mem_c").await, MemoryStatus::Active);
    assert_eq!(status("mem_a").await, MemoryStatus::Archived);
    assert_eq!(status("mem_b").await, MemoryStatus::Archived);
    assert_eq!(status("mem_d").await, MemoryStatus::Archived);
    // Another namespace was not asked about.
    assert_eq!(status("mem_e").await, MemoryStatus::Active);
    let again = store
        .compact_memories(None, None, Utc::now())
        .await
        .unwrap();
    assert_eq!((again.merged, again.expired), (0, 0));

    assert!(store.delete_memory("mem_c").await.unwrap());
    assert!(!store.delete_memory("mem_c").await.unwrap());
    assert!(store.memory("mem_c").await.unwrap().is_none());
    // Deleted content can be written again (the index forgot it too).
    let (back, merged) = store
        .put_memory(&memory(
            "mem_f",
            "agent/support",
            "",
            "REFUNDS  take 5 days!",
            Age::zero(),
        ))
        .await
        .unwrap();
    assert_eq!((back.id.as_str(), merged), ("mem_f", false));
    let found = store
        .recall_memories("agent/support", "", &words("refunds"), 5)
        .await
        .unwrap();
    assert_eq!(
        found.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        ["mem_f"]
    );
}

/// Waits for charges the embedded store's writer holds back (they ride along with its next
/// transaction, or go alone after a short idle time): a read here may come first.
/// A prune's archive reads every table once for a group of sessions; each record it finds
/// is the one the reads of a single session, request or run find, in their order.
async fn an_archive_reads_each_table_once_for_many_sessions_and_finds_what_single_reads_find(
    store: Arc<dyn Store>,
) {
    seed(&store, "a", RunStatus::WaitingApproval).await;
    seed(&store, "b", RunStatus::Completed).await;
    seed(&store, "c", RunStatus::Completed).await;
    let now = Utc::now();
    let message = |id: &str, session: &str, offset: i64| {
        WriteOp::InsertMessage(MessageRecord {
            id: id.into(),
            session_id: session.into(),
            parent_id: None,
            request_id: None,
            role: "user".into(),
            content: json!({ "role": "user", "content": id }),
            created_at: now + Age::milliseconds(offset),
        })
    };
    let (retry, on_retry) = retry_of_run_a("run_a0");
    store
        .apply(&[
            // A second request in session a, a retry of req_a, messages out of id order.
            request(
                "req_a2",
                "ses_a",
                "alice",
                RunStatus::Completed,
                Age::zero(),
            ),
            run("run_a2", "req_a2", RunStatus::Completed),
            WriteOp::InsertRun(retry),
            message("msg_2", "ses_a", 0),
            message("msg_1", "ses_a", 5),
            message("msg_3", "ses_b", 1),
            start_call("run_a", "req_a", "t2.0"),
            start_call("run_a", "req_a", "t1.0"),
            start_call("run_a0", "req_a", "t1.0"),
            start_call("run_b", "req_b", "t1.0"),
            approval("apr_2", ApprovalStatus::Pending),
            approval("apr_1", ApprovalStatus::Approved),
            WriteOp::InsertApproval(on_retry),
        ])
        .await
        .unwrap();
    // Events in rows of several (one batch) and rows of one.
    store
        .apply(
            &(1..=5)
                .map(|seq| event("req_a", "run_a", seq))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    for seq in 1..=2 {
        store.apply(&[event("req_b", "run_b", seq)]).await.unwrap();
    }
    store.apply(&[event("req_a2", "run_a2", 1)]).await.unwrap();

    let sessions: Vec<String> = ["ses_b", "ses_gone", "ses_a"].map(String::from).into();
    assert_eq!(
        store.requests_per_session(&sessions).await.unwrap(),
        [1, 0, 2]
    );
    let rows = store.archive_rows(&sessions).await.unwrap();
    // Session c was not asked for: nothing of it is read.
    assert!(rows.requests.iter().all(|r| r.session_id != "ses_c"));
    assert!(rows.events.iter().all(|e| &*e.request_id != "req_c"));
    let mut found_sessions = Vec::new();
    for id in ["ses_a", "ses_b"] {
        found_sessions.push(store.session(id).await.unwrap().unwrap());
        let messages = picked(&rows.messages, |m: &MessageRecord| m.session_id == id);
        let single = store.messages(id).await.unwrap();
        assert_eq!(messages, single.iter().collect::<Vec<_>>(), "{id}");
        let requests = picked(&rows.requests, |r: &RequestRecord| r.session_id == id);
        let filter = RequestFilter {
            session_id: Some(id.into()),
            ..RequestFilter::default()
        };
        let page = PageRequest {
            limit: 50,
            cursor: None,
        };
        let single = store
            .requests(&filter, &page, RequestInput::Read)
            .await
            .unwrap()
            .items;
        assert_eq!(requests, single.iter().collect::<Vec<_>>(), "{id}");
        for request in single {
            let events = picked(&rows.events, |e: &EventRecord| *e.request_id == *request.id);
            let single = store.events(&request.id, 0, i64::MAX).await.unwrap();
            assert!(!single.is_empty());
            assert_eq!(events, single.iter().collect::<Vec<_>>(), "{}", request.id);
            let runs = picked(&rows.runs, |r: &RunRecord| r.request_id == request.id);
            let single = store.runs_of(&request.id).await.unwrap();
            assert_eq!(runs, single.iter().collect::<Vec<_>>(), "{}", request.id);
            for run in single {
                let calls = picked(&rows.tool_calls, |c: &ToolCallRecord| c.run_id == run.id);
                let mut single = store.tool_calls_of_run(&run.id).await.unwrap();
                single.sort_by(|x, y| x.call_key.cmp(&y.call_key));
                assert_eq!(calls, single.iter().collect::<Vec<_>>(), "{}", run.id);
                let approvals = picked(&rows.approvals, |a: &ApprovalRecord| a.run_id == run.id);
                let single = store.approvals_of_run(&run.id).await.unwrap();
                assert_eq!(approvals, single.iter().collect::<Vec<_>>(), "{}", run.id);
            }
        }
    }
    found_sessions.sort_by(|x, y| x.id.cmp(&y.id));
    assert_eq!(rows.sessions, found_sessions);
    // Nothing more than those: 2 sessions, 3 messages, 3 requests, 4 runs, 8 events, 4 calls,
    // 3 approvals.
    let counts = [
        rows.sessions.len(),
        rows.messages.len(),
        rows.requests.len(),
        rows.runs.len(),
        rows.events.len(),
        rows.tool_calls.len(),
        rows.approvals.len(),
    ];
    assert_eq!(counts, [2, 3, 3, 4, 8, 4, 3]);
    assert_eq!(store.archive_rows(&[]).await.unwrap(), Default::default());
}

async fn a_request_is_read_in_full_with_runs_approvals_and_charges(store: Arc<dyn Store>) {
    use stable_harness::store::spend::UsageRecord;
    seed(&store, "a", RunStatus::WaitingApproval).await;
    seed(&store, "b", RunStatus::Running).await;
    // A second attempt whose id, and its approval's, sort before the first's: the view
    // lists runs by attempt, and approvals run by run.
    let (retry, on_retry) = retry_of_run_a("run_0a");
    // A decided approval, every field of it set.
    let WriteOp::InsertApproval(mut decided) = approval("apr_2", ApprovalStatus::Approved) else {
        unreachable!("approval() inserts an approval")
    };
    decided.arguments = json!({ "amount": 12.5, "note": "ü" });
    decided.rule = Some("refunds".into());
    decided.reason = Some("checked".into());
    decided.decided_by = Some("operator".into());
    decided.expires_at = Some(Utc::now() + Age::minutes(5));
    decided.decided_at = Some(Utc::now());
    store
        .apply(&[
            WriteOp::InsertApproval(decided),
            approval("apr_1", ApprovalStatus::Pending),
            WriteOp::InsertRun(retry),
            WriteOp::InsertApproval(on_retry),
        ])
        .await
        .unwrap();
    let charge = |id: &str, request: &str, prompt: u64, cost: Option<i64>| UsageRecord {
        id: id.into(),
        at: Utc::now(),
        request_id: request.into(),
        run_id: "run_a".into(),
        owner: "alice".into(),
        agent_id: "assistant".into(),
        session_id: "ses_a".into(),
        model: "main".into(),
        source: "model".into(),
        prompt_tokens: prompt,
        completion_tokens: 5,
        cost_nanos: cost,
        estimated: cost.is_none(),
    };
    for record in [
        charge("use_1", "req_a", 100, Some(2_000)),
        charge("use_2", "req_a", 20, None),
        charge("use_3", "req_b", 7, Some(1)),
    ] {
        store.record_usage(&record, &[], None).await.unwrap();
    }
    // Charges may ride along with the store's next write: read until both show.
    let full = until(async || {
        let full = store.request_in_full("req_a").await.unwrap().unwrap();
        (full.charged.calls == 2).then_some(full)
    })
    .await;
    assert_eq!(full.request.id, "req_a");
    assert_eq!(full.request.owner, "alice");
    assert_eq!(full.request.status, RunStatus::WaitingApproval);
    let runs: Vec<&str> = full.runs.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(runs, ["run_a", "run_0a"]);
    let approvals: Vec<(&str, ApprovalStatus)> = full
        .approvals
        .iter()
        .map(|a| (a.id.as_str(), a.status))
        .collect();
    assert_eq!(
        approvals,
        [
            ("apr_1", ApprovalStatus::Pending),
            ("apr_2", ApprovalStatus::Approved),
            ("apr_0", ApprovalStatus::Pending)
        ]
    );
    assert_eq!(full.charged.prompt_tokens, 120);
    assert_eq!(full.charged.completion_tokens, 10);
    assert_eq!(full.charged.estimated_calls, 1);
    assert!(
        full.charged
            .cost
            .is_some_and(|cost| (cost - 2e-6).abs() < 1e-12)
    );
    // Each part of the view is the record as read on its own, to the microsecond: a run with
    // a conversation, an error, a lease and a cancel asked for, a run with none of them, and
    // approvals pending and decided (PostgreSQL reads the view's runs and approvals as JSON).
    store
        .apply(&[WriteOp::UpdateRun {
            id: "run_a".into(),
            status: RunStatus::WaitingApproval,
            error: Some(json!({ "code": "tool_failed", "message": "ü \"quoted\"\n" })),
            state: Some(json!({ "messages": [{ "role": "user", "content": "ü" }], "n": 1.5 })),
            at: Utc::now(),
        }])
        .await
        .unwrap();
    assert!(store.request_cancel("run_a", "operator").await.unwrap());
    let full = store.request_in_full("req_a").await.unwrap().unwrap();
    assert_eq!(full.runs.len(), 2);
    // A run's `state` (its conversation) is not read for a view, which never shows it.
    for run in &full.runs {
        let alone = store.run(&run.id).await.unwrap().unwrap();
        assert_eq!(
            run,
            &RunRecord {
                state: None,
                ..alone
            }
        );
    }
    assert!(store.run("run_a").await.unwrap().unwrap().state.is_some());
    assert_eq!(
        store.runs_of_requests(&["req_a".into()]).await.unwrap(),
        full.runs
    );
    assert!(full.runs[0].lease.is_some() && full.runs[0].cancel_requested_by.is_some());
    assert_eq!(full.approvals.len(), 3);
    for approval in &full.approvals {
        assert_eq!(
            Some(approval),
            store.approval(&approval.id).await.unwrap().as_ref()
        );
    }
    // The view's request is the request as read on its own but for its input, which no view
    // shows and a view does not read (the whole transcript: every `wait` would parse it).
    let alone = store.request("req_a").await.unwrap().unwrap();
    assert_ne!(alone.input, serde_json::Value::Null);
    assert_eq!(
        full.request,
        RequestRecord {
            input: serde_json::Value::Null,
            ..alone
        }
    );
    let other = store.request_in_full("req_b").await.unwrap().unwrap();
    assert!(other.approvals.is_empty());
    assert_eq!(other.charged.calls, 1);
    seed(&store, "c", RunStatus::Queued).await;
    let uncharged = store.request_in_full("req_c").await.unwrap().unwrap();
    assert_eq!(uncharged.runs.len(), 1);
    assert_eq!(uncharged.charged.calls, 0);
    assert_eq!(uncharged.charged.total_tokens, 0);
    assert_eq!(uncharged.charged.cost, None);
    assert!(
        store
            .request_in_full("req_missing")
            .await
            .unwrap()
            .is_none()
    );
    // Views read together are each the view read alone; an id not stored has none.
    let mut alone = Vec::new();
    for id in ["req_a", "req_b", "req_c"] {
        alone.push(store.request_in_full(id).await.unwrap().unwrap());
    }
    let mut together = store
        .requests_in_full(0, &["req_c", "req_missing", "req_a", "req_b"])
        .await
        .unwrap();
    together.sort_by(|x, y| x.request.id.cmp(&y.request.id));
    assert_eq!(together, alone);
    assert!(store.requests_in_full(0, &[]).await.unwrap().is_empty());
    let lone = store.requests_in_full(0, &["req_b"]).await.unwrap();
    assert_eq!(lone, alone[1..2]);
}

/// A view is never older in its parts than in its request: read again and again while the
/// request and its run end in one transaction, a view that shows the request ended shows its
/// run ended too.
async fn a_view_never_shows_an_ended_request_with_a_live_run(store: Arc<dyn Store>) {
    for n in 0..40 {
        let name = format!("v{n:02}");
        seed(&store, &name, RunStatus::Running).await;
        let (request, run) = (format!("req_{name}"), format!("run_{name}"));
        let reader = async {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                let full = store.request_in_full(&request).await.unwrap().unwrap();
                if full.request.status == RunStatus::Completed {
                    let runs: Vec<RunStatus> = full.runs.iter().map(|r| r.status).collect();
                    assert_eq!(runs, [RunStatus::Completed], "the view of {request}");
                    return;
                }
            }
            panic!("{request} never showed as ended");
        };
        let ender = async {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            store
                .apply(&[
                    update_run(&run, RunStatus::Completed),
                    WriteOp::UpdateRequest {
                        id: request.clone(),
                        status: RunStatus::Completed,
                        output: Some("done".into()),
                        error: None,
                        usage: None,
                        at: Utc::now(),
                    },
                ])
                .await
                .unwrap();
        };
        tokio::join!(reader, ender);
    }
}

async fn until<T>(mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    for _ in 0..100 {
        if let Some(found) = probe().await {
            return found;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the charges never showed");
}

async fn a_charge_counts_once_and_the_ledger_adds_up_by_group(store: Arc<dyn Store>) {
    use stable_harness::store::spend::{
        Amount, CounterDelta, CounterKey, UsageFilter, UsageGroupBy, UsageRecord,
    };
    // One time for every charge, so the day they group under is known even across midnight.
    let at = Utc::now();
    let record = |id: &str, agent: &str, model: &str, prompt: u64, cost: Option<i64>| UsageRecord {
        id: id.into(),
        at,
        request_id: format!("req_{id}"),
        run_id: "run_1".into(),
        owner: "key-a".into(),
        agent_id: agent.into(),
        session_id: "ses_1".into(),
        model: model.into(),
        source: "model".into(),
        prompt_tokens: prompt,
        completion_tokens: 10,
        cost_nanos: cost,
        estimated: cost.is_none(),
    };
    let key = CounterKey {
        budget: "pool".into(),
        subject: "*".into(),
    };
    let delta = |tokens: u64| CounterDelta {
        key: key.clone(),
        bucket: 1_000,
        amount: Amount {
            tokens,
            cost_nanos: 5,
        },
    };
    let first = record("use_1", "assistant", "main", 100, Some(2_000));
    store
        .record_usage(&first, &[delta(110)], None)
        .await
        .unwrap();
    // Written again (a retried write whose reply was lost): counted once.
    store
        .record_usage(&first, &[delta(110)], None)
        .await
        .unwrap();
    store
        .record_usage(
            &record("use_2", "helper", "main", 40, None),
            &[delta(50)],
            None,
        )
        .await
        .unwrap();
    // A charge no budget counts, written twice: recorded once too.
    for _ in 0..2 {
        store
            .record_usage(
                &record("use_3", "helper", "fast", 7, Some(1_000)),
                &[],
                None,
            )
            .await
            .unwrap();
    }
    let buckets = until(async || {
        let buckets = store.counter_buckets(&key, 0).await.unwrap();
        (buckets.first().is_some_and(|(_, a)| a.tokens == 160)).then_some(buckets)
    })
    .await;
    assert_eq!(
        buckets,
        [(
            1_000,
            Amount {
                tokens: 160,
                cost_nanos: 10
            }
        )]
    );
    assert!(store.counter_buckets(&key, 1_001).await.unwrap().is_empty());
    assert_eq!(
        store.budget_subjects("pool", 0).await.unwrap(),
        [(
            "*".to_owned(),
            Amount {
                tokens: 160,
                cost_nanos: 10
            }
        )]
    );
    let totals = until(async || {
        let totals = store
            .usage_totals(&UsageFilter::default(), None)
            .await
            .unwrap();
        (totals.first().is_some_and(|t| t.calls == 3)).then_some(totals)
    })
    .await;
    assert_eq!(totals[0].prompt_tokens, 147);
    assert_eq!(totals[0].total_tokens, 177);
    assert_eq!(totals[0].estimated_calls, 1);
    assert!((totals[0].cost.unwrap() - 3e-6).abs() < 1e-12);
    let by_agent = store
        .usage_totals(&UsageFilter::default(), Some(UsageGroupBy::Agent))
        .await
        .unwrap();
    let agents: Vec<(&str, u64)> = by_agent
        .iter()
        .map(|t| (t.group.as_str(), t.calls))
        .collect();
    assert_eq!(agents, [("assistant", 1), ("helper", 2)]);
    let by_model = store
        .usage_totals(
            &UsageFilter {
                agent_id: Some("helper".into()),
                ..Default::default()
            },
            Some(UsageGroupBy::Model),
        )
        .await
        .unwrap();
    let models: Vec<(&str, u64)> = by_model
        .iter()
        .map(|t| (t.group.as_str(), t.prompt_tokens))
        .collect();
    assert_eq!(models, [("fast", 7), ("main", 40)]);
    // A model without a price adds no cost to its group; the day groups every call of its day.
    assert_eq!(by_model[1].cost, None);
    let by_day = store
        .usage_totals(&UsageFilter::default(), Some(UsageGroupBy::Day))
        .await
        .unwrap();
    assert_eq!(by_day.len(), 1);
    assert_eq!(by_day[0].group, at.format("%Y-%m-%d").to_string());
    let none = store
        .usage_totals(
            &UsageFilter {
                request_id: Some("req_nothing".into()),
                ..Default::default()
            },
            None,
        )
        .await
        .unwrap();
    assert!(none.is_empty());
}

/// A settled call's charge is queued, not written in a transaction of its own: the next batch
/// the store applies commits it (what lets a run's end carry its charges, so a request's
/// answer never goes out before they are stored); a batch refused for a reason of its own
/// does not take it down; with no batch to ride along with, it is written alone.
async fn a_charge_commits_with_the_next_batch_or_alone(store: Arc<dyn Store>) {
    use stable_harness::store::spend::{Amount, Claim, CounterDelta, CounterKey, UsageRecord};
    let key = CounterKey {
        budget: "pool".into(),
        subject: "*".into(),
    };
    let charge = |id: &str, tokens: u64| {
        let record = UsageRecord {
            id: id.into(),
            at: Utc::now(),
            request_id: "req_paid".into(),
            run_id: "run_paid".into(),
            owner: "key-a".into(),
            agent_id: "assistant".into(),
            session_id: "ses_paid".into(),
            model: "main".into(),
            source: "model".into(),
            prompt_tokens: tokens,
            completion_tokens: 0,
            cost_nanos: None,
            estimated: false,
        };
        let delta = CounterDelta {
            key: key.clone(),
            bucket: 7,
            amount: Amount {
                tokens,
                cost_nanos: 0,
            },
        };
        (record, vec![delta])
    };
    let used = async || store.counter_buckets(&key, 0).await.unwrap();
    let tokens = |buckets: Vec<(i64, Amount)>| buckets.first().map_or(0, |(_, a)| a.tokens);

    // On a shared store the call was reserved first; settling releases that reservation in
    // the charge's transaction.
    if store.is_shared() {
        let claim = Claim {
            key: key.clone(),
            from_bucket: 0,
            amount: Amount {
                tokens: 500,
                cost_nanos: 0,
            },
            max_tokens: None,
            max_cost_nanos: None,
        };
        let refused = store
            .reserve_shared("hold_paid", "run_paid", &[claim])
            .await
            .unwrap();
        assert!(refused.is_none());
        assert_eq!(store.reserved_shared(&key).await.unwrap().tokens, 500);
    }
    let (record, deltas) = charge("use_first", 100);
    store
        .record_usage(&record, &deltas, Some("hold_paid"))
        .await
        .unwrap();
    // The batch's commit carried it: stored as soon as the batch is, reservation released.
    seed(&store, "paid", RunStatus::Running).await;
    assert_eq!(tokens(used().await), 100);
    assert_eq!(store.reserved_shared(&key).await.unwrap().tokens, 0);

    // A batch refused for a reason of its own (its run names a request that does not exist):
    // the batch leaves nothing, and the charge it carried is stored all the same.
    let (record, deltas) = charge("use_second", 20);
    store.record_usage(&record, &deltas, None).await.unwrap();
    let refused = store
        .apply(&[run("run_orphan", "req_missing", RunStatus::Running)])
        .await;
    assert!(refused.is_err());
    assert!(store.run("run_orphan").await.unwrap().is_none());
    until(async || (tokens(used().await) == 120).then_some(())).await;

    // No batch follows: written alone.
    let (record, deltas) = charge("use_third", 3);
    store.record_usage(&record, &deltas, None).await.unwrap();
    until(async || (tokens(used().await) == 123).then_some(())).await;
    let totals = store
        .usage_totals(
            &stable_harness::store::spend::UsageFilter {
                request_id: Some("req_paid".into()),
                ..Default::default()
            },
            None,
        )
        .await
        .unwrap();
    assert_eq!(totals[0].calls, 3);
    assert_eq!(totals[0].prompt_tokens, 123);
}

/// On PostgreSQL a charge still queued when the store closes (no batch came for it) is
/// written as it closes, not lost with the process's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_writes_the_charges_still_queued_when_the_store_closes() {
    use stable_harness::store::spend::{Amount, CounterDelta, CounterKey, UsageRecord};
    let url = crate::pg::fresh_database();
    let open = async || postgres_store_at(&url).await;
    let key = CounterKey {
        budget: "pool".into(),
        subject: "*".into(),
    };
    let record = UsageRecord {
        id: "use_last".into(),
        at: Utc::now(),
        request_id: "req_last".into(),
        run_id: "run_last".into(),
        owner: "key-a".into(),
        agent_id: "assistant".into(),
        session_id: "ses_last".into(),
        model: "main".into(),
        source: "model".into(),
        prompt_tokens: 5,
        completion_tokens: 0,
        cost_nanos: None,
        estimated: false,
    };
    let delta = CounterDelta {
        key: key.clone(),
        bucket: 1,
        amount: Amount {
            tokens: 5,
            cost_nanos: 0,
        },
    };
    let store = open().await;
    store.record_usage(&record, &[delta], None).await.unwrap();
    drop(store);
    let store = open().await;
    until(async || {
        let buckets = store.counter_buckets(&key, 0).await.unwrap();
        (buckets.first().is_some_and(|(_, a)| a.tokens == 5)).then_some(())
    })
    .await;
}

/// On PostgreSQL a batch locks the sessions it touches before anything else, in id order
/// (whatever the order of its ops), so two batches touching the same sessions never deadlock
/// on them. And a journal batch that does lose a deadlock (SQLSTATE 40P01) to another
/// transaction is applied again once that one is through, the store never reported
/// unavailable meanwhile: a race lost is not a store that cannot write. The other side holds
/// the batch's request and then asks for a session the batch locked; its `deadlock_timeout`
/// is far longer, so the batch's backend finds the deadlock and is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_batch_locks_its_sessions_first_and_one_refused_by_a_deadlock_is_applied_again()
 {
    use sqlx::Connection;
    let url = crate::pg::fresh_database();
    let store = postgres_store_at(&url).await;
    seed(&store, "d", RunStatus::Running).await;
    seed(&store, "e", RunStatus::Running).await;
    let journal = journal_on(&store);
    let mut other = sqlx::PgConnection::connect(&url).await.unwrap();
    let mut other = other.begin().await.unwrap();
    for sql in [
        "SET LOCAL deadlock_timeout = '60s'",
        "SELECT 1 FROM requests WHERE id = 'req_d' FOR UPDATE",
    ] {
        sqlx::query(sql).execute(&mut *other).await.unwrap();
    }
    // Watches the journal's availability for the whole test.
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (journal, watching) = (journal.clone(), Arc::clone(&watching));
        tokio::spawn(async move {
            let mut unavailable = 0;
            while watching.load(std::sync::atomic::Ordering::SeqCst) {
                if !journal.is_available() {
                    unavailable += 1;
                }
                tokio::time::sleep(std::time::Duration::from_micros(200)).await;
            }
            unavailable
        })
    };
    // The batch locks its sessions, then waits for its request.
    let batch = {
        let journal = journal.clone();
        tokio::spawn(async move {
            journal
                .commit(
                    Some("req_d"),
                    vec![
                        session("ses_e", "alice", Age::zero()),
                        session("ses_d", "alice", Age::zero()),
                        event("req_d", "run_d", 0),
                    ],
                )
                .await
        })
    };
    let deadlocks = || async {
        let mut probe = sqlx::PgConnection::connect(&url).await.unwrap();
        let count: i64 = sqlx::query_scalar(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(&mut probe)
        .await
        .unwrap();
        count
    };
    let before = deadlocks().await;
    let mut probe = sqlx::PgConnection::connect(&url).await.unwrap();
    let mut waiting = 0_i64;
    for _ in 0..1_000 {
        waiting = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock'",
        )
        .fetch_one(&mut probe)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(waiting, 1, "the batch waits for its request");
    for id in ["ses_d", "ses_e"] {
        let taken = sqlx::query("SELECT 1 FROM sessions WHERE id = $1 FOR UPDATE NOWAIT")
            .bind(id)
            .execute(&mut probe)
            .await;
        let code = match &taken {
            Err(sqlx::Error::Database(error)) => error.code().map(|code| code.into_owned()),
            _ => None,
        };
        assert_eq!(
            code.as_deref(),
            Some("55P03"),
            "{id} was locked by the batch before its request: {taken:?}"
        );
    }
    // Closes the cycle: waits for a session's lock until the batch's backend is refused.
    sqlx::query("SELECT 1 FROM sessions WHERE id = 'ses_e' FOR UPDATE")
        .execute(&mut *other)
        .await
        .unwrap();
    other.commit().await.unwrap();
    let applied = tokio::time::timeout(std::time::Duration::from_secs(30), batch)
        .await
        .expect("the batch was applied again")
        .unwrap();
    assert!(applied.is_ok(), "{applied:?}");
    watching.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        watcher.await.unwrap(),
        0,
        "the store was reported unavailable"
    );
    // The count is published by the refused backend a moment after its transaction (within
    // a second of going idle).
    let mut counted = false;
    for _ in 0..100 {
        counted = deadlocks().await > before;
        if counted {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(counted, "the batch lost a deadlock");
    let events = store.events("req_d", 0, 10).await.unwrap();
    assert_eq!(events.len(), 1, "applied once");
    assert_eq!(events[0].seq, 1);
}

/// A writer lane keeps its own backend from batch to batch (a pooled connection would cost
/// two more round trips each), and opens another when the database ends it: the next batch
/// is applied once, nothing lost. Fails when a lane keeps a dead backend or a batch is
/// dropped with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_writer_lane_keeps_its_backend_and_opens_another_when_it_is_ended() {
    let (store, mut probe) = postgres_store_and_probe().await;
    seed(&store, "f", RunStatus::Running).await;
    let journal = journal_on(&store);
    // The backends whose last statement applied a batch, but those named in `but`.
    let appliers = async |probe: &mut sqlx::PgConnection, but: &[i32]| -> Vec<i32> {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
             AND pid <> pg_backend_pid() AND query LIKE '%stable_harness_apply(%' ORDER BY pid",
        )
        .fetch_all(probe)
        .await
        .unwrap();
        pids.into_iter().filter(|pid| !but.contains(pid)).collect()
    };
    // The pool's backend that seeded.
    let seeded = appliers(&mut probe, &[]).await;
    let commit = async |journal: &stable_harness::runtime::Journal| {
        tokio::time::timeout(
            std::time::Duration::from_secs(30),
            journal.commit(Some("req_f"), vec![event("req_f", "run_f", 0)]),
        )
        .await
        .expect("the batch was applied")
        .unwrap()
    };
    commit(&journal).await;
    let first = appliers(&mut probe, &seeded).await;
    assert_eq!(first.len(), 1, "one lane applied the request's batch");
    commit(&journal).await;
    assert_eq!(
        appliers(&mut probe, &seeded).await,
        first,
        "the lane kept its backend"
    );

    end_every_other_backend(&mut probe).await;
    commit(&journal).await;
    let after = appliers(&mut probe, &seeded).await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(after, first, "the lane opened another backend");
    assert!(journal.is_available());
    let numbers: Vec<i64> = store
        .events("req_f", 0, 10)
        .await
        .unwrap()
        .iter()
        .map(|event| event.seq)
        .collect();
    assert_eq!(numbers, vec![1, 2, 3], "each batch applied once");
}

/// The reads on a request's answer path (its view, and what a continued conversation reads)
/// are made on a backend the store keeps (a pooled connection is pinged when taken and again
/// when returned), named as such in `pg_stat_activity`, and a kept backend the database ended
/// is replaced within the read: the read still answers. Fails when a read goes through the
/// pool, or when a read on an ended backend is not made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_answer_path_reads_use_a_kept_backend_and_are_made_again_when_it_is_ended() {
    let (store, mut probe) = postgres_store_and_probe().await;
    seed(&store, "k", RunStatus::Completed).await;
    store
        .apply(&[WriteOp::InsertMessage(MessageRecord {
            id: "msg_k".into(),
            session_id: "ses_k".into(),
            parent_id: None,
            request_id: Some("req_k".into()),
            role: "user".into(),
            content: json!({ "role": "user", "content": "Hello" }),
            created_at: Utc::now(),
        })])
        .await
        .unwrap();
    // The store's reader backends whose last statement is like `statement`.
    let readers = async |probe: &mut sqlx::PgConnection, statement: &str| -> Vec<i32> {
        sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name = 'stable-harness reader' AND query LIKE $1 ORDER BY pid",
        )
        .bind(format!("%{statement}%"))
        .fetch_all(probe)
        .await
        .unwrap()
    };
    let read = async || {
        let full = store.request_in_full("req_k").await.unwrap().unwrap();
        assert_eq!(full.runs.len(), 1);
        assert_eq!(full.runs[0].status, RunStatus::Completed);
    };
    read().await;
    let first = readers(&mut probe, "view_runs").await;
    assert_eq!(first.len(), 1, "a kept backend read the view: {first:?}");
    read().await;
    assert_eq!(readers(&mut probe, "view_runs").await, first, "kept");
    // A continued conversation's reads, one after the other, on the same backend.
    assert!(store.request("req_k").await.unwrap().is_some());
    assert_eq!(readers(&mut probe, "FROM requests WHERE").await, first);
    assert_eq!(last_seq(&store, "req_k").await, 0);
    assert_eq!(readers(&mut probe, "ORDER BY e.seq DESC").await, first);
    assert!(store.events("req_k", 0, 1).await.unwrap().is_empty());
    assert_eq!(readers(&mut probe, "e.seq > $2").await, first);
    assert!(store.session("ses_k").await.unwrap().is_some());
    assert_eq!(readers(&mut probe, "FROM sessions WHERE").await, first);
    let head = store.session_head("ses_k").await.unwrap();
    assert_eq!(head.as_deref(), Some("msg_k"));
    assert_eq!(readers(&mut probe, "NOT EXISTS").await, first);
    assert_eq!(store.message_path("msg_k").await.unwrap().len(), 1);
    assert_eq!(
        readers(&mut probe, "FROM messages WHERE session_id").await,
        first
    );

    end_every_other_backend(&mut probe).await;
    // Terminated backends leave `pg_stat_activity` once they have exited.
    for _ in 0..100 {
        if readers(&mut probe, "").await.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    read().await;
    let after = readers(&mut probe, "view_runs").await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(after, first, "another backend read the view");
}

/// A row of events past the ~2 KB at which PostgreSQL compresses a row's values is
/// compressed with LZ4 where the server has it (migration `0013`), pglz otherwise: a row
/// packing a run's events took 2.2-2.6 KB with their ids, types and times, and pglz cost
/// about seven times LZ4's CPU for nearly the same size. Fails without the migration (pglz).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_row_of_events_past_2_kb_is_compressed_with_lz4_where_the_server_has_it() {
    let (store, mut probe) = postgres_store_and_probe().await;
    seed(&store, "w", RunStatus::Running).await;
    let events: Vec<WriteOp> = (1..=16).map(|seq| event("req_w", "run_w", seq)).collect();
    store.apply(&events).await.unwrap();
    let has_lz4: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_settings \
         WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals))",
    )
    .fetch_one(&mut probe)
    .await
    .unwrap();
    let (rows, compression): (i64, Option<String>) = sqlx::query_as(
        "SELECT count(*), max(pg_column_compression(more)) FROM events WHERE request_id = 'req_w'",
    )
    .fetch_one(&mut probe)
    .await
    .unwrap();
    assert_eq!(rows, 1, "one run's sixteen events share a row");
    let expected = if has_lz4 { "lz4" } else { "pglz" };
    assert_eq!(
        compression.as_deref(),
        Some(expected),
        "the row is past the threshold"
    );
    // Each long value a request writes is set to LZ4 (`l`), whatever the server's default.
    let set: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname || '.' || a.attname FROM pg_attribute a \
         JOIN pg_class c ON c.oid = a.attrelid \
         WHERE c.relname IN ('events', 'messages', 'requests') AND a.attcompression = 'l' \
         ORDER BY 1",
    )
    .fetch_all(&mut probe)
    .await
    .unwrap();
    let expected: Vec<&str> = if has_lz4 {
        vec![
            "events.data",
            "events.more",
            "messages.content",
            "requests.input",
            "requests.output",
        ]
    } else {
        Vec::new()
    };
    assert_eq!(set, expected);
    let read: Vec<i64> = store
        .events("req_w", 0, 100)
        .await
        .unwrap()
        .iter()
        .map(|event| event.seq)
        .collect();
    assert_eq!(read, (1..=16).collect::<Vec<_>>(), "and read back whole");
}

/// A request and its run inserted, started, and ended: the ops the common request commits
/// in one transaction. `at` is fixed, so two copies store the same times.
fn lifecycle(name: &str, at: chrono::DateTime<Utc>, end: Option<RunStatus>) -> Vec<WriteOp> {
    let session = format!("ses_{name}");
    let request_id = format!("req_{name}");
    let run_id = format!("run_{name}");
    let inserted_request = request_at(&request_id, &session, at);
    let mut inserted_run = run_at(&run_id, &request_id, at);
    if let WriteOp::InsertRun(record) = &mut inserted_run {
        record.error = Some(json!({ "first": true }));
    }
    let later = at + Age::milliseconds(5);
    let mut ops = vec![
        session_at(&session, at),
        inserted_request,
        inserted_run,
        event(&request_id, &run_id, 0),
        WriteOp::UpdateRun {
            id: run_id.clone(),
            status: RunStatus::Running,
            error: None,
            state: Some(json!({ "messages": ["checkpoint"] })),
            at,
        },
        WriteOp::UpdateRequest {
            id: request_id.clone(),
            status: RunStatus::Running,
            output: Some("partial".into()),
            error: Some(json!({ "transient": true })),
            usage: Some(json!({ "total_tokens": 1 })),
            at,
        },
        event(&request_id, &run_id, 0),
    ];
    if let Some(end) = end {
        ops.extend([
            WriteOp::UpdateRun {
                id: run_id.clone(),
                status: end,
                error: None,
                state: Some(json!({ "messages": ["dropped"] })),
                at: later,
            },
            WriteOp::UpdateRequest {
                id: request_id.clone(),
                status: end,
                output: None,
                error: None,
                usage: Some(json!({ "total_tokens": 2 })),
                at: later,
            },
            event(&request_id, &run_id, 0),
        ]);
    }
    ops
}

/// A queued request of alice's, inserted at `at`.
fn request_at(id: &str, session: &str, at: chrono::DateTime<Utc>) -> WriteOp {
    let mut op = request(id, session, "alice", RunStatus::Queued, Age::zero());
    if let WriteOp::InsertRequest(record) = &mut op {
        record.created_at = at;
        record.updated_at = at;
    }
    op
}

/// A queued run, inserted at `at`.
fn run_at(id: &str, request: &str, at: chrono::DateTime<Utc>) -> WriteOp {
    let mut op = run(id, request, RunStatus::Queued);
    if let WriteOp::InsertRun(record) = &mut op {
        record.created_at = at;
        record.updated_at = at;
    }
    op
}

/// The records of `all` that `keep` picks, in their order: what an archive read for several
/// sessions holds of one session, request or run, to compare with what a single read finds.
fn picked<T>(all: &[T], keep: impl Fn(&T) -> bool) -> Vec<&T> {
    all.iter().filter(|record| keep(record)).collect()
}

fn session_at(id: &str, at: chrono::DateTime<Utc>) -> WriteOp {
    let mut op = session(id, "alice", Age::zero());
    if let WriteOp::TouchSession(record) = &mut op {
        record.created_at = at;
        record.updated_at = at;
    }
    op
}

/// The stored request and run of `lifecycle(name)`, with their ids blanked for comparison
/// and the lease's expiry dropped (it is taken at each write).
async fn stored(store: &Arc<dyn Store>, name: &str) -> (RequestRecord, RunRecord) {
    let mut request = store
        .request(&format!("req_{name}"))
        .await
        .unwrap()
        .unwrap();
    request.id.clear();
    request.session_id.clear();
    let mut run = store.run(&format!("run_{name}")).await.unwrap().unwrap();
    run.id.clear();
    run.request_id.clear();
    if let Some(lease) = &mut run.lease {
        lease.expires_at = chrono::DateTime::<Utc>::MIN_UTC;
    }
    (request, run)
}

async fn updates_in_the_batch_that_inserts_leave_what_separate_transactions_leave(
    store: Arc<dyn Store>,
) {
    // Whole microseconds: what both stores keep.
    let at = chrono::SubsecRound::trunc_subsecs(Utc::now() - Age::seconds(1), 6);
    for (end, ended) in [(Some(RunStatus::Completed), true), (None, false)] {
        let (one, apart) = if ended {
            ("one", "apart")
        } else {
            ("one_live", "apart_live")
        };
        // One transaction (the store may write each row once), against one per op.
        store.apply(&lifecycle(one, at, end)).await.unwrap();
        for op in lifecycle(apart, at, end) {
            store.apply(&[op]).await.unwrap();
        }
        assert_eq!(stored(&store, one).await, stored(&store, apart).await);
        let (request, run) = stored(&store, one).await;
        // What the updates left: the last status, output and usage kept, the error replaced,
        // the run's first error kept, its checkpoint and lease dropped once it ended.
        assert_eq!(request.output.as_deref(), Some("partial"));
        assert_eq!(run.error, Some(json!({ "first": true })));
        assert_eq!(run.started_at, Some(at));
        if ended {
            assert_eq!(request.status, RunStatus::Completed);
            assert_eq!(request.error, None);
            assert_eq!(request.usage, Some(json!({ "total_tokens": 2 })));
            assert_eq!(run.status, RunStatus::Completed);
            assert_eq!((run.state.as_ref(), run.lease.as_ref()), (None, None));
            assert_eq!(run.ended_at, Some(at + Age::milliseconds(5)));
        } else {
            assert_eq!(request.error, Some(json!({ "transient": true })));
            assert_eq!(run.status, RunStatus::Running);
            assert_eq!(run.state, Some(json!({ "messages": ["checkpoint"] })));
            assert!(run.lease.is_some(), "a live run keeps its lease");
        }
        assert_eq!(
            last_seq(&store, &format!("req_{one}")).await,
            if ended { 3 } else { 2 }
        );
    }
    // An update after the run ended, in the same batch, is refused as it is on its own: the
    // run holds no lease any more. The whole batch is refused.
    let mut ops = lifecycle("late", at, Some(RunStatus::Completed));
    ops.push(update_run("run_late", RunStatus::Running));
    let refused = store.apply(&ops).await;
    assert!(
        matches!(refused, Err(StoreError::LeaseLost(_))),
        "{refused:?}"
    );
    assert!(store.request("req_late").await.unwrap().is_none());
}

/// Three requests' submits and ends as the journal batches them (one after another, each
/// request's ops in its order), with their session touched by each, under `prefix`; and a
/// request stored before, updated in the same batch.
fn submits(prefix: &str, at: chrono::DateTime<Utc>) -> Vec<WriteOp> {
    let session = format!("ses_{prefix}");
    let mut ops = Vec::new();
    let mut parent = None;
    for n in 0..3 {
        let step = at + Age::milliseconds(10 * n);
        let request_id = format!("req_{prefix}_{n}");
        let run_id = format!("run_{prefix}_{n}");
        let mut touch = session_at(&session, step);
        if let WriteOp::TouchSession(record) = &mut touch {
            // Only a new session's first touch says who made it: later touches only move
            // `updated_at`, whatever else they carry.
            record.agent_id = format!("agent_{n}");
            record.metadata = json!({ "touch": n });
        }
        let inserted = request_at(&request_id, &session, step);
        let message_id = format!("msg_{prefix}_{n}");
        let message = WriteOp::InsertMessage(MessageRecord {
            id: message_id.clone(),
            session_id: session.clone(),
            parent_id: parent.replace(message_id),
            request_id: Some(request_id.clone()),
            role: "user".into(),
            content: json!({ "role": "user", "content": format!("turn {n}") }),
            created_at: step,
        });
        let inserted_run = run_at(&run_id, &request_id, step);
        ops.extend([
            touch,
            inserted,
            message,
            inserted_run,
            event(&request_id, &run_id, 0),
        ]);
        if n == 1 {
            // A request stored earlier ends in this batch, between two submits.
            ops.push(WriteOp::UpdateRequest {
                id: format!("req_{prefix}_before"),
                status: RunStatus::Failed,
                output: Some("gave up".into()),
                error: Some(json!({ "code": "upstream" })),
                usage: None,
                at: step,
            });
        }
    }
    ops
}

async fn a_batch_of_many_submits_writes_what_one_op_at_a_time_writes(store: Arc<dyn Store>) {
    // Whole microseconds: what both stores keep.
    let at = chrono::SubsecRound::trunc_subsecs(Utc::now() - Age::seconds(1), 6);
    for prefix in ["one", "apart"] {
        store
            .apply(&[
                session(&format!("ses_{prefix}_before"), "alice", Age::zero()),
                request(
                    &format!("req_{prefix}_before"),
                    &format!("ses_{prefix}_before"),
                    "alice",
                    RunStatus::Running,
                    Age::zero(),
                ),
            ])
            .await
            .unwrap();
    }
    let numbers = store.apply(&submits("one", at)).await.unwrap();
    assert_eq!(
        numbers,
        vec![1, 1, 1],
        "each request's first event is its first"
    );
    for op in submits("apart", at) {
        store.apply(&[op]).await.unwrap();
    }

    // Everything each wrote, with its prefix taken out.
    async fn written(store: &Arc<dyn Store>, prefix: &str) -> String {
        let session = store.session(&format!("ses_{prefix}")).await.unwrap();
        let messages = store.messages(&format!("ses_{prefix}")).await.unwrap();
        let mut requests = Vec::new();
        for name in ["0", "1", "2", "before"] {
            let mut request = store
                .request(&format!("req_{prefix}_{name}"))
                .await
                .unwrap()
                .unwrap();
            // The earlier request's own times are taken at its insert.
            if name == "before" {
                request.created_at = chrono::DateTime::<Utc>::MIN_UTC;
            }
            requests.push(request);
        }
        let mut runs = Vec::new();
        for n in 0..3 {
            let mut run = store
                .run(&format!("run_{prefix}_{n}"))
                .await
                .unwrap()
                .unwrap();
            if let Some(lease) = &mut run.lease {
                lease.expires_at = chrono::DateTime::<Utc>::MIN_UTC;
            }
            runs.push(run);
        }
        format!("{session:?}\n{messages:?}\n{requests:?}\n{runs:?}")
            .replace(&format!("_{prefix}"), "_P")
    }
    let (one, apart) = (written(&store, "one").await, written(&store, "apart").await);
    assert_eq!(one, apart);

    // And what that is: the session as its first touch made it, moved by its last; the
    // messages chained in order; the earlier request ended; the runs leased and queued.
    let session = store.session("ses_one").await.unwrap().unwrap();
    assert_eq!(
        (session.agent_id.as_str(), &session.metadata),
        ("agent_0", &json!({ "touch": 0 }))
    );
    assert_eq!(session.created_at, at);
    assert_eq!(session.updated_at, at + Age::milliseconds(20));
    let messages = store.messages("ses_one").await.unwrap();
    let chain: Vec<_> = messages
        .iter()
        .map(|message| (message.id.as_str(), message.parent_id.as_deref()))
        .collect();
    assert_eq!(
        chain,
        [
            ("msg_one_0", None),
            ("msg_one_1", Some("msg_one_0")),
            ("msg_one_2", Some("msg_one_1")),
        ]
    );
    let before = store.request("req_one_before").await.unwrap().unwrap();
    assert_eq!(
        (before.status, before.output.as_deref()),
        (RunStatus::Failed, Some("gave up"))
    );
    for n in 0..3 {
        let run = store.run(&format!("run_one_{n}")).await.unwrap().unwrap();
        assert_eq!(run.status, RunStatus::Queued);
        assert!(run.lease.is_some(), "a queued run is leased to its writer");
        assert_eq!(last_seq(&store, &format!("req_one_{n}")).await, 1);
    }
}
