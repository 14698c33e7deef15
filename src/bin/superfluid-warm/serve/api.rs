//! The HTTP API: what each path does, and how what is refused is said (OpenAI's error shape).
//! `POST /v1/completions` and `/v1/chat/completions` are routed and proxied; `POST /v1/route`
//! decides without proxying, for a gateway that proxies itself, and `POST /v1/route/done` ends
//! such a decision; `GET /v1/models` and `GET /health` answer from the head.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::body::{Bytes, Incoming};
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

use super::Head;
use super::engines::Flight;
use super::prompt::{Kind, OpenAiRequest, Tokens, read_request, tokens};
use super::proxy::{Failed, Out, Warmth, forward, full, pick, warmth};

/// Largest request body taken.
const MAX_BODY_BYTES: usize = 64 << 20;

/// A `/v1/route` decision not yet reported done is dropped after this long.
const TICKET_TTL: Duration = Duration::from_secs(600);

/// First wait before the next engine is tried; doubled each try.
const FIRST_BACKOFF: Duration = Duration::from_millis(20);

/// `/v1/route`'s open decisions: the load each keeps on its engine.
#[derive(Default)]
pub(crate) struct Tickets {
    next: AtomicU64,
    open: Mutex<HashMap<u64, (Flight, Instant)>>,
}

impl Tickets {
    /// Ends the decisions older than [`TICKET_TTL`] (their load off the engines).
    pub(crate) fn sweep(&self) {
        let expired: Vec<(Flight, Instant)> = match self.open.lock() {
            Ok(mut open) => {
                let old: Vec<u64> =
                    open.iter().filter(|(_, (_, at))| at.elapsed() >= TICKET_TTL).map(|(t, _)| *t).collect();
                old.iter().filter_map(|t| open.remove(t)).collect()
            }
            Err(_) => Vec::new(),
        };
        drop(expired);
    }

    /// Ends every open decision.
    pub(crate) fn clear(&self) {
        let open = self.open.lock().map(|mut open| std::mem::take(&mut *open)).unwrap_or_default();
        drop(open);
    }
}

/// An answer in OpenAI's error shape.
pub(crate) fn error(status: StatusCode, message: &str) -> Response<Out> {
    let kind = match status.as_u16() {
        400 | 413 | 422 => "invalid_request_error",
        404 => "not_found_error",
        405 => "method_not_allowed",
        _ => "service_unavailable",
    };
    let body = json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
    json_response(status, &body)
}

fn json_response(status: StatusCode, body: &Value) -> Response<Out> {
    let mut response = Response::new(full(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    response
}

/// What the head serves.
const SERVED: &str = "POST /v1/completions, POST /v1/chat/completions, POST /v1/route, POST /v1/route/done, \
GET /v1/models, GET /health";

/// Answers one request.
pub(crate) async fn handle(head: Arc<Head>, request: Request<Incoming>) -> Response<Out> {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let kind = match path.as_str() {
        "/v1/completions" => Some(Kind::Completion),
        "/v1/chat/completions" => Some(Kind::Chat),
        _ => None,
    };
    match (&method, path.as_str()) {
        (&Method::GET, "/health") => health(&head),
        (&Method::GET, "/v1/models") => models(&head),
        (&Method::POST, "/v1/completions" | "/v1/chat/completions" | "/v1/route" | "/v1/route/done") => {
            let (parts, body) = request.into_parts();
            let bytes = match read_body(body).await {
                Ok(b) => b,
                Err(response) => return *response,
            };
            match (path.as_str(), kind) {
                ("/v1/route", _) => route(&head, &bytes).await,
                ("/v1/route/done", _) => route_done(&head, &bytes),
                (_, Some(kind)) => proxy(&head, kind, method, &path, &parts.headers, bytes).await,
                _ => error(StatusCode::NOT_FOUND, "not served"),
            }
        }
        (_, "/health" | "/v1/models" | "/v1/completions" | "/v1/chat/completions" | "/v1/route" | "/v1/route/done") => {
            error(StatusCode::METHOD_NOT_ALLOWED, &format!("{method} {path} is not served; this head serves {SERVED}"))
        }
        _ => error(StatusCode::NOT_FOUND, &format!("{method} {path} is not served; this head serves {SERVED}")),
    }
}

/// The body, whole, up to [`MAX_BODY_BYTES`].
async fn read_body(body: Incoming) -> Result<Bytes, Box<Response<Out>>> {
    let limited = http_body_util::Limited::new(body, MAX_BODY_BYTES);
    match limited.collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(Box::new(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("the request body is over {} MiB", MAX_BODY_BYTES >> 20),
        ))),
        Err(e) => Err(Box::new(error(StatusCode::BAD_REQUEST, &format!("the request body could not be read: {e}")))),
    }
}

