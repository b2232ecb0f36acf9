//! The ext_proc service: one gRPC stream per HTTP exchange (`Stream`). Header phases are answered here from the
//! route table; each body phase is one call into the Python engine (`worker.handle`, which returns an `Answer`:
//! answer.rs), made on this thread; a call about to wait on the network answers `elsewhere` instead and is made
//! again on one of the engine's threads (threads.rs), with the stream handed over for the call while this thread
//! serves the other exchanges (at once for a route whose waits may come after what a second run cannot redo).
//! Bodies travel without copies (wire.rs): the engine reads the received bytes through a `Body` and answers with
//! segments handed to HTTP/2 as they are.

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::config::core::v3::HeaderValueOption;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingResponse,
};
use prost::bytes::{Bytes, BytesMut};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tonic::{Request, Status, Streaming};

use crate::answer::{header, Answer, Body, Reply};
use crate::budget::{Budget, Ticket};
use crate::counters::{self, Outcome, Phase};
use crate::replay::{Epoch, ReplayCheck, ReplayOutcome, Stores};
use crate::table::{Refusal, Route, Table};
use crate::threads::EngineThreads;
use crate::wire::{HttpBody, In, Incoming, Outgoing};

/// The gRPC metadata naming the route (gateway/control/envoy_config.py sets it per route).
const ROUTE_METADATA: &str = "x-wsgate-route";
/// W3C trace context of Envoy's ext_proc span, in the stream's gRPC metadata when Envoy traces the request: given
/// to the engine's request phase as this header when sampled (the worker's spans are its children:
/// filters/tracing.py), and the engine gets no other.
const TRACE_PARENT: &str = "traceparent";
/// Headers a client must never set itself: the gateway vouches for them.
const GATEWAY_HEADER_PREFIX: &str = "x-wsgate-";

pub static BUDGET: Budget = Budget::new(0);

pub struct Shared {
    pub table: Mutex<Arc<Table>>,
    pub worker: Py<PyAny>,
    pub handle: Py<PyAny>, // worker.handle, looked up once
    pub replay: Stores,
    pub engine: EngineThreads,
}

impl Shared {
    pub fn table(&self) -> Arc<Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn install(&self, table: Table) {
        *self.table.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
    }
}

pub struct Frame(pub Arc<Shared>);

pub type ResponseStream = Pin<Box<dyn futures_util::Stream<Item = Result<Outgoing, Status>> + Send>>;

impl Frame {
    /// Envoy's `Process` call: one stream per exchange (wire.rs serves it).
    pub fn process(&self, request: Request<Streaming<Incoming>>) -> ResponseStream {
        let metadata = |name: &str| request.metadata().get(name).and_then(|v| v.to_str().ok());
        let route_name = metadata(ROUTE_METADATA).unwrap_or("");
        // In-flight exchanges keep the table they started with; a reload only changes new ones.
        let mut stream = Stream::new(self.0.clone(), route_name.to_owned());
        // Envoy sends its span's context for every request it traces, sampled or not (99% are not at the default
        // 1%): only a sampled one reaches the engine, so an unsampled request costs the worker no tracing at all.
        stream.trace_parent = metadata(TRACE_PARENT).filter(|v| sampled(v)).map(str::to_owned);
        let inbound = request.into_inner();
        let responses = futures_util::stream::unfold(Some((inbound, stream)), |state| async move {
            let (mut inbound, mut stream) = state?;
            loop {
                // An error or end of the inbound stream (Envoy reset or finished it) ends the exchange; dropping
                // it releases its body reservation.
                let msg = inbound.message().await.ok()??;
                let mut step = stream.on_message(msg);
                if let Step::Engine(phase, body) = step {
                    match stream.engine(phase, body).await {
                        Ok(called) => (stream, step) = called,
                        Err(fault) => return Some((Ok(fault), None)),
                    }
                }
                // Awaited here, off the Python thread: other exchanges go on while Redis answers.
                while let Step::Check(check) = step {
                    step = stream.settle(*check).await;
                }
                match step {
                    Step::Reply(resp) => return Some((Ok(resp), Some((inbound, stream)))),
                    Step::Last(resp) => return Some((Ok(resp), None)),
                    Step::Nothing | Step::Check(_) | Step::Engine(..) | Step::Elsewhere => continue,
                }
            }
        });
        Box::pin(responses)
    }
}

