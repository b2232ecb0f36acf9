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
use pyo3::types::{PyByteArray, PyList, PyTuple};
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
    /// The answer as Envoy gets it; `answer` is the engine's return value, whose only reference (when Python kept
    /// none) is the caller's.
    pub fn read(answer: &Bound<'_, Answer>) -> PyResult<(Reply, Py<PyAny>, Option<Py<ReplayCheck>>)> {
        let (py, this) = (answer.py(), answer.get());
        let body = match &this.body {
            None => None,
            Some(b) => Some(segments(b.bind(py), refs(answer.as_any()) == 1)?),
        };
        let headers = this.headers.iter().map(|(k, v)| header(k, v)).collect();
        let reply = Reply { status: this.status, body, headers };
        Ok((reply, this.in_flight.clone_ref(py), this.replay.as_ref().map(|r| r.clone_ref(py))))
    }
}

/// A body's segments, each a view of the Python object's memory kept alive (not copied) until HTTP/2 has sent
/// Envoy's message: a read-only buffer, or a bytearray (the engine decrypted or encrypted into it) that nothing but
/// the answer reaches (`answer_alone`, and the body and the bytearray referenced only by their container): once
/// exported it cannot be resized, and no Python code holds it to write into it. A writable buffer anything else
/// may reach is copied: it could change after it was measured, while HTTP/2 reads it.
fn segments(body: &Bound<'_, PyAny>, answer_alone: bool) -> PyResult<Vec<Bytes>> {
    let body_alone = answer_alone && refs(body) == 1; // the answer's field
    let one = |b: Bound<'_, PyAny>| -> PyResult<Bytes> {
        // its container's slot (the list's, or the answer's field) and `b` here
        let alone = body_alone && refs(&b) == 2 && b.is_exact_instance_of::<PyByteArray>();
        let buffer = PyBuffer::<u8>::get(&b)?;
        if !buffer.is_c_contiguous() {
            return Err(PyBufferError::new_err("an answer's body must be contiguous bytes"));
        }
        if !buffer.readonly() && !alone {
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

/// How many references hold `obj` (the GIL held: none comes or goes meanwhile).
fn refs(obj: &Bound<'_, PyAny>) -> isize {
    // SAFETY: a live object, the GIL held.
    unsafe { ffi::Py_REFCNT(obj.as_ptr()) }
}

/// A Python buffer's bytes, readable without the GIL: the exporter is held, and read-only or reached by nothing
/// else (`segments`).
struct Lent(PyBuffer<u8>);

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        let len = self.0.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: a held C-contiguous export of `len` bytes, read-only or of a bytearray nothing else reaches:
        // valid and unchanged until released.
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

#[cfg(test)]
mod tests {
    use super::*;
    use pyo3::types::PyDict;

    /// The body segment read from an answer built of `code`'s `body` (taken out of its namespace), and whether it
    /// is the memory of `code`'s `target` (lent) rather than a copy; then `kept`, if any, is changed in place.
    fn read(py: Python<'_>, code: &std::ffi::CStr, keep_answer: bool, keep_list: bool) -> (bool, Bytes) {
        let ns = PyDict::new(py);
        py.run(code, Some(&ns), None).unwrap();
        let target = ns.get_item("target").unwrap().unwrap();
        let target_ptr = PyBuffer::<u8>::get(&target).unwrap().buf_ptr() as *const u8;
        drop(target);
        let list = ns.get_item("body").unwrap().unwrap();
        ns.del_item("body").unwrap();
        if !keep_list {
            ns.del_item("target").unwrap(); // only the list holds it now, unless the code kept it elsewhere
        }
        let kept_list = keep_list.then(|| list.clone());
        let answer = Bound::new(py, Answer::forward(Some(list.unbind()), vec![], py.None(), None)).unwrap();
        let kept_answer = keep_answer.then(|| answer.clone());
        let (reply, _, _) = Answer::read(&answer).unwrap();
        let segment = reply.body.unwrap().remove(0);
        let lent = segment.as_ptr() == target_ptr;
        // What the engine may do next with whatever it kept: change it in place.
        py.run(c"kept[:4] = b'XXXX' if kept is not None else b''", Some(&ns), None).ok();
        drop((kept_list, kept_answer, answer));
        (lent, segment)
    }

    #[test]
    fn a_bytearray_is_lent_only_when_nothing_but_the_answer_reaches_it_else_a_later_change_cannot_leak() {
        Python::initialize();
        Python::attach(|py| {
            let original = vec![b'a'; 100_000];
            // The engine's usual answer: a bytearray it made and let go of. Lent, no copy.
            let (lent, got) =
                read(py, c"kept = None\ntarget = bytearray(b'a' * 100000)\nbody = [target]", false, false);
            assert!(lent && got.as_ref() == original.as_slice());
            // Anything else holding it: the bytearray itself, its list, the answer. Copied, and a change made
            // after the read does not reach what Envoy gets.
            let code = c"target = bytearray(b'a' * 100000)\nkept = target\nbody = [target]";
            let (lent, got) = read(py, code, false, false);
            assert!(!lent && got.as_ref() == original.as_slice(), "the engine kept the bytearray");
            for (keep_answer, keep_list) in [(true, false), (false, true)] {
                let code = c"kept = None\ntarget = bytearray(b'a' * 100000)\nbody = [target]";
                let (lent, got) = read(py, code, keep_answer, keep_list);
                assert!(!lent && got.as_ref() == original.as_slice(), "{keep_answer} {keep_list}");
            }
            // A bytearray subclass, or a writable memoryview of one: copied whatever holds them.
            let code = c"class B(bytearray): pass\nkept = None\ntarget = B(b'a' * 100000)\nbody = [target]";
            assert!(!read(py, code, false, false).0);
            let code = c"kept = None\ntarget = memoryview(bytearray(b'a' * 100000))\nbody = [target]";
            assert!(!read(py, code, false, false).0);
            // Read-only bytes are lent whoever holds them.
            let code = c"target = b'a' * 100000\nkept = None\nbody = [target]";
            assert!(read(py, code, true, true).0);
        });
    }
}
