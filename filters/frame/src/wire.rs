//! Envoy's ext_proc messages as the frame reads and writes them, without copying a body on the way.
//!
//! The generated `ExternalProcessorServer` decodes a body into a `Vec<u8>` (a copy out of tonic's receive buffer)
//! and encodes a replaced body from one `Vec<u8>` into one contiguous send buffer. Here a body phase's body is
//! decoded as a `Bytes` slice of tonic's buffer (prost's `bytes` fields split it off: no copy), and a replaced
//! body goes to HTTP/2 as the chunks of its gRPC message (`Outgoing::chunks`): the message's head with the small
//! segments copied in, each large segment (a slice of the body the engine was given) by reference. gRPC frames a
//! message by its length, not by DATA frames, so Envoy reads the same bytes; the worker never holds the body
//! twice (a 50 MB attachment on a route that rewrites the package: once, not received + encoded). Everything
//! else is Envoy's own message types.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::{HeaderMutation, HttpHeaders, HttpTrailers, ProcessingResponse};
use http_body::Frame as HttpFrame;
use prost::bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, message, WireType};
use prost::Message;
use tonic::codec::{DecodeBuf, Decoder};
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::server::NamedService;
use tonic::{Request, Status, Streaming};

use crate::service::{Frame, ResponseStream};

/// gRPC's message prefix: the compressed flag and the length.
const GRPC_PREFIX: usize = 5;
/// A replaced body's segments this long or longer go to HTTP/2 as they are; shorter ones are copied into the
/// message's head (fewer, larger DATA frames for small answers).
const BY_REFERENCE: usize = 64 * 1024;

const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";
// ProcessingResponse's `request_body` and `response_body` (BodyResponse), and the fields inside them down to the
// body: BodyResponse.response (CommonResponse), CommonResponse.header_mutation and .body_mutation,
// BodyMutation.body.
const REQUEST_BODY_RESPONSE: u32 = 3;
const RESPONSE_BODY_RESPONSE: u32 = 4;
const COMMON: u32 = 1;
const HEADER_MUTATION: u32 = 2;
const BODY_MUTATION: u32 = 3;
const BODY: u32 = 1;

/// Envoy's `ProcessingRequest` with the fields the frame reads (the others are skipped), a body as `Bytes`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Incoming {
    #[prost(oneof = "In", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<In>,
}

/// `ProcessingRequest.request`, tag for tag.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum In {
    #[prost(message, tag = "2")]
    RequestHeaders(HttpHeaders),
    #[prost(message, tag = "3")]
    ResponseHeaders(HttpHeaders),
    #[prost(message, tag = "4")]
    RequestBody(HttpBody),
    #[prost(message, tag = "5")]
    ResponseBody(HttpBody),
    #[prost(message, tag = "6")]
    RequestTrailers(HttpTrailers),
    #[prost(message, tag = "7")]
    ResponseTrailers(HttpTrailers),
}

/// Envoy's `HttpBody`, its bytes a slice of the buffer the message was decoded from.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// What the frame sends Envoy: a message, or a body phase's answer that sets `headers` and replaces the body with
/// `body`'s segments joined; on a streamed route (`FULL_DUPLEX_STREAMED`), the held headers phase's answer with
/// `headers`, then `body`'s segments as streamed chunks of at most `STREAM_CHUNK` bytes, the last one ending it.
pub enum Outgoing {
    Message(Box<ProcessingResponse>),
    Body { request: bool, headers: HeaderMutation, body: Vec<Bytes> },
    Streamed { request: bool, headers: HeaderMutation, body: Vec<Bytes> },
}

/// A streamed body goes back to Envoy in messages of at most this many body bytes (measured with Envoy 1.40 and a
/// 10 MB body: 64 KB to 1 MB pieces cost Envoy the same, 4 MB more; docs/performance.md).
pub const STREAM_CHUNK: usize = 1024 * 1024;
// BodyMutation.streamed_response (StreamedBodyResponse: `body`, `end_of_stream`).
const STREAMED_RESPONSE: u32 = 3;
const END_OF_STREAM: u32 = 2;

