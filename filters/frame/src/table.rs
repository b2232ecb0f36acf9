//! What the Python side installs at start and on every reload: the XML routes' limits and the headers the gateway
//! vouches for, and the fault bodies the frame answers with (rendered by filters/engine/faults.py, so Rust only copies
//! bytes).

use std::collections::HashMap;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Why the frame refuses an exchange itself. A fixed set: they label metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    Method,
    NoBody,
    TooLarge,
    BadLength,
    ResponseTooLarge,
    Busy,
    NoRoute,
    Internal,
}

impl Refusal {
    pub const ALL: [Refusal; 8] = [
        Refusal::Method,
        Refusal::NoBody,
        Refusal::TooLarge,
        Refusal::BadLength,
        Refusal::ResponseTooLarge,
        Refusal::Busy,
        Refusal::NoRoute,
        Refusal::Internal,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Refusal::Method => "method",
            Refusal::NoBody => "no_body",
            Refusal::TooLarge => "too_large",
            Refusal::BadLength => "bad_length",
            Refusal::ResponseTooLarge => "response_too_large",
            Refusal::Busy => "busy",
            Refusal::NoRoute => "no_route",
            Refusal::Internal => "internal",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Route {
    pub max_request_bytes: u64,
    pub max_response_bytes: u64,
    /// Set by the gateway for the backend, so never taken from a client (besides every `x-wsgate-*` header).
    pub identity_header: Option<String>,
}

/// One fault as the client gets it: status, then content type and body for SOAP 1.1 and for SOAP 1.2.
pub struct Fault {
    pub status: u32,
    pub bodies: [(String, Vec<u8>); 2],
}

pub struct Table {
    pub routes: HashMap<String, Route>,
    faults: Vec<Fault>, // in the order of Refusal::ALL
}

type PyRoute = (u64, u64, Option<String>);
type PyFault = (u32, String, Vec<u8>, String, Vec<u8>);

impl Table {
    /// From `(routes, faults)`: `{name: (max request bytes, max response bytes, identity header)}` and
    /// `{refusal name: (status, content type 1.1, body 1.1, content type 1.2, body 1.2)}` with every refusal.
    pub fn from_py(obj: &Bound<'_, PyAny>) -> PyResult<Table> {
        let (routes, mut faults): (HashMap<String, PyRoute>, HashMap<String, PyFault>) = obj.extract()?;
        let routes = routes
            .into_iter()
            .map(|(name, (req, resp, identity))| {
                let route = Route {
                    max_request_bytes: req,
                    max_response_bytes: resp,
                    identity_header: identity.map(|h| h.to_ascii_lowercase()),
                };
                (name, route)
            })
            .collect();
        let faults = Refusal::ALL
            .iter()
            .map(|r| {
                let (status, ct11, b11, ct12, b12) = faults
                    .remove(r.name())
                    .ok_or_else(|| PyValueError::new_err(format!("no fault for refusal {}", r.name())))?;
                Ok(Fault { status, bodies: [(ct11, b11), (ct12, b12)] })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Table { routes, faults })
    }

    pub fn fault(&self, refusal: Refusal) -> &Fault {
        &self.faults[refusal as usize]
    }
}
