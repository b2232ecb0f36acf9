//! The engine's threads: the calls into the engine (`worker.handle`) that wait on the network (a partner's STS, an
//! OCSP responder) are made here, off the gRPC thread, so that they hold up no other exchange's gRPC: a call the
//! gRPC thread began answers `elsewhere` before its wait and is made again here (service.rs).
//!
//! A fixed number of threads (`ENGINE_THREADS`), started with the frame: calls beyond them wait in order for a
//! free one, so a flood of slow calls costs no more threads. Python runs one call at a time anyway (the GIL,
//! and the engine's turn, filters/engine/turn.py, which a call gives up only while it waits on the network): the
//! threads are for waits, and the bound is how many calls may wait on the network at once before the others
//! queue behind them (each such wait ends within its own timeout, 2 s for an STS). Each thread keeps its Python
//! thread state for its life (a call does not create one, nor lose lxml's per-thread parser dictionary).

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

/// Engine calls that may be under way at once (most waiting on the network: one computes at a time).
pub const ENGINE_THREADS: usize = 8;

type Job = Box<dyn for<'py> FnOnce(Python<'py>) + Send>;

pub struct EngineThreads {
    jobs: Sender<Job>,
}

impl EngineThreads {
    /// Start the threads; they end when this is dropped, each once its call is done.
    pub fn start() -> std::io::Result<Self> {
        let (jobs, queue) = channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..ENGINE_THREADS {
            let queue = queue.clone();
            std::thread::Builder::new().name(format!("wsgate-engine-{i}")).spawn(move || serve(&queue))?;
        }
        Ok(EngineThreads { jobs })
    }

    /// Run `call` with the GIL on an engine thread; None if no thread is left to run it (the frame is stopping).
    pub async fn run<T: Send + 'static>(
        &self,
        call: impl for<'py> FnOnce(Python<'py>) -> T + Send + 'static,
    ) -> Option<T> {
        let (done, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |py| {
            let _ = done.send(call(py)); // the exchange may be gone (Envoy reset it): its result is dropped
        });
        self.jobs.send(job).ok()?;
        result.await.ok()
    }
}

/// One engine thread: attached to Python for its life (its thread state is kept), the GIL taken per call only.
fn serve(queue: &Mutex<Receiver<Job>>) {
    Python::attach(|py| {
        py.detach(|| loop {
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
            let Ok(job) = next else { return }; // the frame stopped
            Python::attach(job);
        })
    })
}
