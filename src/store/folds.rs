//! A batch's updates of the runs and requests it inserts, folded into the inserts: both
//! stores write each such row once, as the updates would have left it.
//!
//! Why: the common request inserts its request and run and ends them in one batch. Written
//! as statements, each row went in twice, and every index that holds the status took an
//! entry in and out (SQLite's `runs_live`; on PostgreSQL an update of an indexed column is
//! a new row version in every index of the table).
//!
//! Only across ops that never read those rows: any other op (an approval, a tool call, which
//! check the run's lease) ends the folding, and later updates run as statements. An update
//! after the run's end is never folded: it must be refused as a statement would be (an ended
//! run holds no lease).

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{RequestRecord, RunRecord, RunStatus, WriteOp};
use crate::ids::IdMap;

/// A run's row as its insert writes it, with the batch's later updates of it folded in.
#[derive(Debug)]
pub(super) struct RunRow<'a> {
    pub status: RunStatus,
    pub state: Option<&'a Value>,
    pub error: Option<&'a Value>,
    pub updated_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub ended_at: Option<DateTime<Utc>>,
    /// Whether the row keeps its lease (a run that ended holds none).
    pub leased: bool,
}

impl<'a> RunRow<'a> {
    pub fn inserted(run: &'a RunRecord) -> Self {
        Self {
            status: run.status,
            state: run.state.as_ref(),
            error: run.error.as_ref(),
            updated_at: run.updated_at,
            started_at: run.started_at,
            ended_at: run.ended_at,
            leased: true,
        }
    }

    /// What an `UpdateRun` does to the row (its lease condition holds: the row was inserted
    /// by this batch, and a run that ended takes no more folded updates).
    fn update(
        &mut self,
        status: RunStatus,
        error: &'a Option<Value>,
        state: &'a Option<Value>,
        at: DateTime<Utc>,
    ) {
        self.status = status;
        if let Some(error) = error {
            self.error = Some(error);
        }
        if status.is_terminal() {
            self.state = None;
            self.ended_at = Some(at);
            self.leased = false;
        } else {
            if let Some(state) = state {
                self.state = Some(state);
            }
            if status == RunStatus::Running && self.started_at.is_none() {
                self.started_at = Some(at);
            }
        }
        self.updated_at = at;
    }
}

/// A request's row as its insert writes it, with the batch's later updates of it folded in.
#[derive(Debug)]
pub(super) struct RequestRow<'a> {
    pub status: RunStatus,
    pub output: Option<&'a str>,
    pub error: Option<&'a Value>,
    pub usage: Option<&'a Value>,
    pub updated_at: DateTime<Utc>,
}

impl<'a> RequestRow<'a> {
    pub fn inserted(request: &'a RequestRecord) -> Self {
        Self {
            status: request.status,
            output: request.output.as_deref(),
            error: request.error.as_ref(),
            usage: request.usage.as_ref(),
            updated_at: request.updated_at,
        }
    }

    /// What an `UpdateRequest` does to the row.
    fn update(
        &mut self,
        status: RunStatus,
        output: &'a Option<String>,
        error: &'a Option<Value>,
        usage: &'a Option<Value>,
        at: DateTime<Utc>,
    ) {
        self.status = status;
        if let Some(output) = output {
            self.output = Some(output);
        }
        self.error = error.as_ref();
        if let Some(usage) = usage {
            self.usage = Some(usage);
        }
        self.updated_at = at;
    }
}

/// Which updates of a batch fold into which of its inserts (see the module's doc).
#[derive(Debug, Default)]
pub(super) struct Folds<'a> {
    /// By the index of the run's insert.
    runs: IdMap<usize, RunRow<'a>>,
    /// By the index of the request's insert.
    requests: IdMap<usize, RequestRow<'a>>,
    /// Updates already folded into an insert, by index.
    folded: Vec<usize>,
}