enum Step {
    Reply(Outgoing),
    Last(Outgoing), // an immediate response: the exchange ends here
    Nothing,
    Check(Box<Check>),    // the engine's verdict, once its replay keys are set (replay.rs)
    Engine(Phase, Bytes), // a body for the engine, its budget reserved
    Elsewhere,            // the engine call must be made again on an engine thread (it is about to wait)
}

/// The engine's answer to a body phase, with its replay check if any.
type Called = (Reply, Option<Py<ReplayCheck>>);

struct Check {
    request: bool,
    replay: Py<ReplayCheck>, // frozen: read off the Python thread
    reply: Reply,
}

/// One ext_proc stream: one HTTP exchange as the frame takes it through its phases.
struct Stream {
    shared: Arc<Shared>,
    table: Arc<Table>,
    route_name: String,
    route: Option<Route>,
    ticket: Ticket,
    soap12: bool,                   // the request's content type names SOAP 1.2: faults are 1.2
    headers: Vec<(String, String)>, // the request's, for the engine; then the response's (its content type)
    in_flight: Option<Py<PyAny>>,   // the worker's `InFlight`, from the request body to the response body
    trace_parent: Option<String>,   // Envoy's ext_proc span, when this exchange's trace is sampled
    // A streamed route's: the held headers phase's answer (the request's spoofed headers removed), the chunks
    // received so far, and the whole body once the engine has it (sent back unchanged when it passes it as it came).
    held: HeaderMutation,
    chunks: BytesMut,
    received: Bytes,
}

impl Stream {
    fn new(shared: Arc<Shared>, route_name: String) -> Self {
        counters::STREAMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        counters::STREAMS_ACTIVE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let table = shared.table();
        let route = table.routes.get(&route_name).cloned();
        Stream {
            shared,
            table,
            route_name,
            route,
            ticket: Ticket::new(&BUDGET),
            soap12: false,
            headers: Vec::new(),
            in_flight: None,
            trace_parent: None,
            held: HeaderMutation::default(),
            chunks: BytesMut::new(),
            received: Bytes::new(),
        }
    }