/// The lengths of a replaced body's enclosing messages, innermost first.
struct Nested {
    body: usize,
    mutation: usize,
    common: usize,
    body_response: usize,
}

impl Nested {
    fn of(headers: &HeaderMutation, body: &[Bytes]) -> Self {
        let body: usize = body.iter().map(Bytes::len).sum();
        let mutation = delimited_len(BODY, body);
        let common = message::encoded_len(HEADER_MUTATION, headers) + delimited_len(BODY_MUTATION, mutation);
        Nested { body, mutation, common, body_response: delimited_len(COMMON, common) }
    }
}

impl Outgoing {
    #[cfg(test)]
    fn encoded_len(&self) -> usize {
        match self {
            Outgoing::Message(m) => m.encoded_len(),
            Outgoing::Body { request, headers, body } => {
                delimited_len(body_response_tag(*request), Nested::of(headers, body).body_response)
            }
            Outgoing::Streamed { .. } => unreachable!("several messages"),
        }
    }

    /// The gRPC message (its 5-byte prefix, then the protobuf) as the chunks HTTP/2 sends: one buffer holding all
    /// but the segments of `BY_REFERENCE` bytes or more, which follow as they are (slices kept alive until sent).
    /// A streamed answer is several messages, one after the other, each written so.
    pub fn chunks(self, max_message_bytes: usize) -> Result<VecDeque<Bytes>, Status> {
        let (request, headers, body) = match self {
            Outgoing::Streamed { request, headers, body } => {
                return streamed(request, headers, body, max_message_bytes)
            }
            Outgoing::Message(m) => {
                let len = checked_len(m.encoded_len(), max_message_bytes)?;
                let mut buf = BytesMut::with_capacity(GRPC_PREFIX + len as usize);
                grpc_prefix(len, &mut buf);
                m.encode(&mut buf).expect("sized to the message");
                return Ok(VecDeque::from([buf.freeze()]));
            }
            Outgoing::Body { request, headers, body } => (request, headers, body),
        };
        let n = Nested::of(&headers, &body);
        let len = checked_len(delimited_len(body_response_tag(request), n.body_response), max_message_bytes)?;
        let by_reference: usize = body.iter().map(Bytes::len).filter(|&n| n >= BY_REFERENCE).sum();
        let mut buf = BytesMut::with_capacity(GRPC_PREFIX + len as usize - by_reference);
        grpc_prefix(len, &mut buf);
        delimit(body_response_tag(request), n.body_response, &mut buf);
        delimit(COMMON, n.common, &mut buf);
        message::encode(HEADER_MUTATION, &headers, &mut buf);
        delimit(BODY_MUTATION, n.mutation, &mut buf);
        delimit(BODY, n.body, &mut buf);
        let mut chunks = VecDeque::new();
        segments_into(body, buf, &mut chunks);
        Ok(chunks)
    }

    /// The message as Envoy's types have it (tests: the wire bytes are the same).
    #[cfg(test)]
    pub fn into_message(self) -> ProcessingResponse {
        use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
        use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
        use envoy_types::pb::envoy::service::ext_proc::v3::{BodyMutation, BodyResponse, CommonResponse};
        match self {
            Outgoing::Message(m) => *m,
            Outgoing::Body { request, headers, body } => {
                let common = CommonResponse {
                    header_mutation: Some(headers),
                    body_mutation: Some(BodyMutation { mutation: Some(Mutation::Body(body.concat())) }),
                    ..Default::default()
                };
                let r = BodyResponse { response: Some(common) };
                let out = if request { Out::RequestBody(r) } else { Out::ResponseBody(r) };
                ProcessingResponse { response: Some(out), ..Default::default() }
            }
            Outgoing::Streamed { .. } => unreachable!("several messages"),
        }
    }
}

/// `buf` (a message's head) then `segments`: each under `BY_REFERENCE` copied in, each larger one as it is.
fn segments_into(segments: impl IntoIterator<Item = Bytes>, mut buf: BytesMut, chunks: &mut VecDeque<Bytes>) {
    for segment in segments {
        if segment.len() < BY_REFERENCE {
            buf.put_slice(&segment);
        } else {
            if !buf.is_empty() {
                chunks.push_back(buf.split().freeze());
            }
            chunks.push_back(segment);
        }
    }
    if !buf.is_empty() {
        chunks.push_back(buf.freeze());
    }
}