/// The body as an OpenAI request naming the head's model.
fn parse_request<'a>(
    head: &Head,
    bytes: &'a [u8],
    apart: &'a mut Vec<u8>,
) -> Result<OpenAiRequest<'a>, Box<Response<Out>>> {
    let refuse = |why: String| Box::new(error(StatusCode::BAD_REQUEST, &why));
    if bytes.iter().find(|b| !b.is_ascii_whitespace()).is_none_or(|b| *b != b'{') {
        return Err(refuse(match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
            Ok(_) => "the body must be a JSON object".into(),
            Err(e) => format!("the body is not JSON: {e}"),
        }));
    }
    let request = read_request(bytes, apart).map_err(|e| refuse(format!("the body is not an OpenAI request: {e}")))?;
    match request.model.as_deref() {
        Some(m) if m == head.model => Ok(request),
        Some(m) => Err(Box::new(error(
            StatusCode::NOT_FOUND,
            &format!("The model `{m}` does not exist; this head serves `{}`", head.model),
        ))),
        None => Err(refuse("the body names no model".into())),
    }
}

/// The prompt's tokens and the index's answer for them.
async fn decide_warmth(
    head: &Arc<Head>,
    kind: Kind,
    request: &mut OpenAiRequest<'_>,
    early: bool,
) -> (Warmth, Option<String>) {
    match tokens(head, kind, request, early).await {
        Tokens::Ids { count, took, lookup } => (warmth(head, Some((count, lookup)), took).await, None),
        Tokens::Unrendered(why) => (warmth(head, None, None).await, Some(why)),
    }
}

/// The body asking for a stream's usage: `stream_options.include_usage` set, the rest as the
/// client wrote it.
fn with_usage(bytes: &Bytes, request: &OpenAiRequest<'_>) -> Bytes {
    // `"stream_options": null` reads as none, but is a member all the same.
    let named = bytes.windows(16).any(|w| w == b"\"stream_options\"");
    match request.stream_options {
        // No options: one more member at the object's start.
        None if !named => {
            let open = bytes.iter().position(|b| *b == b'{').map_or(0, |i| i + 1);
            let mut out = Vec::with_capacity(bytes.len() + 40);
            out.extend_from_slice(bytes.get(..open).unwrap_or_default());
            out.extend_from_slice(br#""stream_options":{"include_usage":true},"#);
            out.extend_from_slice(bytes.get(open..).unwrap_or_default());
            // `{}` would have become `{...,}`: an empty object has no member to follow.
            if serde_json::from_slice::<serde::de::IgnoredAny>(&out).is_ok() {
                return Bytes::from(out);
            }
            Bytes::from(bytes.to_vec())
        }
        // Options of its own: merged.
        _ => {
            let Ok(mut body) = serde_json::from_slice::<Value>(bytes) else { return bytes.clone() };
            if let Some(map) = body.as_object_mut() {
                let options = map.entry("stream_options").or_insert_with(|| json!({}));
                if !options.is_object() {
                    *options = json!({});
                }
                if let Some(options) = options.as_object_mut() {
                    options.insert("include_usage".into(), Value::Bool(true));
                }
            }
            Bytes::from(body.to_string())
        }
    }
}

/// Routes a completion or chat and proxies it, trying the next engine on a failure before the
/// client had a byte.
async fn proxy(
    head: &Arc<Head>,
    kind: Kind,
    method: Method,
    path: &str,
    headers: &hyper::HeaderMap,
    bytes: Bytes,
) -> Response<Out> {
    if head.stopping.load(Relaxed) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the head is stopping");
    }
    let read = Instant::now();
    let mut apart = Vec::new();
    let mut request = match parse_request(head, &bytes, &mut apart) {
        Ok(r) => r,
        Err(response) => return *response,
    };
    // Undecided until the choice: a long prompt decided meanwhile waits for it (`gather.rs`).
    let mut pending = Some(head.gather.arrive(read));
    let (mut warmth, unrendered) = decide_warmth(head, kind, &mut request, head.route_on_start).await;
    if let Some(why) = &unrendered {
        tracing::debug!(why = %why, "a prompt not rendered into tokens: routed on load");
    }
    // A stream is asked for its usage (to read `cached_tokens`); the usage event goes to the
    // client only if it asked for it.
    let client_usage = request
        .stream_options
        .and_then(|o| serde_json::from_str::<Value>(o.get()).ok())
        .and_then(|o| o.get("include_usage").and_then(Value::as_bool))
        == Some(true);
    let strip_usage = request.stream == Some(true) && !client_usage;
    let body = if strip_usage { with_usage(&bytes, &request) } else { bytes.clone() };
    // What the decision took, for the client and an operator (`server-timing`, milliseconds).
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    // Routed on its start: the tokenizing is of the start, and says so.
    let start = if warmth.rest.is_some() { ";desc=\"start\"" } else { "" };
    let timing = match warmth.tokenize {
        Some(t) => format!("tokenize;dur={:.3}{start}, index;dur={:.3}", ms(t), ms(warmth.lookup)),
        None => format!("index;dur={:.3}", ms(warmth.lookup)),
    };
    // The whole decision, from the body read to the choice (its first try).
    let timing = format!("{timing}, decision;dur={:.3}", ms(read.elapsed()));
    let mut tried = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut last_answer: Option<Failed> = None;
    let mut backoff = FIRST_BACKOFF;
    for attempt in 0..head.attempts {
        let Some((engine, priced)) = pick(head, &warmth, &tried) else { break };
        tried.push(engine);
        let predicted = priced.iter().find(|(i, _)| *i == engine).map_or(0, |(_, p)| p.warm_tokens as u64);
        head.tally.sent(engine, unrendered.is_none());
        let mut flight = Flight::start(head, engine, warmth.tokens as u64, predicted);
        // Routed on the prompt's start: once the rest is tokenized, the whole prompt is claimed
        // for the first engine tried, and its prefill counted there at its true length.
        if let Some(rest) = warmth.rest.take() {
            let (h, resize) = (Arc::clone(head), flight.resizer());
            drop(tokio::spawn(async move {
                if let Ok((prefix, tokens)) = rest.await {
                    resize(&h, tokens as u64);
                    h.claim(prefix, engine);
                }
            }));
        }
        flight.claim = warmth.prefix.clone();
        if let Some(pending) = pending.take() {
            let waited = pending.decided(warmth.tokens.saturating_sub(predicted as usize)).await;
            if !waited.is_zero() {
                superfluid_warm::record_gathered(waited);
            }
        }
        match forward(flight, method.clone(), path, headers, body.clone(), strip_usage, &timing).await {
            Ok(response) => return response,
            Err((flight, failed)) => {
                let name = head.engines.get(engine).map_or("?", |e| e.name.as_str());
                tracing::warn!(engine = name, reason = failed.reason, detail = %failed.detail, attempt, "an engine failed a request; trying the next");
                flight.failed(failed.reason);
                failures.push(failed.detail.clone());
                last_answer = Some(failed);
            }
        }
        tokio::time::sleep(backoff).await;
        backoff *= 2;
    }
    // Every try failed: the last engine's own 5xx if it gave one, else a 503 saying why.
    if let Some(Failed { answer: Some((status, headers, body)), .. }) = last_answer {
        let mut response = Response::new(full(body));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response.headers_mut().remove(hyper::header::CONTENT_LENGTH);
        response.headers_mut().remove(hyper::header::TRANSFER_ENCODING);
        return response;
    }
    let why = if failures.is_empty() { "no engine to send it to".to_string() } else { failures.join("; ") };
    error(StatusCode::SERVICE_UNAVAILABLE, &format!("no engine could take the request: {why}"))
}

