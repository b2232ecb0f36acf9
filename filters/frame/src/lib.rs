//! wsgate_frame: the ext_proc frame of a WSGate filter worker, a Python extension module.
//!
//! `serve` runs Envoy's `ExternalProcessor` gRPC service on a single-threaded tokio runtime driven on the calling
//! (the worker's main) thread with the GIL released. It re-takes the GIL once per body phase for the one call into
//! the engine (`handle`); a call about to wait on the network (an outbound secureconversation Issue) answers
//! `elsewhere` instead and is made again on one of the engine's threads (threads.rs) while this thread serves the
//! other exchanges, as are at once the calls of routes whose waits cannot be redone (OCSP); and per refusal
//! (`refused`, and `replay_refused` when the replay check the frame makes for the engine refuses: replay.rs), on
//! SIGHUP (`reload`) and once ready and after each reload (`ready`).
//! SIGTERM or SIGINT stop it gracefully: no new exchanges, in-flight ones get `grace_seconds`.
//!
//! The contract with the worker (filters/worker.py) is typed: the classes here (`Table` with its `Route`s and
//! `RenderedFault`s, `Answer`, `ReplayCheck`, `ReplayOutcome`), typed for Python in wsgate_frame.pyi. Its words,
//! one meaning each across Rust and Python: an *exchange* is one HTTP request with its response (the frame takes
//! it through its phases on one ext_proc `Stream`; the engine's record of it is `filters.engine.pipeline.Exchange`); an
//! exchange *in flight* is between its request body and its response body, and the worker's `InFlight` is what
//! it keeps of it then (opaque here, handed back with the next body phase).

mod answer;
mod budget;
mod counters;
mod replay;
mod service;
mod table;
mod threads;
mod wire;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::signal::unix::{signal, SignalKind};
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use answer::{Answer, Body};
use replay::{ReplayCheck, ReplayOutcome, Stores};
use service::{Frame, Shared, BUDGET};
use table::{RenderedFault, Route, Table};
use threads::EngineThreads;
use wire::ExtProc;

// Envoy may send a whole body in one message: allow it a large window rather than many round trips.
const STREAM_WINDOW: u32 = 8 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 32 * 1024 * 1024;

/// Serve until SIGTERM or SIGINT. `table` is what `worker.reload()` returns too, or None (see table.rs).
#[pyfunction]
#[pyo3(signature = (worker, listen, table, budget_bytes, max_message_bytes, grace_seconds = 5.0))]
fn serve(
    py: Python<'_>,
    worker: Py<PyAny>,
    listen: &str,
    table: &Bound<'_, Table>,
    budget_bytes: u64,
    max_message_bytes: usize,
    grace_seconds: f64,
) -> PyResult<()> {
    let addr: SocketAddr = listen.parse().map_err(|e| PyValueError::new_err(format!("listen {listen:?}: {e}")))?;
    let table = table.get().clone();
    BUDGET.set_limit(budget_bytes);
    let handle = worker.getattr(py, "handle")?;
    let engine = EngineThreads::start().map_err(|e| PyOSError::new_err(format!("engine threads: {e}")))?;
    let replay = Stores::default();
    let shared = Arc::new(Shared { table: Mutex::new(Arc::new(table)), worker, handle, replay, engine });
    let grace = Duration::from_secs_f64(grace_seconds);
    py.detach(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(run(shared, addr, max_message_bytes, grace))
    })
    .map_err(|e: std::io::Error| PyOSError::new_err(e.to_string()))
}

async fn run(shared: Arc<Shared>, addr: SocketAddr, max_message_bytes: usize, grace: Duration) -> std::io::Result<()> {
    let incoming = TcpIncoming::bind(addr)
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))?
        .with_nodelay(Some(true));
    // Installed before the worker says it is ready: a SIGHUP must never find the default action (exit).
    let mut hangup = signal(SignalKind::hangup())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let service = ExtProc::new(Frame(shared.clone()), max_message_bytes);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = Server::builder()
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stopped.await;
        });
    tokio::pin!(server);
    Python::attach(|py| shared.worker.call_method0(py, "ready").map(drop)).map_err(std::io::Error::other)?;
    loop {
        tokio::select! {
            done = &mut server => return done.map_err(std::io::Error::other),
            _ = hangup.recv() => reload(&shared),
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
        }
    }
    let _ = stop.send(());
    // In-flight exchanges finish (new streams are refused); past the grace they are cut, as Envoy fails closed.
    match tokio::time::timeout(grace, server).await {
        Ok(done) => done.map_err(std::io::Error::other),
        Err(_) => Ok(()),
    }
}

/// SIGHUP: the worker reloads its policies and returns the new table, or None to keep the running one; then `ready`.
fn reload(shared: &Shared) {
    Python::attach(|py| {
        let table = shared.worker.call_method0(py, "reload").and_then(|t| {
            if t.is_none(py) {
                Ok(None)
            } else {
                Ok(Some(t.bind(py).cast::<Table>()?.get().clone()))
            }
        });
        match table {
            Ok(Some(table)) => shared.install(table),
            Ok(None) => {}
            Err(err) => err.display(py),
        }
        // Taken or refused, the reload is over: the worker says so (the supervisor waits for it).
        if let Err(err) = shared.worker.call_method0(py, "ready") {
            err.display(py);
        }
    });
}

/// The frame's counters and the body budget, for the worker's Prometheus collector.
#[pyfunction]
#[pyo3(name = "counters")]
fn read_counters(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    use std::sync::atomic::Ordering::Relaxed;
    let d = PyDict::new(py);
    d.set_item("streams", counters::STREAMS.load(Relaxed))?;
    d.set_item("streams_active", counters::STREAMS_ACTIVE.load(Relaxed))?;
    d.set_item("body_bytes_in_flight", BUDGET.in_flight())?;
    d.set_item("body_budget_bytes", BUDGET.limit())?;
    d.set_item("phases", counters::phases())?;
    d.set_item("refusals", counters::refusals())?;
    d.set_item("replay_checks", counters::replay_outcomes())?;
    Ok(d)
}

#[pymodule]
fn wsgate_frame(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add_function(wrap_pyfunction!(read_counters, m)?)?;
    m.add_class::<Table>()?;
    m.add_class::<Route>()?;
    m.add_class::<RenderedFault>()?;
    m.add_class::<Answer>()?;
    m.add_class::<Body>()?;
    m.add_class::<ReplayCheck>()?;
    m.add_class::<ReplayOutcome>()?;
    Ok(())
}