/// A streamed route's answer: the headers phase's answer Envoy was kept waiting for (`headers` set or removed),
/// then the body as `StreamedBodyResponse` messages of at most `STREAM_CHUNK` bytes (segments sliced, not
/// copied, where a message ends inside one), the last with `end_of_stream`: Envoy passes nothing on before it has
/// the headers' answer, which goes out only with the whole verified body behind it.
fn streamed(
    request: bool,
    headers: HeaderMutation,
    body: Vec<Bytes>,
    max_message_bytes: usize,
) -> Result<VecDeque<Bytes>, Status> {
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
    use envoy_types::pb::envoy::service::ext_proc::v3::{CommonResponse, HeadersResponse};
    let common = CommonResponse { header_mutation: Some(headers), ..Default::default() };
    let answer = HeadersResponse { response: Some(common) };
    let out = if request { Out::RequestHeaders(answer) } else { Out::ResponseHeaders(answer) };
    let head = ProcessingResponse { response: Some(out), ..Default::default() };
    let mut chunks = Outgoing::Message(Box::new(head)).chunks(max_message_bytes)?;
    let mut pieces = pieces(body).peekable();
    while let Some(piece) = pieces.next() {
        let last = pieces.peek().is_none();
        let n: usize = piece.iter().map(Bytes::len).sum();
        let streamed = delimited_len(BODY, n) + if last { key_len(END_OF_STREAM) + 1 } else { 0 };
        let mutation = delimited_len(STREAMED_RESPONSE, streamed);
        let common = delimited_len(BODY_MUTATION, mutation);
        let body_response = delimited_len(COMMON, common);
        let len = checked_len(delimited_len(body_response_tag(request), body_response), max_message_bytes)?;
        let mut buf = BytesMut::with_capacity(GRPC_PREFIX + 32 + n.min(BY_REFERENCE));
        grpc_prefix(len, &mut buf);
        delimit(body_response_tag(request), body_response, &mut buf);
        delimit(COMMON, common, &mut buf);
        delimit(BODY_MUTATION, mutation, &mut buf);
        delimit(STREAMED_RESPONSE, streamed, &mut buf);
        delimit(BODY, n, &mut buf);
        let mut tail = BytesMut::new();
        if last {
            encode_key(END_OF_STREAM, WireType::Varint, &mut tail);
            tail.put_u8(1);
        }
        segments_into(piece.into_iter().chain([tail.freeze()]), buf, &mut chunks);
    }
    Ok(chunks)
}

/// `body`'s segments cut into pieces of at most `STREAM_CHUNK` bytes (a segment across a cut is sliced); one empty
/// piece for an empty body: its end still goes out.
fn pieces(body: Vec<Bytes>) -> impl Iterator<Item = Vec<Bytes>> {
    let mut out = vec![Vec::new()];
    let mut room = STREAM_CHUNK;
    for mut segment in body {
        while !segment.is_empty() {
            if room == 0 {
                out.push(Vec::new());
                room = STREAM_CHUNK;
            }
            let take = segment.split_to(segment.len().min(room));
            room -= take.len();
            out.last_mut().expect("never empty").push(take);
        }
    }
    out.into_iter()
}

fn checked_len(len: usize, max_message_bytes: usize) -> Result<u32, Status> {
    if len > max_message_bytes {
        return Err(Status::out_of_range(format!("an answer of {len} bytes, over {max_message_bytes}")));
    }
    u32::try_from(len).map_err(|_| Status::out_of_range("an answer over 4 GiB"))
}

fn body_response_tag(request: bool) -> u32 {
    if request {
        REQUEST_BODY_RESPONSE
    } else {
        RESPONSE_BODY_RESPONSE
    }
}

fn grpc_prefix(len: u32, dst: &mut impl BufMut) {
    dst.put_u8(0); // not compressed
    dst.put_u32(len);
}

fn delimited_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

fn delimit(tag: u32, len: usize, dst: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, dst);
    encode_varint(len as u64, dst);
}