/// `POST /v1/route`: the decision without the proxying. The body is a completion or chat request
/// (or `{"model": M, "prompt": [ids]}`); the answer names the engine, and prices every engine.
/// The decision keeps its load on the engine until `/v1/route/done` (or 10 minutes).
async fn route(head: &Arc<Head>, bytes: &[u8]) -> Response<Out> {
    let mut apart = Vec::new();
    let mut request = match parse_request(head, bytes, &mut apart) {
        Ok(r) => r,
        Err(response) => return *response,
    };
    let kind = if request.messages.is_some() { Kind::Chat } else { Kind::Completion };
    let (warmth, unrendered) = decide_warmth(head, kind, &mut request, false).await;
    let Some((engine, priced)) = pick(head, &warmth, &[]) else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "no engine to route to");
    };
    if let Some(prefix) = &warmth.prefix {
        head.claim(prefix.clone(), engine);
    }
    head.tally.sent(engine, unrendered.is_none());
    let predicted = priced.iter().find(|(i, _)| *i == engine).map_or(0, |(_, p)| p.warm_tokens as u64);
    let flight = Flight::start(head, engine, warmth.tokens as u64, predicted);
    let ticket = head.tickets.next.fetch_add(1, Relaxed) + 1;
    head.tickets.sweep();
    if let Ok(mut open) = head.tickets.open.lock() {
        open.insert(ticket, (flight, Instant::now()));
    }
    let engines: Vec<Value> = priced
        .iter()
        .filter_map(|(i, p)| {
            let e = head.engines.get(*i)?;
            let hit = warmth.hits.iter().find(|h| h.node == e.name);
            let load = e.load();
            Some(json!({
                "engine": e.name, "url": format!("http://{}", e.authority),
                "warm_tokens": p.warm_tokens, "gpu_tokens": hit.map_or(0, |h| h.gpu_tokens),
                "tier": hit.map(|h| format!("{:?}", h.tier).to_uppercase()),
                "credited_tokens": p.credited, "cost": p.cost, "events_up": e.events_up.load(Relaxed),
                "load": {"in_flight": load.in_flight, "prefill_tokens": load.prefill_tokens, "decoding": load.decoding},
            }))
        })
        .collect();
    let chosen = head.engines.get(engine);
    json_response(
        StatusCode::OK,
        &json!({
            "engine": chosen.map(|e| e.name.clone()),
            "url": chosen.map(|e| format!("http://{}", e.authority)),
            "ticket": ticket,
            "prompt_tokens": warmth.tokens,
            "predicted_tokens": predicted,
            "unrendered": unrendered,
            "took_us": {
                "tokenize": warmth.tokenize.map(|t| t.as_secs_f64() * 1e6),
                "lookup": warmth.lookup.as_secs_f64() * 1e6,
            },
            "engines": engines,
        }),
    )
}

