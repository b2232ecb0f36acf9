//! Envoy's ext_proc messages as the frame reads and writes them, without copying a body on the way.
//!
//! The generated `ExternalProcessorServer` decodes a body into a `Vec<u8>` (a copy out of tonic's receive buffer)
//! and encodes a replaced body from one `Vec<u8>`. Here a body phase's body is decoded as a `Bytes` slice of
//! tonic's buffer (prost's `bytes` fields split it off: no copy), and a replaced body is written into tonic's send
//! buffer from its segments (the engine's new root part and slices of the body it was given): the encoded message
//! is the only copy. Everything else is Envoy's own message types.

use std::convert::Infallible;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::{HeaderMutation, HttpHeaders, HttpTrailers, ProcessingResponse};
use prost::bytes::{BufMut, Bytes};
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, message, WireType};
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};

use crate::service::{Frame, ResponseStream};

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
/// `body`'s segments joined.
pub enum Outgoing {
    Message(Box<ProcessingResponse>),
    Body { request: bool, headers: HeaderMutation, body: Vec<Bytes> },
}

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
    fn encoded_len(&self) -> usize {
        match self {
            Outgoing::Message(m) => m.encoded_len(),
            Outgoing::Body { request, headers, body } => {
                delimited_len(body_response_tag(*request), Nested::of(headers, body).body_response)
            }
        }
    }

    fn write(self, dst: &mut impl BufMut) {
        let (request, headers, body) = match self {
            Outgoing::Message(m) => return m.encode(dst).expect("the send buffer grows"),
            Outgoing::Body { request, headers, body } => (request, headers, body),
        };
        let n = Nested::of(&headers, &body);
        delimit(body_response_tag(request), n.body_response, dst);
        delimit(COMMON, n.common, dst);
        message::encode(HEADER_MUTATION, &headers, dst);
        delimit(BODY_MUTATION, n.mutation, dst);
        delimit(BODY, n.body, dst);
        for segment in &body {
            dst.put_slice(segment);
        }
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
        }
    }
}

fn body_response_tag(request: bool) -> u32 {
    if request {
        REQUEST_BODY_RESPONSE
    } else {
        RESPONSE_BODY_RESPONSE
    }
}

fn delimited_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

fn delimit(tag: u32, len: usize, dst: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, dst);
    encode_varint(len as u64, dst);
}

#[derive(Clone, Copy, Default)]
pub struct Wire;

impl Codec for Wire {
    type Encode = Outgoing;
    type Decode = Incoming;
    type Encoder = Wire;
    type Decoder = Wire;

    fn encoder(&mut self) -> Wire {
        Wire
    }

    fn decoder(&mut self) -> Wire {
        Wire
    }
}

impl Encoder for Wire {
    type Item = Outgoing;
    type Error = Status;

    fn encode(&mut self, item: Outgoing, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // Sized first: the send buffer grows once, not by copies as it doubles.
        dst.reserve(item.encoded_len());
        item.write(dst);
        Ok(())
    }
}

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

struct Process(Arc<Frame>);

impl StreamingService<Incoming> for Process {
    type Response = Outgoing;
    type ResponseStream = ResponseStream;
    type Future = BoxFuture<Response<ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<Incoming>>) -> Self::Future {
        let frame = self.0.clone();
        Box::pin(async move { Ok(frame.process(request)) })
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
        let (frame, max) = (self.frame.clone(), Some(self.max_message_bytes));
        Box::pin(async move {
            let mut grpc = Grpc::new(Wire).apply_max_message_size_config(max, max);
            Ok(grpc.streaming(Process(frame), req).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::header;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
    use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;

    fn encoded(out: Outgoing) -> Vec<u8> {
        let len = out.encoded_len();
        let mut v = Vec::new();
        out.write(&mut v);
        assert_eq!(v.len(), len, "the message is exactly as long as reserved");
        v
    }

    #[test]
    fn a_body_written_from_segments_is_the_message_envoy_types_encode() {
        let big = Bytes::from(vec![7u8; 300]); // a length over one varint byte
        for request in [true, false] {
            for body in
                [vec![], vec![Bytes::from_static(b"root")], vec![Bytes::from_static(b"<r/>"), big.slice(3..290)]]
            {
                let set_headers = vec![header("content-length", "291"), header("content-type", "multipart/related")];
                let headers = HeaderMutation { set_headers, ..Default::default() };
                let out = || Outgoing::Body { request, headers: headers.clone(), body: body.clone() };
                let expected = out().into_message().encode_to_vec();
                assert_eq!(encoded(out()), expected);
                let decoded = ProcessingResponse::decode(expected.as_slice()).unwrap();
                assert_eq!(decoded, out().into_message());
            }
        }
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
