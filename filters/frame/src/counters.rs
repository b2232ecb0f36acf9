//! The frame's own counters, read by the worker's Prometheus collector (filters/worker.py) from another thread.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::table::Refusal;

#[derive(Clone, Copy)]
pub enum Phase {
    RequestHeaders,
    RequestBody,
    ResponseHeaders,
    ResponseBody,
    Trailers,
}

pub const PHASES: [&str; 5] = ["request_headers", "request_body", "response_headers", "response_body", "trailers"];

/// What became of a phase: answered in Rust (`passed`, `refused`), handed to the engine (`engine`), or the call
/// into the engine failed (`error`: answered with a generic fault). `moved`: besides, a call on the gRPC thread
/// that was about to wait on the network and was made again on an engine thread (none at steady state).
#[derive(Clone, Copy)]
pub enum Outcome {
    Passed,
    Refused,
    Engine,
    Error,
    Moved,
}

pub const OUTCOMES: [&str; 5] = ["passed", "refused", "engine", "error", "moved"];

pub static STREAMS: AtomicU64 = AtomicU64::new(0);
pub static STREAMS_ACTIVE: AtomicU64 = AtomicU64::new(0);
static PHASE_COUNTS: [[AtomicU64; 5]; 5] = [const { [const { AtomicU64::new(0) }; 5] }; 5];
static REFUSALS: [AtomicU64; Refusal::ALL.len()] = [const { AtomicU64::new(0) }; Refusal::ALL.len()];

/// What the replay checks made for the engine found (replay.rs, `ReplayOutcome`): every key new, one seen before,
/// the message older than the store's epoch, no answer.
pub const REPLAY_OUTCOMES: [&str; 4] = ["first", "replayed", "before_epoch", "unavailable"];
static REPLAY_OUTCOME_COUNTS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

pub fn phase(phase: Phase, outcome: Outcome) {
    PHASE_COUNTS[phase as usize][outcome as usize].fetch_add(1, Relaxed);
}

pub fn refusal(refusal: Refusal) {
    REFUSALS[refusal as usize].fetch_add(1, Relaxed);
}

pub fn replay_outcome(index: usize) {
    REPLAY_OUTCOME_COUNTS[index].fetch_add(1, Relaxed);
}

pub fn replay_outcomes() -> Vec<(&'static str, u64)> {
    REPLAY_OUTCOMES.iter().zip(&REPLAY_OUTCOME_COUNTS).map(|(name, n)| (*name, n.load(Relaxed))).collect()
}

pub fn phases() -> Vec<(&'static str, &'static str, u64)> {
    let mut out = Vec::new();
    for (p, row) in PHASE_COUNTS.iter().enumerate() {
        for (o, n) in row.iter().enumerate() {
            out.push((PHASES[p], OUTCOMES[o], n.load(Relaxed)));
        }
    }
    out
}

pub fn refusals() -> Vec<(&'static str, u64)> {
    Refusal::ALL.iter().map(|r| (r.name(), REFUSALS[*r as usize].load(Relaxed))).collect()
}