impl<'a> Folds<'a> {
    pub fn plan(ops: &'a [WriteOp]) -> Self {
        let mut folds = Folds::default();
        // Rows inserted by this batch that later updates may still fold into, by id.
        let mut runs: IdMap<&str, (usize, &RunRecord)> = IdMap::default();
        let mut requests: IdMap<&str, (usize, &RequestRecord)> = IdMap::default();
        for (index, op) in ops.iter().enumerate() {
            match op {
                WriteOp::InsertRun(run) => {
                    runs.insert(&run.id, (index, run));
                }
                WriteOp::InsertRequest(request) => {
                    requests.insert(&request.id, (index, request));
                }
                WriteOp::UpdateRun {
                    id,
                    status,
                    error,
                    state,
                    at,
                } => {
                    if let Some(&(insert, run)) = runs.get(id.as_str()) {
                        folds
                            .runs
                            .entry(insert)
                            .or_insert_with(|| RunRow::inserted(run))
                            .update(*status, error, state, *at);
                        folds.folded.push(index);
                        // An ended run holds no lease: a later update of it must fail as a
                        // statement would.
                        if status.is_terminal() {
                            runs.remove(id.as_str());
                        }
                    }
                }
                WriteOp::UpdateRequest {
                    id,
                    status,
                    output,
                    error,
                    usage,
                    at,
                } => {
                    if let Some(&(insert, request)) = requests.get(id.as_str()) {
                        folds
                            .requests
                            .entry(insert)
                            .or_insert_with(|| RequestRow::inserted(request))
                            .update(*status, output, error, usage, *at);
                        folds.folded.push(index);
                    }
                }
                WriteOp::TouchSession(_) | WriteOp::InsertMessage(_) | WriteOp::AppendEvent(_) => {}
                _ => {
                    runs.clear();
                    requests.clear();
                }
            }
        }
        folds
    }

    /// Whether the op at `index` was folded into an earlier insert.
    pub fn is_folded(&self, index: usize) -> bool {
        // Pushed in the order of the ops: sorted.
        self.folded.binary_search(&index).is_ok()
    }

    /// The row the run inserted at `index` is written as, when updates fold into it.
    pub fn take_run(&mut self, index: usize) -> Option<RunRow<'a>> {
        self.runs.remove(&index)
    }

    /// The row the request inserted at `index` is written as, when updates fold into it.
    pub fn take_request(&mut self, index: usize) -> Option<RequestRow<'a>> {
        self.requests.remove(&index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ApprovalDecision, test_records};

    fn insert_run(id: &str) -> WriteOp {
        let mut run = test_records::run(id, "req");
        run.started_at = Some(run.created_at);
        WriteOp::InsertRun(run)
    }

    fn insert_request(id: &str) -> WriteOp {
        WriteOp::InsertRequest(test_records::request(id, "ses"))
    }

    fn end_run(id: &str) -> WriteOp {
        WriteOp::UpdateRun {
            id: id.into(),
            status: RunStatus::Completed,
            error: None,
            state: None,
            at: Utc::now(),
        }
    }

    fn end_request(id: &str) -> WriteOp {
        WriteOp::UpdateRequest {
            id: id.into(),
            status: RunStatus::Completed,
            output: Some("done".into()),
            error: None,
            usage: None,
            at: Utc::now(),
        }
    }

    #[test]
    fn a_batch_folds_the_updates_of_rows_it_inserts_and_no_others() {
        let approval_decided = WriteOp::DecideApproval(ApprovalDecision {
            id: "apr".into(),
            status: crate::store::ApprovalStatus::Approved,
            reason: None,
            decided_by: "op".into(),
            at: Utc::now(),
        });
        let ops = [
            insert_request("req"), // 0
            insert_run("run"),     // 1
            end_run("run"),        // 2: folded into 1
            end_request("req"),    // 3: folded into 0
            end_run("run"),        // 4: after the end: runs as a statement
            end_run("elsewhere"),  // 5: not inserted here
            insert_run("run_b"),   // 6
            approval_decided,      // 7: reads rows: folding stops
            end_run("run_b"),      // 8
        ];
        let mut folds = Folds::plan(&ops);
        assert_eq!(folds.folded, [2, 3]);
        assert!((0..ops.len()).all(|i| folds.is_folded(i) == (i == 2 || i == 3)));
        let run = folds.take_run(1).expect("the run's row");
        assert_eq!(
            (run.status, run.leased, run.state),
            (RunStatus::Completed, false, None)
        );
        assert!(run.ended_at.is_some());
        let request = folds.take_request(0).expect("the request's row");
        assert_eq!(
            (request.status, request.output),
            (RunStatus::Completed, Some("done"))
        );
        assert!(folds.take_run(6).is_none());
    }
}