/// `POST /v1/route/done`: `{"ticket": N, "cached_tokens": C?}` ends a decision (its load off;
/// its prediction counted against `cached_tokens`, if given).
fn route_done(head: &Head, bytes: &[u8]) -> Response<Out> {
    let body: Value = match serde_json::from_slice(bytes) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("the body is not JSON: {e}")),
    };
    let Some(ticket) = body.get("ticket").and_then(Value::as_u64) else {
        return error(StatusCode::BAD_REQUEST, "the body names no ticket (a number /v1/route gave)");
    };
    let flight = head.tickets.open.lock().ok().and_then(|mut open| open.remove(&ticket));
    let Some((mut flight, _)) = flight else {
        return error(
            StatusCode::NOT_FOUND,
            &format!("no open decision {ticket} (done already, or older than 10 minutes)"),
        );
    };
    flight.first_token();
    flight.cached = body.get("cached_tokens").and_then(Value::as_u64);
    drop(flight);
    json_response(StatusCode::OK, &json!({"ticket": ticket, "done": true}))
}

/// `GET /v1/models`: the head's model.
fn models(head: &Head) -> Response<Out> {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [{"id": head.model, "object": "model", "owned_by": "superfluid-warm"}]}),
    )
}

/// `GET /health`: each engine (in the choice, its events up, its load); 200 while one engine is
/// in the choice, else 503.
fn health(head: &Head) -> Response<Out> {
    let engines: Vec<Value> = head
        .engines
        .iter()
        .map(|e| {
            let load = e.load();
            json!({
                "engine": e.name, "url": format!("http://{}", e.authority),
                "up": !e.ejected.load(Relaxed), "events": e.has_events, "events_up": e.events_up.load(Relaxed),
                "in_doubt": e.in_doubt.load(Relaxed),
                "in_flight": load.in_flight, "prefill_tokens": load.prefill_tokens, "decoding": load.decoding,
            })
        })
        .collect();
    let up = head.engines.iter().filter(|e| !e.ejected.load(Relaxed)).count();
    // With --nats: the link to the stream the heads share.
    let sharing = match &head.index {
        crate::listen::Sink::Shared(shared) => {
            let s = shared.share_stats();
            json!({
                "stream": s.stream, "head": s.head, "connected": s.connected, "applied": s.applied,
                "unapplied": s.unapplied, "published": s.published, "buffered": s.buffered,
                "error": s.error, "halted": s.halted,
            })
        }
        crate::listen::Sink::Own(_) => Value::Null,
    };
    let status = if up > 0 && !head.stopping.load(Relaxed) { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    json_response(
        status,
        &json!({
            "status": if status == StatusCode::OK { "ok" } else { "unavailable" },
            "engines_up": up, "engines": engines, "sharing": sharing,
            "claims_handed": head.claims_handed.load(Relaxed),
            "claims_dropped": head.claims_dropped.load(Relaxed),
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage_of(body: &str) -> Value {
        let bytes = Bytes::from(body.to_string());
        let request: OpenAiRequest<'_> = serde_json::from_slice(&bytes).expect("a request");
        serde_json::from_slice(&with_usage(&bytes, &request)).expect("still JSON")
    }

    #[test]
    fn a_stream_is_asked_for_its_usage_and_keeps_the_rest_of_its_body() {
        let body = usage_of(r#" {"model":"m","stream":true,"messages":[{"role":"user","content":"{x}"}]}"#);
        assert_eq!(body["stream_options"], json!({"include_usage": true}));
        assert_eq!(body["messages"][0]["content"], "{x}");
        let body = usage_of(r#"{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true}}"#);
        assert_eq!(body["stream_options"], json!({"continuous_usage_stats": true, "include_usage": true}));
        let body = usage_of(r#"{"model":"m","stream":true,"stream_options":null}"#);
        assert_eq!(body["stream_options"], json!({"include_usage": true}));
    }
}