    fn on_message(&mut self, msg: Incoming) -> Step {
        let Some(request) = msg.request else { return Step::Nothing };
        let (phase, metric_phase) = match &request {
            In::RequestHeaders(_) => (Phase::RequestHeaders, "request"),
            In::RequestBody(_) => (Phase::RequestBody, "request"),
            In::ResponseHeaders(_) => (Phase::ResponseHeaders, "response"),
            In::ResponseBody(_) => (Phase::ResponseBody, "response"),
            In::RequestTrailers(_) | In::ResponseTrailers(_) => (Phase::Trailers, "response"),
        };
        if let In::RequestHeaders(h) = &request {
            self.headers = header_list(h);
            self.soap12 =
                self.header("content-type").is_some_and(|ct| ct.to_ascii_lowercase().contains("application/soap+xml"));
        }
        let Some(route) = self.route.clone() else {
            let detail = format!("no XML policy for route {:?}", self.route_name);
            return self.refuse(Refusal::NoRoute, phase, metric_phase, detail);
        };
        let bodyless = matches!(&request, In::ResponseHeaders(h) if h.end_of_stream);
        let result = match request {
            In::RequestHeaders(h) => self.request_headers(&route, h.end_of_stream).map(Out::RequestHeaders),
            In::ResponseHeaders(h) => self.response_headers(&route, &h).map(Out::ResponseHeaders),
            In::RequestBody(b) => return self.body(&route, phase, b),
            In::ResponseBody(b) => return self.body(&route, phase, b),
            // Envoy sends trailers only on a streamed route (`SEND` there, as it demands, `SKIP` elsewhere): a body
            // that ends with trailers instead of its last chunk is refused (SOAP has none).
            In::RequestTrailers(_) => Err((Refusal::Trailers, "request with trailers".into())),
            In::ResponseTrailers(_) => Err((Refusal::Internal, "backend response with trailers".into())),
        };
        match result {
            // A streamed route's headers wait for the whole body's verdict: answered, Envoy would pass them on. A
            // reply without a body (a 202, a 204) has none to wait for, as on a buffered route.
            Ok(Out::RequestHeaders(h) | Out::ResponseHeaders(h)) if route.streamed && !bodyless => {
                counters::phase(phase, Outcome::Passed);
                self.held = h.response.and_then(|c| c.header_mutation).unwrap_or_default();
                Step::Nothing
            }
            Ok(out) => {
                counters::phase(phase, Outcome::Passed);
                Step::Reply(Outgoing::Message(Box::new(ProcessingResponse {
                    response: Some(out),
                    ..Default::default()
                })))
            }
            Err((refusal, detail)) => self.refuse(refusal, phase, metric_phase, detail),
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn request_headers(&self, route: &Route, end_of_stream: bool) -> Result<HeadersResponse, (Refusal, String)> {
        let spoofed = admit_request(&self.headers, end_of_stream, route)?;
        let mutation = HeaderMutation { remove_headers: spoofed, ..Default::default() };
        let common = CommonResponse { header_mutation: Some(mutation), ..Default::default() };
        Ok(HeadersResponse { response: Some(common) })
    }

    fn response_headers(&mut self, route: &Route, h: &HttpHeaders) -> Result<HeadersResponse, (Refusal, String)> {
        // The request's headers were handed over with its body: from here on the response's are kept (a
        // multipart/related reply's boundary is in its content type).
        self.headers = header_list(h);
        declared(self.header("content-length"), route.max_response_bytes, Refusal::ResponseTooLarge)?;
        Ok(HeadersResponse::default())
    }

    /// A body phase: reserve the body in the budget, then it goes to the engine (`engine`). On a streamed route
    /// the body comes in chunks: each is reserved as it arrives (a slow client holds what it sent, no more) and
    /// held, within the route's limit (Envoy buffers nothing there, so the frame enforces it), until the last.
    fn body(&mut self, route: &Route, phase: Phase, b: HttpBody) -> Step {
        let request = matches!(phase, Phase::RequestBody);
        let metric_phase = if request { "request" } else { "response" };
        let size = (self.chunks.len() + b.body.len()) as u64;
        let (limit, too_large) = match request {
            true => (route.max_request_bytes, Refusal::TooLarge),
            false => (route.max_response_bytes, Refusal::ResponseTooLarge),
        };
        if route.streamed && size > limit {
            let detail = match request {
                true => format!("body too large: over {limit} bytes"),
                false => format!("backend response refused: body too large: over {limit} bytes"),
            };
            return self.refuse(too_large, phase, metric_phase, detail);
        }
        if let Err(detail) = self.ticket.take(size) {
            return self.refuse(Refusal::Busy, phase, metric_phase, detail);
        }
        if !route.streamed || (self.chunks.is_empty() && b.end_of_stream) {
            return Step::Engine(phase, b.body); // whole as it came: no copy
        }
        self.chunks.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return Step::Nothing;
        }
        Step::Engine(phase, std::mem::take(&mut self.chunks).freeze()) // its allocation goes with it
    }

    /// The body phase: here, on the gRPC thread (a handoff to another thread costs more CPU than the whole of a
    /// cheap exchange's Python on this kind of machine, measured: hmac +45%), where the call may not wait on the
    /// network; if it was about to (`Answer.elsewhere`), or the route's waits may come after what a second run
    /// cannot redo (`Route.waits_on_network`: made there at once), on an engine thread, where it may: the stream
    /// goes with the call and comes back with its step (the generic fault if no engine thread is left: the frame
    /// is stopping).
    async fn engine(mut self, phase: Phase, body: Bytes) -> Result<(Self, Step), Outgoing> {
        if !self.route.as_ref().is_some_and(|r| r.waits_on_network) {
            // `body` is shared, not copied, with a second run
            match Python::attach(|py| self.answer(py, phase, body.clone(), false)) {
                Step::Elsewhere => counters::phase(phase, Outcome::Moved),
                step => return Ok((self, step)),
            }
        }
        let shared = self.shared.clone();
        let (table, soap12) = (self.table.clone(), self.soap12);
        let called = shared.engine.run(move |py| {
            let step = self.answer(py, phase, body, true);
            (self, step)
        });
        called.await.ok_or_else(|| internal_fault(&table, soap12))
    }

    /// One call into the engine, as a step: `Step::Elsewhere` if it was about to wait where it may not; where it
    /// may, that answer is a failed call (fail closed).
    fn answer(&mut self, py: Python<'_>, phase: Phase, body: Bytes, may_wait: bool) -> Step {
        let request = matches!(phase, Phase::RequestBody);
        let metric_phase = if request { "request" } else { "response" };
        if self.route.as_ref().is_some_and(|r| r.streamed) {
            self.received = body.clone(); // shared, not copied: sent back if passed on unchanged
        }
        let (reply, replay) = match self.call_engine(py, metric_phase, body, may_wait) {
            Ok(Some(answer)) => answer,
            Ok(None) if !may_wait => return Step::Elsewhere,
            Ok(None) | Err(()) => {
                counters::phase(phase, Outcome::Error);
                return Step::Last(internal_fault(&self.table, self.soap12));
            }
        };
        counters::phase(phase, Outcome::Engine);
        match replay {
            Some(replay) => Step::Check(Box::new(Check { request, replay, reply })),
            None => self.answer_with(request, reply),
        }
    }

    /// Set the replay keys of an accepted message, then answer as the engine said; a key already set or a Redis
    /// that cannot answer, or a message not newer than the store's epoch, turns the answer into the engine's
    /// refusal (`worker.replay_refused`, given the `ReplayOutcome`).
    async fn settle(&mut self, check: Check) -> Step {
        let replay = check.replay.get();
        let epoch = Epoch { key: &replay.epoch_key, since_ms: replay.since_ms };
        let outcome = self.shared.replay.first_sight(&replay.url, &replay.keys, &epoch).await;
        counters::replay_outcome(outcome.counter());
        if outcome == ReplayOutcome::First() {
            return self.answer_with(check.request, check.reply);
        }
        let refused = Python::attach(|py| {
            let in_flight = self.in_flight.as_ref().map(|s| s.clone_ref(py));
            let args = (self.route_name.as_str(), in_flight, outcome);
            let call = self.shared.worker.bind(py).call_method1("replay_refused", args);
            call.and_then(|answer| Ok(Answer::read(answer.cast::<Answer>()?)?.0)).map_err(|err| err.display(py))
        });
        match refused {
            Ok(Reply { status: Some(status), body, headers }) => {
                Step::Last(immediate(status, headers, body.unwrap_or_default().concat()))
            }
            // A refusal that would pass the message on is none: fail closed.
            Ok(Reply { status: None, .. }) | Err(()) => Step::Last(internal_fault(&self.table, self.soap12)),
        }
    }

    /// The one call into the engine: `worker.handle(route, phase, body, the phase's headers, in-flight
    /// record or None, may_wait) -> Answer`; None when the answer is `elsewhere` (the in-flight record kept as it
    /// was). Its replay check, if any, is made before the answer goes out (`settle`). A failure of the call itself
    /// (the worker catches the engine's errors) or anything but an `Answer` is printed and answered with a generic
    /// fault: fail closed.
    fn call_engine(&mut self, py: Python<'_>, phase: &str, body: Bytes, may_wait: bool) -> Result<Option<Called>, ()> {
        let result = (|| -> PyResult<_> {
            let headers = PyDict::new(py);
            // The engine's traceparent is Envoy's sampled span or none: never a caller's own (a trusted caller's
            // is the parent of Envoy's spans anyway, and an unsampled one would cost the worker its parsing).
            for (k, v) in self.headers.iter().filter(|(k, _)| k != TRACE_PARENT) {
                headers.set_item(k, v)?;
            }
            if phase == "request" {
                if let Some(parent) = &self.trace_parent {
                    headers.set_item(TRACE_PARENT, parent)?;
                }
            }
            let in_flight = self.in_flight.take();
            let body = Py::new(py, Body(body))?; // the engine's view of the frame's bytes: no copy
            let args = (self.route_name.as_str(), phase, body, headers, in_flight, may_wait);
            let answer = self.shared.handle.bind(py).call1(args)?;
            let answer = answer.cast::<Answer>()?;
            if answer.get().elsewhere {
                self.in_flight = Some(answer.get().in_flight.clone_ref(py));
                return Ok(None);
            }
            let (reply, in_flight, replay) = Answer::read(answer)?;
            self.in_flight = Some(in_flight);
            Ok(Some((reply, replay)))
        })();
        result.map_err(|err| {
            eprintln!(
                "wsgate.frame ERROR the engine call failed on route {:?}; answered with a fault",
                self.route_name
            );
            err.display(py);
        })
    }

    /// The engine's answer as Envoy gets it: passed on with the (new) body, or an answer to the client. On a
    /// streamed route the held headers' answer goes first, with the engine's headers, then the body (the one
    /// received if unchanged: in this mode what is not sent back does not go on).
    fn answer_with(&mut self, request: bool, reply: Reply) -> Step {
        let Reply { status, body: new_body, headers: mut set } = reply;
        let received = std::mem::take(&mut self.received); // held no longer than this answer
        if let Some(status) = status {
            return Step::Last(immediate(status, set, new_body.unwrap_or_default().concat()));
        }
        if self.route.as_ref().is_some_and(|r| r.streamed) {
            // No content-length: Envoy drops it in this mode and sends the body chunked.
            let mut headers = std::mem::take(&mut self.held);
            headers.set_headers.append(&mut set);
            let body = new_body.unwrap_or_else(|| vec![received]);
            return Step::Reply(Outgoing::Streamed { request, headers, body });
        }
        let Some(body) = new_body else {
            let headers = HeaderMutation { set_headers: set, ..Default::default() };
            let common = CommonResponse { header_mutation: Some(headers), ..Default::default() };
            let body_response = BodyResponse { response: Some(common) };
            let out = if request { Out::RequestBody(body_response) } else { Out::ResponseBody(body_response) };
            return Step::Reply(Outgoing::Message(Box::new(ProcessingResponse {
                response: Some(out),
                ..Default::default()
            })));
        };
        // Envoy refuses a replaced body whose content-length no longer fits (and legacy SOAP servers want one).
        let length: usize = body.iter().map(Bytes::len).sum();
        set.push(header("content-length", &length.to_string()));
        let headers = HeaderMutation { set_headers: set, ..Default::default() };
        Step::Reply(Outgoing::Body { request, headers, body })
    }

    /// A refusal answered here: the worker logs it and counts it, the client gets the pre-rendered fault.
    fn refuse(&mut self, refusal: Refusal, phase: Phase, metric_phase: &str, detail: String) -> Step {
        counters::phase(phase, Outcome::Refused);
        counters::refusal(refusal);
        Python::attach(|py| {
            let args = (self.route_name.as_str(), metric_phase, refusal.name(), detail);
            if let Err(err) = self.shared.worker.bind(py).call_method1("refused", args) {
                err.display(py);
            }
        });
        let fault = self.table.fault(refusal);
        let (ct, body) = &fault.bodies[self.soap12 as usize];
        Step::Last(immediate(fault.status, vec![header("content-type", ct)], body.clone()))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        counters::STREAMS_ACTIVE.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn internal_fault(table: &Table, soap12: bool) -> Outgoing {
    let fault = table.fault(Refusal::Internal);
    let (ct, body) = &fault.bodies[soap12 as usize];
    immediate(fault.status, vec![header("content-type", ct)], body.clone())
}

/// A request's headers on an XML route: a SOAP POST with a body within the route's limit, or a refusal. Returns
/// the headers to remove: those the gateway vouches for, whatever their case.
fn admit_request(
    headers: &[(String, String)],
    end_of_stream: bool,
    route: &Route,
) -> Result<Vec<String>, (Refusal, String)> {
    let find = |name: &str| headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    let method = find(":method").unwrap_or("");
    if method != "POST" {
        return Err((Refusal::Method, format!("method not POST: {method:.20}")));
    }
    if end_of_stream {
        return Err((Refusal::NoBody, "request without a body".into()));
    }
    declared(find("content-length"), route.max_request_bytes, Refusal::TooLarge)?;
    let identity = route.identity_header.as_deref();
    let spoofed = headers
        .iter()
        .filter(|(k, _)| {
            let k = k.to_ascii_lowercase();
            k.starts_with(GATEWAY_HEADER_PREFIX) || Some(k.as_str()) == identity
        })
        .map(|(k, _)| k.clone())
        .collect();
    Ok(spoofed)
}

/// Check a declared content-length against the route's limit. A declared length reserves nothing: only bodies
/// that arrive hold budget.
fn declared(length: Option<&str>, limit: u64, too_large: Refusal) -> Result<(), (Refusal, String)> {
    let Some(length) = length else { return Ok(()) }; // chunked: Envoy stops buffering at the route's limit
    if length.is_empty() || !length.bytes().all(|b| b.is_ascii_digit()) {
        let shown: String = length.chars().take(40).collect();
        return Err((Refusal::BadLength, format!("content-length not a number: {shown:?}")));
    }
    let size = length.parse::<u64>().unwrap_or(u64::MAX);
    if size > limit {
        let detail = match too_large {
            Refusal::ResponseTooLarge => format!("backend response refused: body too large: {size} > {limit} bytes"),
            _ => format!("body too large: {size} > {limit} bytes"),
        };
        return Err((too_large, detail));
    }
    Ok(())
}

fn header_list(h: &HttpHeaders) -> Vec<(String, String)> {
    let Some(map) = &h.headers else { return Vec::new() };
    map.headers
        .iter()
        .map(|hv| {
            // Envoy sends raw_value; a header's bytes are latin-1 as HTTP/1 has them.
            let value = if hv.raw_value.is_empty() {
                hv.value.clone()
            } else {
                hv.raw_value.iter().map(|&b| b as char).collect()
            };
            (hv.key.clone(), value)
        })
        .collect()
}

fn immediate(status: u32, headers: Vec<HeaderValueOption>, body: Vec<u8>) -> Outgoing {
    let response = ImmediateResponse {
        status: Some(HttpStatus { code: status as i32 }),
        headers: Some(HeaderMutation { set_headers: headers, ..Default::default() }),
        body,
        details: "wsgate".into(),
        ..Default::default()
    };
    Outgoing::Message(Box::new(ProcessingResponse {
        response: Some(Out::ImmediateResponse(response)),
        ..Default::default()
    }))
}

/// Whether a W3C traceparent (https://www.w3.org/TR/trace-context/#traceparent-header) is well formed with its
/// sampled flag set. Anything malformed is not sampled: ignored, never a fault.
fn sampled(traceparent: &str) -> bool {
    let b = traceparent.as_bytes();
    let hex = |s: &[u8]| s.iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c));
    let nonzero = |s: &[u8]| s.iter().any(|&c| c != b'0');
    // version 00 is exactly 55 characters; a later version may append fields after a dash; ff is invalid
    let framed = b.len() == 55 || (b.len() > 55 && b[55] == b'-' && !b.starts_with(b"00"));
    framed
        && hex(&b[..2])
        && !b.starts_with(b"ff")
        && (b[2], b[35], b[52]) == (b'-', b'-', b'-')
        && hex(&b[3..35])
        && nonzero(&b[3..35])
        && hex(&b[36..52])
        && nonzero(&b[36..52])
        && hex(&b[53..55])
        && u8::from_str_radix(&traceparent[53..55], 16).is_ok_and(|flags| flags & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_well_formed_sampled_traceparent_is_sampled() {
        let (trace, span) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
        for flags in ["01", "03", "ff", "0b"] {
            assert!(sampled(&format!("00-{trace}-{span}-{flags}")), "{flags}");
        }
        assert!(sampled(&format!("01-{trace}-{span}-01-later-fields")));
        let malformed = [
            format!("00-{trace}-{span}-00"),                  // not sampled
            format!("00-{trace}-{span}-02"),                  // another flag, not sampled
            format!("00-{}-{span}-01", trace.to_uppercase()), // hex is lowercase
            format!("00-{}-{span}-01", "0".repeat(32)),       // all-zero trace id
            format!("00-{trace}-{}-01", "0".repeat(16)),      // all-zero parent id
            format!("ff-{trace}-{span}-01"),                  // the invalid version
            format!("00-{trace}-{span}-01-more"),             // version 00 has no more fields
            format!("01-{trace}-{span}-01more"),
            format!("00-{trace}-{span}-1"),
            format!("00-{trace}-{span}-0x"),
            format!("00-{trace}-{span}-+1"),
            format!("00_{trace}_{span}_01"),
            format!("00-{trace}-{span}-é"), // not ASCII: no slicing inside a character
            String::new(),
            "garbage".into(),
        ];
        for value in &malformed {
            assert!(!sampled(value), "{value:?}");
        }
    }

    fn route() -> Route {
        Route {
            max_request_bytes: 100,
            max_response_bytes: 200,
            identity_header: Some("x-user".into()),
            waits_on_network: false,
            streamed: false,
        }
    }

    fn request(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn only_a_soap_post_with_a_body_within_the_limit_is_admitted() {
        let ok = request(&[(":method", "POST"), ("content-length", "100")]);
        assert_eq!(admit_request(&ok, false, &route()), Ok(vec![]));
        for method in ["GET", "post", "PUT", ""] {
            let r = request(&[(":method", method)]);
            assert_eq!(admit_request(&r, false, &route()).unwrap_err().0, Refusal::Method, "{method:?}");
        }
        assert_eq!(admit_request(&request(&[]), false, &route()).unwrap_err().0, Refusal::Method);
        let bodyless = request(&[(":method", "POST")]);
        assert_eq!(admit_request(&bodyless, true, &route()).unwrap_err().0, Refusal::NoBody);
        let large = request(&[(":method", "POST"), ("content-length", "101")]);
        assert_eq!(admit_request(&large, false, &route()).unwrap_err().0, Refusal::TooLarge);
        let chunked = request(&[(":method", "POST"), ("transfer-encoding", "chunked")]);
        assert_eq!(admit_request(&chunked, false, &route()), Ok(vec![]));
    }

    #[test]
    fn headers_the_gateway_vouches_for_are_removed_from_client_requests() {
        let r = request(&[
            (":method", "POST"),
            ("x-wsgate-subject", "CN=admin"),
            ("X-WSGATE-ROUTE", "other"),
            ("x-user", "admin"),
            ("X-User", "admin"),
            ("x-wsgatesubject", "kept"),
            ("content-type", "text/xml"),
        ]);
        let removed = admit_request(&r, false, &route()).unwrap();
        assert_eq!(removed, ["x-wsgate-subject", "X-WSGATE-ROUTE", "x-user", "X-User"]);
    }

    #[test]
    fn declared_lengths_over_the_limit_or_not_numbers_are_refused() {
        assert!(declared(None, 10, Refusal::TooLarge).is_ok());
        assert!(declared(Some("10"), 10, Refusal::TooLarge).is_ok());
        assert_eq!(declared(Some("11"), 10, Refusal::TooLarge).unwrap_err().0, Refusal::TooLarge);
        let (refusal, detail) = declared(Some("11"), 10, Refusal::ResponseTooLarge).unwrap_err();
        assert_eq!(
            (refusal, detail.as_str()),
            (Refusal::ResponseTooLarge, "backend response refused: body too large: 11 > 10 bytes")
        );
        for bad in ["", "12x", "-1", " 5", "1e3", "٣"] {
            assert_eq!(declared(Some(bad), 10, Refusal::TooLarge).unwrap_err().0, Refusal::BadLength, "{bad:?}");
        }
        // More digits than any integer: too large, not a wrap-around.
        assert_eq!(declared(Some("99999999999999999999999"), 10, Refusal::TooLarge).unwrap_err().0, Refusal::TooLarge);
    }
}
