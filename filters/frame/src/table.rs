//! What the Python side installs at start and on every reload: a `Table` of the XML routes' limits and the
//! headers the gateway vouches for, and the fault bodies the frame answers with (rendered by filters/engine/faults.py, so
//! Rust only copies bytes). Python builds it from these classes (filters/worker.py; types in wsgate_frame.pyi);
//! the frame copies it once per start or reload, never per exchange.

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
    Trailers,
}

impl Refusal {
    pub const ALL: [Refusal; 9] = [
        Refusal::Method,
        Refusal::NoBody,
        Refusal::TooLarge,
        Refusal::BadLength,
        Refusal::ResponseTooLarge,
        Refusal::Busy,
        Refusal::NoRoute,
        Refusal::Internal,
        Refusal::Trailers,
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
            Refusal::Trailers => "trailers",
        }
    }
}

/// One XML route's limits, as the frame checks them before any body arrives.
#[pyclass(frozen, get_all, from_py_object, module = "wsgate_frame")]
#[derive(Clone, Debug)]
pub struct Route {
    pub max_request_bytes: u64,
    pub max_response_bytes: u64,
    /// Set by the gateway for the backend, so never taken from a client (besides every `x-wsgate-*` header).
    pub identity_header: Option<String>,
    /// The engine's calls may wait on the network (a partner's STS, an OCSP responder): they go to the engine
    /// threads (threads.rs); every other route's call is made on the gRPC thread, with no handoff.
    pub waits_on_network: bool,
    /// Envoy streams the bodies both ways (ext_proc `FULL_DUPLEX_STREAMED`, routes taking attachments:
    /// gateway/control/envoy_config.py): the frame holds the chunks until the last, and answers the held headers,
    /// then the body in chunks, only once the engine has passed the whole message.
    pub streamed: bool,
}

#[pymethods]
impl Route {
    #[new]
    #[pyo3(signature = (
        *, max_request_bytes, max_response_bytes, identity_header = None, waits_on_network = false, streamed = false
    ))]
    fn new(
        max_request_bytes: u64,
        max_response_bytes: u64,
        identity_header: Option<String>,
        waits_on_network: bool,
        streamed: bool,
    ) -> Self {
        // HTTP header names match whatever their case: the frame compares lowercase.
        let identity_header = identity_header.map(|h| h.to_ascii_lowercase());
        Route { max_request_bytes, max_response_bytes, identity_header, waits_on_network, streamed }
    }
}

/// One fault as the client gets it: status, then content type and body for SOAP 1.1 and for SOAP 1.2.
#[pyclass(frozen, from_py_object, module = "wsgate_frame")]
#[derive(Clone)]
pub struct RenderedFault {
    pub status: u32,
    pub bodies: [(String, Vec<u8>); 2],
}

#[pymethods]
impl RenderedFault {
    #[new]
    fn new(status: u32, soap11: (String, Vec<u8>), soap12: (String, Vec<u8>)) -> Self {
        RenderedFault { status, bodies: [soap11, soap12] }
    }
}

/// The frame's table: the XML routes by name and a rendered fault for every refusal (named as `Refusal::name`).
#[pyclass(frozen, module = "wsgate_frame")]
#[derive(Clone)]
pub struct Table {
    pub routes: HashMap<String, Route>,
    faults: Vec<RenderedFault>, // in the order of Refusal::ALL
}

#[pymethods]
impl Table {
    /// Refused unless `faults` names every refusal and nothing else: a table the frame cannot answer from
    /// fails when it is built (at start, or a reload keeps the running one), not on some later exchange.
    #[new]
    pub fn new(routes: HashMap<String, Route>, mut faults: HashMap<String, RenderedFault>) -> PyResult<Table> {
        let ordered = Refusal::ALL
            .iter()
            .map(|r| {
                faults
                    .remove(r.name())
                    .ok_or_else(|| PyValueError::new_err(format!("no fault for refusal {}", r.name())))
            })
            .collect::<PyResult<Vec<_>>>()?;
        if let Some(unknown) = faults.keys().next() {
            return Err(PyValueError::new_err(format!("a fault for {unknown:?}, which is no refusal of the frame")));
        }
        Ok(Table { routes, faults: ordered })
    }
}

impl Table {
    pub fn fault(&self, refusal: Refusal) -> &RenderedFault {
        &self.faults[refusal as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn faults(names: &[&str]) -> HashMap<String, RenderedFault> {
        let fault =
            |n: &str| RenderedFault::new(500, ("text/xml".into(), n.into()), ("application/soap+xml".into(), n.into()));
        names.iter().map(|n| (n.to_string(), fault(n))).collect()
    }

    fn every_refusal() -> Vec<&'static str> {
        Refusal::ALL.iter().map(|r| r.name()).collect()
    }

    #[test]
    fn each_refusal_is_answered_with_its_own_fault() {
        let table = Table::new(HashMap::new(), faults(&every_refusal())).unwrap();
        for refusal in Refusal::ALL {
            assert_eq!(table.fault(refusal).bodies[1].1, refusal.name().as_bytes());
        }
    }

    #[test]
    fn a_table_missing_a_fault_or_naming_an_unknown_refusal_is_refused() {
        let mut names = every_refusal();
        names.pop();
        assert!(Table::new(HashMap::new(), faults(&names)).is_err());
        let mut names = every_refusal();
        names.push("teapot");
        assert!(Table::new(HashMap::new(), faults(&names)).is_err());
    }

    #[test]
    fn an_identity_header_is_matched_whatever_its_case() {
        let route = Route::new(1, 2, Some("X-User".into()), false, false);
        assert_eq!(route.identity_header.as_deref(), Some("x-user"));
    }
}
