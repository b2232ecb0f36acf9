//! The engine's answer to a body phase, as `worker.handle` and `worker.replay_refused` return it (built by
//! filters/worker.py; types in wsgate_frame.pyi). The frame reads it once, with the GIL held, into what Envoy gets:
//! the body is copied once (as a tuple's bytes were), the in-flight record and the replay check are kept by
//! reference.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::replay::ReplayCheck;

#[pyclass(frozen, module = "wsgate_frame")]
pub struct Answer {
    /// None: pass the message on; else answer the client with this HTTP status (the message goes no further).
    #[pyo3(get)]
    status: Option<u32>,
    /// None: the message as it came (only when passed on).
    #[pyo3(get)]
    body: Option<Py<PyBytes>>,
    #[pyo3(get)]
    headers: Vec<(String, String)>,
    /// The worker's `InFlight`, opaque here: handed back with the exchange's next body phase.
    #[pyo3(get)]
    in_flight: Py<PyAny>,
    /// Keys to set in Redis before the answer goes out; a key already there turns it into a refusal.
    #[pyo3(get)]
    replay: Option<Py<ReplayCheck>>,
}

#[pymethods]
impl Answer {
    /// Pass the message on: `body` replaces it (None: unchanged), `headers` are set on it.
    #[staticmethod]
    #[pyo3(signature = (body, headers, in_flight, replay = None))]
    fn forward(
        body: Option<Py<PyBytes>>,
        headers: Vec<(String, String)>,
        in_flight: Py<PyAny>,
        replay: Option<Py<ReplayCheck>>,
    ) -> Self {
        Answer { status: None, body, headers, in_flight, replay }
    }

    /// Answer the client with `status` and `body` (a fault, or a message the gateway answers itself).
    #[staticmethod]
    #[pyo3(signature = (status, body, headers, in_flight, replay = None))]
    fn reply(
        status: u32,
        body: Py<PyBytes>,
        headers: Vec<(String, String)>,
        in_flight: Py<PyAny>,
        replay: Option<Py<ReplayCheck>>,
    ) -> PyResult<Self> {
        if !(200..=599).contains(&status) {
            return Err(PyValueError::new_err(format!("an answer's status must be 200-599, not {status}")));
        }
        Ok(Answer { status: Some(status), body: Some(body), headers, in_flight, replay })
    }
}

/// An answer as Envoy gets it, read out of the Python object once.
pub struct Reply {
    pub status: Option<u32>,
    pub body: Option<Vec<u8>>,
    pub headers: Vec<HeaderValueOption>,
}

impl Answer {
    pub fn read(&self, py: Python<'_>) -> (Reply, Py<PyAny>, Option<Py<ReplayCheck>>) {
        let reply = Reply {
            status: self.status,
            body: self.body.as_ref().map(|b| b.as_bytes(py).to_vec()),
            headers: self.headers.iter().map(|(k, v)| header(k, v)).collect(),
        };
        (reply, self.in_flight.clone_ref(py), self.replay.as_ref().map(|r| r.clone_ref(py)))
    }
}

/// One header for Envoy to set, replacing any of the same name.
pub fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.into(), raw_value: value.as_bytes().to_vec(), ..Default::default() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}
