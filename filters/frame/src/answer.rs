//! The engine's answer to a body phase, as `worker.handle` and `worker.replay_refused` return it (built by
//! filters/worker.py; types in wsgate_frame.pyi). The frame reads it once, with the GIL held, into what Envoy gets:
//! the body's segments (one buffer, or a list of them) are kept by reference, not copied, until written into the
//! message to Envoy (wire.rs); so are the in-flight record and the replay check. `Body` is the other direction: a
//! received body lent to the engine as a read-only buffer over the frame's own bytes.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use std::ffi::{c_int, c_void};

use prost::bytes::Bytes;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::{ffi, PyTypeInfo};

use crate::replay::ReplayCheck;

#[pyclass(frozen, module = "wsgate_frame")]
pub struct Answer {
    /// None: pass the message on; else answer the client with this HTTP status (the message goes no further).
    #[pyo3(get)]
    status: Option<u32>,
    /// None: the message as it came (only when passed on); else a bytes-like object or a list of them, joined.
    #[pyo3(get)]
    body: Option<Py<PyAny>>,
    #[pyo3(get)]
    headers: Vec<(String, String)>,
    /// The worker's `InFlight`, opaque here: handed back with the exchange's next body phase.
    #[pyo3(get)]
    pub in_flight: Py<PyAny>,
    /// Keys to set in Redis before the answer goes out; a key already there turns it into a refusal.
    #[pyo3(get)]
    replay: Option<Py<ReplayCheck>>,
    /// No answer: the call was about to wait on the network where it may not, and must be made again on an engine
    /// thread (filters/engine/turn.py). Read by the frame only (`Answer.elsewhere` makes one).
    pub elsewhere: bool,
}

#[pymethods]
impl Answer {
    /// Pass the message on: `body` replaces it (None: unchanged), `headers` are set on it.
    #[staticmethod]
    #[pyo3(signature = (body, headers, in_flight, replay = None))]
    fn forward(
        body: Option<Py<PyAny>>,
        headers: Vec<(String, String)>,
        in_flight: Py<PyAny>,
        replay: Option<Py<ReplayCheck>>,
    ) -> Self {
        Answer { status: None, body, headers, in_flight, replay, elsewhere: false }
    }

    /// Answer the client with `status` and `body` (a fault, or a message the gateway answers itself).
    #[staticmethod]
    #[pyo3(signature = (status, body, headers, in_flight, replay = None))]
    fn reply(
        status: u32,
        body: Py<PyAny>,
        headers: Vec<(String, String)>,
        in_flight: Py<PyAny>,
        replay: Option<Py<ReplayCheck>>,
    ) -> PyResult<Self> {
        if !(200..=599).contains(&status) {
            return Err(PyValueError::new_err(format!("an answer's status must be 200-599, not {status}")));
        }
        Ok(Answer { status: Some(status), body: Some(body), headers, in_flight, replay, elsewhere: false })
    }

    /// No answer here: make the call again on an engine thread, where it may wait on the network; `in_flight` as
    /// it was given (nothing of this run is kept).
    #[staticmethod]
    fn elsewhere(in_flight: Py<PyAny>) -> Self {
        Answer { status: None, body: None, headers: Vec::new(), in_flight, replay: None, elsewhere: true }
    }
}

/// An answer as Envoy gets it, read out of the Python object once.
pub struct Reply {
    pub status: Option<u32>,
    pub body: Option<Vec<Bytes>>,
    pub headers: Vec<HeaderValueOption>,
}

impl Answer {
    pub fn read(&self, py: Python<'_>) -> PyResult<(Reply, Py<PyAny>, Option<Py<ReplayCheck>>)> {
        let body = match &self.body {
            None => None,
            Some(b) => Some(segments(b.bind(py))?),
        };
        let headers = self.headers.iter().map(|(k, v)| header(k, v)).collect();
        let reply = Reply { status: self.status, body, headers };
        Ok((reply, self.in_flight.clone_ref(py), self.replay.as_ref().map(|r| r.clone_ref(py))))
    }
}

/// A body's segments, each a read-only view of the Python object's memory kept alive (not copied) until HTTP/2 has
/// sent Envoy's message. A writable buffer (a bytearray the engine decrypted into) is copied: it could change after
/// it was measured.
fn segments(body: &Bound<'_, PyAny>) -> PyResult<Vec<Bytes>> {
    let one = |b: Bound<'_, PyAny>| -> PyResult<Bytes> {
        let buffer = PyBuffer::<u8>::get(&b)?;
        if !buffer.is_c_contiguous() {
            return Err(PyBufferError::new_err("an answer's body must be contiguous bytes"));
        }
        if !buffer.readonly() {
            return Ok(Bytes::from(buffer.to_vec(b.py())?));
        }
        Ok(Bytes::from_owner(Lent(buffer)))
    };
    if PyList::is_type_of(body) || PyTuple::is_type_of(body) {
        body.try_iter()?.map(|b| one(b?)).collect()
    } else {
        Ok(vec![one(body.clone())?])
    }
}

/// A Python buffer's bytes, readable without the GIL: the exporter is held and read-only (`segments`).
struct Lent(PyBuffer<u8>);

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        let len = self.0.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: a held, read-only, C-contiguous export of `len` bytes: valid and unchanged until released.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, len) }
    }
}

/// A received body as the engine reads it: `memoryview(body)`, a read-only view of the frame's bytes (a slice of
/// the message Envoy sent), never copied into a Python `bytes`.
#[pyclass(frozen, module = "wsgate_frame")]
pub struct Body(pub Bytes);

#[pymethods]
impl Body {
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let data = &slf.get().0;
        // Read-only: a request for a writable view fails (BufferError). The view holds `slf`, so the bytes live.
        let (ptr, len) = (data.as_ptr() as *mut c_void, data.len() as ffi::Py_ssize_t);
        if unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr, len, 1, flags) } == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.0.len()
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