/// The decoder of Envoy's messages (tonic's `Streaming` reads the gRPC framing).
#[derive(Clone, Copy, Default)]
pub struct Wire;

impl Decoder for Wire {
    type Item = Incoming;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Incoming>, Status> {
        Incoming::decode(src).map(Some).map_err(|e| Status::internal(e.to_string()))
    }
}

/// The ext_proc gRPC service over `Frame`, as the generated `ExternalProcessorServer` but with `Wire`.
#[derive(Clone)]
pub struct ExtProc {
    frame: Arc<Frame>,
    max_message_bytes: usize,
}

impl ExtProc {
    pub fn new(frame: Frame, max_message_bytes: usize) -> Self {
        ExtProc { frame: Arc::new(frame), max_message_bytes }
    }
}

impl NamedService for ExtProc {
    const NAME: &'static str = "envoy.service.ext_proc.v3.ExternalProcessor";
}

/// The response body of a `Process` call: each answer's chunks (`Outgoing::chunks`) as DATA, then the gRPC status
/// as trailers (OK at the end of the exchange, else the error that ended it), as tonic's server writes them.
struct Answers {
    answers: ResponseStream,
    chunks: VecDeque<Bytes>,
    max_message_bytes: usize,
    ended: bool,
}

impl Body for Answers {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<HttpFrame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            if let Some(chunk) = this.chunks.pop_front() {
                return Poll::Ready(Some(Ok(HttpFrame::data(chunk))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            let status = match this.answers.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(answer))) => match answer.chunks(this.max_message_bytes) {
                    Ok(chunks) => {
                        this.chunks = chunks;
                        continue;
                    }
                    Err(status) => status,
                },
                Poll::Ready(Some(Err(status))) => status,
                Poll::Ready(None) => Status::ok(""),
            };
            this.ended = true;
            let mut trailers = http::HeaderMap::new();
            return Poll::Ready(Some(status.add_header(&mut trailers).map(|()| HttpFrame::trailers(trailers))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.chunks.is_empty()
    }
}

impl<B> Service<http::Request<B>> for ExtProc
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != PROCESS {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        // Envoy compresses nothing unless told to; a compressed stream is refused as tonic refuses an encoding it
        // was not given.
        if req.headers().get("grpc-encoding").is_some_and(|e| e != "identity") {
            return Box::pin(async { Ok(Status::unimplemented("grpc-encoding").into_http()) });
        }
        let (frame, max) = (self.frame.clone(), self.max_message_bytes);
        Box::pin(async move {
            let request = Request::from_http(req.map(|body| Streaming::new_request(Wire, body, None, Some(max))));
            let answers = Answers {
                answers: frame.process(request),
                chunks: VecDeque::new(),
                max_message_bytes: max,
                ended: false,
            };
            let mut response = http::Response::new(tonic::body::Body::new(answers));
            response
                .headers_mut()
                .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::header;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
    use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;

    /// The message as Envoy reads it: the chunks joined, the gRPC prefix checked and taken off.
    fn encoded(out: Outgoing) -> Vec<u8> {
        let len = out.encoded_len();
        let wire: Vec<u8> = out.chunks(usize::MAX).unwrap().iter().flat_map(|c| c.iter().copied()).collect();
        assert_eq!(wire[0], 0, "not compressed");
        assert_eq!(u32::from_be_bytes(wire[1..5].try_into().unwrap()) as usize, len);
        assert_eq!(wire.len(), GRPC_PREFIX + len, "the message is exactly as long as its prefix says");
        wire[GRPC_PREFIX..].to_vec()
    }

    #[test]
    fn a_body_written_from_segments_is_the_message_envoy_types_encode() {
        let big = Bytes::from(vec![7u8; 300]); // a length over one varint byte
        let large = Bytes::from(vec![9u8; BY_REFERENCE + 1]); // sent by reference
        for request in [true, false] {
            for body in [
                vec![],
                vec![Bytes::from_static(b"root")],
                vec![Bytes::from_static(b"<r/>"), big.slice(3..290)],
                vec![Bytes::from_static(b"<r/>"), large.clone(), big.clone(), large.slice(1..)],
                vec![large.clone()],
            ] {
                let set_headers = vec![header("content-length", "291"), header("content-type", "multipart/related")];
                let headers = HeaderMutation { set_headers, ..Default::default() };
                let out = || Outgoing::Body { request, headers: headers.clone(), body: body.clone() };
                let expected = out().into_message().encode_to_vec();
                assert_eq!(encoded(out()), expected);
                let decoded = ProcessingResponse::decode(expected.as_slice()).unwrap();
                assert_eq!(decoded, out().into_message());
            }
        }
        let message = Outgoing::Message(Box::default());
        assert_eq!(encoded(message), ProcessingResponse::default().encode_to_vec());
    }

    #[test]
    fn a_large_segment_goes_to_envoy_as_it_is_not_copied_into_the_message() {
        let large = Bytes::from(vec![9u8; 2 * BY_REFERENCE]);
        let body = vec![Bytes::from_static(b"<root/>"), large.slice(BY_REFERENCE / 2..), Bytes::from_static(b"--b--")];
        let out = Outgoing::Body { request: true, headers: HeaderMutation::default(), body };
        let chunks = out.chunks(usize::MAX).unwrap();
        assert_eq!(chunks.len(), 3, "the head with the root, the slice, the tail");
        assert_eq!(chunks[1].as_ptr(), large[BY_REFERENCE / 2..].as_ptr(), "the very bytes the engine was given");
        assert!(chunks[0].ends_with(b"<root/>") && chunks[2].as_ref() == b"--b--");
    }

    /// The messages Envoy reads from a streamed answer, each decoded with Envoy's types.
    fn messages(out: Outgoing) -> Vec<ProcessingResponse> {
        let wire: Vec<u8> = out.chunks(usize::MAX).unwrap().iter().flat_map(|c| c.iter().copied()).collect();
        let (mut rest, mut out) = (wire.as_slice(), Vec::new());
        while !rest.is_empty() {
            assert_eq!(rest[0], 0, "not compressed");
            let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
            out.push(ProcessingResponse::decode(&rest[GRPC_PREFIX..GRPC_PREFIX + len]).unwrap());
            rest = &rest[GRPC_PREFIX + len..];
        }
        out
    }

    #[test]
    fn a_streamed_answer_is_the_held_headers_then_the_body_in_chunks_ended_by_the_last() {
        use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
        use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
        let large = Bytes::from((0..5 * STREAM_CHUNK / 2).map(|i| i as u8).collect::<Vec<u8>>());
        for request in [true, false] {
            for body in [
                vec![],
                vec![Bytes::from_static(b"<root/>")],
                vec![Bytes::from_static(b"<root/>"), large.clone(), Bytes::from_static(b"--b--")],
                vec![large.slice(..STREAM_CHUNK), large.slice(STREAM_CHUNK..2 * STREAM_CHUNK)],
            ] {
                let set_headers = vec![header("content-type", "multipart/related; boundary=b")];
                let headers = HeaderMutation { set_headers, remove_headers: vec!["x-wsgate-user".into()] };
                let out = Outgoing::Streamed { request, headers: headers.clone(), body: body.clone() };
                let mut got = messages(out).into_iter();
                let head = match got.next().unwrap().response.unwrap() {
                    Out::RequestHeaders(h) if request => h,
                    Out::ResponseHeaders(h) if !request => h,
                    other => panic!("not the headers' answer first: {other:?}"),
                };
                assert_eq!(head.response.unwrap().header_mutation, Some(headers));
                let (mut joined, mut ends) = (Vec::new(), Vec::new());
                for message in got {
                    let r = match message.response.unwrap() {
                        Out::RequestBody(r) if request => r,
                        Out::ResponseBody(r) if !request => r,
                        other => panic!("not a body chunk: {other:?}"),
                    };
                    let Some(Mutation::StreamedResponse(chunk)) = r.response.unwrap().body_mutation.unwrap().mutation
                    else {
                        panic!("not streamed")
                    };
                    assert!(chunk.body.len() <= STREAM_CHUNK);
                    joined.extend_from_slice(&chunk.body);
                    ends.push(chunk.end_of_stream);
                }
                assert_eq!(joined, body.concat(), "the body as the segments joined");
                assert_eq!(ends.pop(), Some(true), "the last chunk ends the body");
                assert!(ends.iter().all(|e| !e), "only the last");
            }
        }
        // The large segment's bytes go to HTTP/2 as they are, sliced at the chunk boundaries.
        let out = Outgoing::Streamed { request: true, headers: HeaderMutation::default(), body: vec![large.clone()] };
        let inside = large.as_ptr_range();
        let by_reference = out.chunks(usize::MAX).unwrap().into_iter().filter(|c| inside.contains(&c.as_ptr()));
        assert_eq!(by_reference.map(|c| c.len()).sum::<usize>(), large.len());
    }

    /// Every frame of an `Answers` body: the DATA chunks joined, then the trailers' grpc-status.
    async fn frames(answers: Vec<Result<Outgoing, Status>>, max: usize) -> (Vec<u8>, String) {
        let stream: ResponseStream = Box::pin(futures_util::stream::iter(answers));
        let mut body = Answers { answers: stream, chunks: VecDeque::new(), max_message_bytes: max, ended: false };
        let (mut data, mut status) = (Vec::new(), String::new());
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            match frame.unwrap().into_data() {
                Ok(chunk) => data.extend_from_slice(&chunk),
                Err(trailers) => status = trailers.into_trailers().unwrap()["grpc-status"].to_str().unwrap().into(),
            }
        }
        assert!(body.is_end_stream());
        (data, status)
    }

    #[tokio::test]
    async fn answers_go_out_whole_and_in_order_then_the_status_as_trailers() {
        let large = Bytes::from(vec![5u8; BY_REFERENCE]);
        let body = |b: Vec<Bytes>| Outgoing::Body { request: true, headers: HeaderMutation::default(), body: b };
        let first = body(vec![Bytes::from_static(b"<r/>"), large.clone()]);
        let second = Outgoing::Message(Box::default());
        let wire: Vec<u8> =
            first.chunks(usize::MAX).unwrap().into_iter().chain(second.chunks(usize::MAX).unwrap()).flatten().collect();
        let answers =
            vec![Ok(body(vec![Bytes::from_static(b"<r/>"), large.clone()])), Ok(Outgoing::Message(Box::default()))];
        assert_eq!(frames(answers, usize::MAX).await, (wire.clone(), "0".into()));
        // An error ends the exchange with its status; an answer over the limit is never sent, only its status.
        let failed = vec![Ok(Outgoing::Message(Box::default())), Err(Status::internal("x"))];
        let wire_first: Vec<u8> =
            Outgoing::Message(Box::default()).chunks(usize::MAX).unwrap().into_iter().flatten().collect();
        assert_eq!(frames(failed, usize::MAX).await, (wire_first, (tonic::Code::Internal as i32).to_string()));
        let over = vec![Ok(body(vec![large]))];
        assert_eq!(frames(over, 100).await, (Vec::new(), (tonic::Code::OutOfRange as i32).to_string()));
    }

    #[test]
    fn an_answer_over_the_message_limit_is_an_error_not_sent() {
        let body = vec![Bytes::from(vec![1u8; 1000])];
        let out = Outgoing::Body { request: false, headers: HeaderMutation::default(), body };
        assert_eq!(out.chunks(999).unwrap_err().code(), tonic::Code::OutOfRange);
    }

    #[test]
    fn a_body_is_decoded_as_a_slice_of_the_received_buffer_not_a_copy() {
        let body = vec![1u8, 2, 3, 0, 255];
        let request = ProcessingRequest {
            request: Some(Req::ResponseBody(envoy_types::pb::envoy::service::ext_proc::v3::HttpBody {
                body: body.clone(),
                end_of_stream: true,
                ..Default::default()
            })),
            observability_mode: true, // a field the frame does not read: skipped
            ..Default::default()
        };
        let wire = Bytes::from(request.encode_to_vec());
        let Some(In::ResponseBody(got)) = Incoming::decode(wire.clone()).unwrap().request else { panic!() };
        assert_eq!((got.body.as_ref(), got.end_of_stream), (body.as_slice(), true));
        let inside = wire.as_ptr_range();
        assert!(inside.contains(&got.body.as_ptr()), "the body points into the received message");
    }
}
