//! The choice and the proxying: the index's answer under its deadline, the engines priced, the
//! request sent to the cheapest (the next on a failure before the client had a byte), and the
//! answer passed back, a stream event by event, with the engine's `cached_tokens` read on the way.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Bytes, Frame};
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::Value;
use superfluid_warm::{Candidate, Hit, Prefix, Priced, choose, record_decision, record_load_only};

use super::Head;
use super::api::error;
use super::engines::{Engine, Flight};
use super::upstream::{EngineBody, SendError};

/// The body of every answer the head gives.
pub(crate) type Out = BoxBody<Bytes, hyper::Error>;

/// A whole body.
pub(crate) fn full(bytes: impl Into<Bytes>) -> Out {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed()
}

/// What the index says of a prompt: its hash (to claim it) and the engines' warm prefixes.
pub(crate) struct Warmth {
    pub(crate) prefix: Option<Prefix>,
    pub(crate) hits: Vec<Hit>,
    pub(crate) tokens: usize,
    /// The whole prompt, to come, when `prefix` is its start's (the prompt was routed on its
    /// start; `tokens` is then estimated).
    pub(crate) rest: Option<Rest>,
    /// How long rendering the prompt into tokens took (`None`: given as ids, or not rendered).
    pub(crate) tokenize: Option<Duration>,
    /// How long hashing it and the index's answer took.
    pub(crate) lookup: Duration,
}

/// The index's answer for a prompt: its hash, and every node's warm prefix.
pub(crate) type Answer = (Prefix, superfluid_warm::Result<Vec<Hit>>);

/// A prompt routed on its start, once the rest is tokenized: the whole prompt's prefix (to
/// claim) and its tokens (the estimate's correction).
pub(crate) type Rest = tokio::sync::oneshot::Receiver<(Prefix, usize)>;

/// How long lookups go to the blocking pool, under the deadline, after one on a request's own
/// thread ran past it.
const HANDED_OVER_FOR: Duration = Duration::from_secs(10);

/// The index's answer for a prompt's tokens: still to ask, or asked by the render (the answer
/// and how long it took from the render's end, or past the deadline how long was waited; with
/// the whole prompt's prefix to come when the answer was for its start).
pub(crate) enum Lookup {
    Ids(Vec<u32>),
    Rendered(Result<(Answer, Duration), Duration>, Option<Rest>),
}

/// The index's answer for `tokens`, here and now.
pub(crate) fn lookup_now(head: &Head, tokens: &[u32]) -> Answer {
    let index = head.index.read();
    let prefix = index.prefix(&head.namespace, tokens);
    let hits = index.warm_nodes_prefix(&prefix);
    (prefix, hits)
}

impl Head {
    /// Whether a prompt given as ids is looked up on the request's own thread: yes while the
    /// index answers within the deadline (a hand-over to another thread and back costs more
    /// than a lookup, ~100 µs of wake-ups on an idle core); for [`HANDED_OVER_FOR`] after one
    /// did not, lookups go to the blocking pool, and a request whose answer is late goes by
    /// load.
    pub(crate) fn lookup_inline(&self) -> bool {
        self.hand_over_until.load(Relaxed) <= self.born.elapsed().as_micros() as u64
    }

    /// A rendered prompt's answer, which took `looked` to ask: used within the deadline (with
    /// `waited`, the time from the render's end), else not (only how long was waited).
    pub(crate) fn in_time(
        &self,
        answer: Answer,
        looked: Duration,
        waited: Duration,
    ) -> Result<(Answer, Duration), Duration> {
        if looked > self.deadline { Err(waited) } else { Ok((answer, waited)) }
    }

    /// Looks `tokens` up on this thread (and how long that took), noting a lookup past the
    /// deadline.
    pub(crate) fn lookup_here(&self, tokens: &[u32]) -> (Answer, Duration) {
        let started = Instant::now();
        let answer = lookup_now(self, tokens);
        let took = started.elapsed();
        self.read_here(took, "lookup");
        (answer, took)
    }

    /// Notes a read of the index on a request's own thread (`what`: a lookup or a claim) that
    /// took `took`: past the deadline, lookups go to the blocking pool and claims to the claim
    /// thread for [`HANDED_OVER_FOR`].
    pub(crate) fn read_here(&self, took: Duration, what: &str) {
        if took > self.deadline {
            let until = (self.born.elapsed() + HANDED_OVER_FOR).as_micros() as u64;
            self.hand_over_until.store(until, Relaxed);
            tracing::warn!(
                took_ms = took.as_secs_f64() * 1e3,
                "a {what} ran past the deadline: lookups go to the blocking pool, and claims to the claim thread, for {} s",
                HANDED_OVER_FOR.as_secs()
            );
        }
    }
}

/// The index's answer for a prompt of `count` tokens, on this thread while the index is quick,
/// else on the blocking pool within the head's deadline; past it, or on an error, none (the
/// request goes by load, counted). `None`: the prompt was not rendered.
pub(crate) async fn warmth(head: &Arc<Head>, lookup: Option<(usize, Lookup)>, tokenize: Option<Duration>) -> Warmth {
    let Some((n, lookup)) = lookup else {
        record_load_only("unrendered");
        return Warmth {
            prefix: None,
            hits: Vec::new(),
            tokens: 0,
            rest: None,
            tokenize: None,
            lookup: Duration::ZERO,
        };
    };
    let (looked, rest) = match lookup {
        Lookup::Ids(tokens) if head.lookup_inline() => (Ok(head.lookup_here(&tokens)), None),
        Lookup::Ids(tokens) => (handed_over(head, tokens).await, None),
        Lookup::Rendered(looked, rest) => (looked, rest),
    };
    let ((prefix, answer), lookup) = match looked {
        Ok(looked) => looked,
        Err(lookup) => {
            record_load_only("late");
            record_decision(tokenize, lookup);
            return Warmth { prefix: None, hits: Vec::new(), tokens: n, rest, tokenize, lookup };
        }
    };
    let hits = answer.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "the index did not answer: routed on load");
        record_load_only("error");
        Vec::new()
    });
    record_decision(tokenize, lookup);
    Warmth { prefix: Some(prefix), hits, tokens: n, rest, tokenize, lookup }
}

/// The index's answer for `tokens` from the blocking pool, and how long it took; past the
/// deadline, how long was waited (a deadline of 0 never waits).
async fn handed_over(head: &Arc<Head>, tokens: Vec<u32>) -> Result<(Answer, Duration), Duration> {
    if head.deadline.is_zero() {
        return Err(Duration::ZERO);
    }
    let started = Instant::now();
    let (answered, answer) = tokio::sync::oneshot::channel();
    let h = Arc::clone(head);
    drop(tokio::task::spawn_blocking(move || {
        let _ = answered.send(lookup_now(&h, &tokens));
    }));
    within_deadline(head, answer, started).await
}

/// `answer`, asked at `since` on another thread, within the deadline from then; past it, how
/// long was waited.
async fn within_deadline(
    head: &Head,
    answer: tokio::sync::oneshot::Receiver<Answer>,
    since: Instant,
) -> Result<(Answer, Duration), Duration> {
    let left = head.deadline.saturating_sub(since.elapsed());
    match tokio::time::timeout(left, answer).await {
        Ok(Ok(answer)) => Ok((answer, since.elapsed())),
        Ok(Err(_)) | Err(_) => Err(since.elapsed()),
    }
}

/// The cheapest engine for the prompt, of those not in `tried`: engines in the choice, or, when
/// none is left, the ejected ones (a head that refuses all is worse than one that tries). With
/// every engine's price, for `/v1/route`.
pub(crate) fn pick(head: &Head, warmth: &Warmth, tried: &[usize]) -> Option<(usize, Vec<(usize, Priced)>)> {
    let open = |ejected_too: bool| -> Vec<usize> {
        (0..head.engines.len())
            .filter(|i| !tried.contains(i))
            .filter(|&i| ejected_too || head.engines.get(i).is_some_and(|e| !e.ejected.load(Relaxed)))
            .collect()
    };
    let mut indices = open(false);
    if indices.is_empty() {
        indices = open(true);
    }
    let candidates: Vec<Candidate<'_>> = indices
        .iter()
        .filter_map(|&i| head.engines.get(i))
        .map(|e| {
            let c = Candidate::new(&e.name, e.load());
            // An engine whose event stream is down, or that was ejected and has published
            // nothing since, is priced on load alone.
            let current = e.events_up.load(Relaxed) && !e.in_doubt.load(Relaxed);
            match warmth.hits.iter().find(|h| h.node == e.name).filter(|_| current) {
                Some(hit) => c.holding(hit.tokens, hit.gpu_tokens, hit.tier),
                None => c,
            }
        })
        .collect();
    let turn = head.turn.fetch_add(1, Relaxed);
    let (best, priced) = choose(warmth.tokens, &candidates, &head.costs, turn)?;
    let best = *indices.get(best)?;
    if warmth.prefix.is_some() && head.engines.get(best).is_some_and(|e| !e.events_up.load(Relaxed)) {
        record_load_only("no_events");
    }
    Some((best, indices.into_iter().zip(priced).collect()))
}

/// Why a try failed before the client had a byte, for the next try and the refusal.
pub(crate) struct Failed {
    pub(crate) reason: &'static str,
    pub(crate) detail: String,
    /// The engine's own 5xx answer, for the client if no engine does better.
    pub(crate) answer: Option<(StatusCode, HeaderMap, Bytes)>,
}

/// Sends the request to the flight's engine and gives the client's answer: a stream relayed
/// event by event (the usage event the head asked for itself left out), or a whole body. The
/// answer names the engine, the warm tokens predicted, and the decision's parts' times
/// (`server-timing`, `timing`).
pub(crate) async fn forward(
    mut flight: Flight,
    method: Method,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
    strip_usage: bool,
    timing: &str,
) -> Result<Response<Out>, (Flight, Failed)> {
    let head = Arc::clone(&flight.head);
    let Some(engine) = head.engines.get(flight.engine) else {
        let failed = Failed { reason: "gone", detail: "no such engine".into(), answer: None };
        return Err((flight, failed));
    };
    let name = engine.name.clone();
    let fail = |reason, detail: String| Failed { reason, detail, answer: None };
    let mut request = Request::builder().method(method).uri(path).header(HOST, engine.authority.as_str());
    for (k, v) in headers {
        if !hop_by_hop(k.as_str()) && k != HOST && k != CONTENT_LENGTH {
            request = request.header(k, v);
        }
    }
    let request = match request.body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => return Err((flight, fail("request", e.to_string()))),
    };
    // The first poll writes the request to the engine (on a connection kept open); the claim
    // comes after it, so that the engine starts on the request meanwhile.
    let mut sending = std::pin::pin!(engine.connections.send(&engine.authority, request));
    let first = std::future::poll_fn(|cx| Poll::Ready(sending.as_mut().poll(cx))).await;
    if let Some(prefix) = flight.claim.take() {
        flight.head.claim(prefix, flight.engine);
    }
    let sent = match first {
        Poll::Ready(sent) => sent,
        Poll::Pending => sending.await,
    };
    let response = match sent {
        Ok(r) => r,
        Err(e @ SendError::Connect(_)) => return Err((flight, fail("connect", format!("{name}: {e}")))),
        Err(e) => return Err((flight, fail("reset", format!("{name}: {e}")))),
    };
    let (parts, incoming) = response.into_parts();
    if parts.status.is_server_error() {
        let bytes = incoming.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let failed = Failed {
            reason: "5xx",
            detail: format!("{name} answered {}", parts.status),
            answer: Some((parts.status, parts.headers, bytes)),
        };
        return Err((flight, failed));
    }
    flight.answered();
    let mut answer = Response::builder().status(parts.status);
    for (k, v) in &parts.headers {
        if !hop_by_hop(k.as_str()) && k != CONTENT_LENGTH {
            answer = answer.header(k, v);
        }
    }
    answer = answer
        .header("x-superfluid-warm-engine", HeaderValue::from_str(&name).unwrap_or(HeaderValue::from_static("?")))
        .header("x-superfluid-warm-predicted", flight.predicted)
        .header("server-timing", timing);
    let is_stream = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let body = if is_stream {
        Relay { inner: incoming, scan: Scan { pending: Vec::new(), strip_usage }, flight: Some(flight) }.boxed()
    } else {
        let bytes = match incoming.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                // Headers came, the body did not: the client has had nothing yet.
                return Err((flight, fail("reset", format!("{name}: {e}"))));
            }
        };
        flight.first_token();
        if parts.status.is_success()
            && let Ok(answer) = serde_json::from_slice::<Value>(&bytes)
        {
            flight.usage(&answer);
        }
        drop(flight);
        full(bytes)
    };
    Ok(answer
        .body(body)
        .unwrap_or_else(|e| error(StatusCode::BAD_GATEWAY, &format!("{name}'s answer could not be passed on: {e}"))))
}

/// An answer's or a stream's usage event's `usage`: its `prompt_tokens` and its
/// `prompt_tokens_details.cached_tokens`, each if told.
fn usage(answer: &Value) -> (Option<u64>, Option<u64>) {
    let Some(usage) = answer.get("usage") else { return (None, None) };
    let prompt = usage.get("prompt_tokens").and_then(Value::as_u64);
    (prompt, usage.get("prompt_tokens_details").and_then(|d| d.get("cached_tokens")).and_then(Value::as_u64))
}

impl Flight {
    /// What the engine's answer (or usage event) tells of the request: the tokens it cached,
    /// and its prompt's (the head's count is an estimate for a prompt routed on its start).
    fn usage(&mut self, answer: &Value) {
        let (prompt, cached) = usage(answer);
        if let Some(cached) = cached {
            self.cached = Some(cached);
        }
        if let Some(prompt) = prompt {
            self.prompt = prompt;
        }
    }
}

/// Headers that describe one connection, not the message (RFC 9110 7.6.1).
fn hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "proxy-authenticate"
            | "proxy-authorization"
    )
}

/// A stream relayed to the client event by event. Dropped before its end (the client went
/// away), it drops the engine's response, whose connection is then closed rather than pooled:
/// vLLM cancels the request.
struct Relay {
    inner: EngineBody,
    scan: Scan,
    flight: Option<Flight>,
}

/// Reads a server-sent-events stream: the first event is the first token, a usage event tells
/// `cached_tokens` (and is left out if the head asked for it, not the client).
struct Scan {
    pending: Vec<u8>,
    strip_usage: bool,
}

/// Past this many bytes without an event's end, the stream is passed on as it is.
const MAX_EVENT_BYTES: usize = 1 << 20;

impl Scan {
    /// Takes `data` in; gives what goes to the client now.
    fn feed(&mut self, data: &[u8], flight: &mut Flight) -> Vec<u8> {
        self.pending.extend_from_slice(data);
        let mut out = Vec::new();
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            if self.keep(&event, flight) {
                out.extend_from_slice(&event);
            }
        }
        if self.pending.len() > MAX_EVENT_BYTES {
            out.append(&mut self.pending);
        }
        out
    }

    /// Whether an event goes to the client; reads it on the way.
    fn keep(&self, event: &[u8], flight: &mut Flight) -> bool {
        let Some(data) = event.strip_prefix(b"data: ") else { return true };
        flight.first_token();
        if !contains(data, b"\"usage\":{") && !contains(data, b"\"usage\": {") {
            return true;
        }
        let Ok(chunk) = serde_json::from_slice::<Value>(data) else { return true };
        flight.usage(&chunk);
        let no_choices = chunk.get("choices").and_then(Value::as_array).is_some_and(Vec::is_empty);
        !(self.strip_usage && no_choices)
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

impl Body for Relay {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        loop {
            let Some(flight) = this.flight.as_mut() else { return Poll::Ready(None) };
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let out = this.scan.feed(&data, flight);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                        }
                    }
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Poll::Ready(Some(Err(e))) => {
                    // After the first byte: the failure is the client's to see.
                    this.flight = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    let rest = std::mem::take(&mut this.scan.pending);
                    // Ends the flight: its load off, its prediction recorded.
                    this.flight = None;
                    if rest.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(rest)))));
                }
            }
        }
    }
}

/// A GET of `path` on `engine`, on one of its connections: its status and JSON body
/// (`Null` if not JSON).
///
/// # Errors
/// What failed (connect, send, read, timeout).
pub(crate) async fn get(engine: &Engine, path: &str, timeout: Duration) -> Result<(u16, Value), String> {
    call(engine, Method::GET, path, None, timeout).await
}

/// A POST of `body` as JSON.
///
/// # Errors
/// As [`get`].
pub(crate) async fn post_json(
    engine: &Engine,
    path: &str,
    body: &Value,
    timeout: Duration,
) -> Result<(u16, Value), String> {
    call(engine, Method::POST, path, Some(Bytes::from(body.to_string())), timeout).await
}

async fn call(
    engine: &Engine,
    method: Method,
    path: &str,
    body: Option<Bytes>,
    timeout: Duration,
) -> Result<(u16, Value), String> {
    let exchange = async {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, engine.authority.as_str())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|e| e.to_string())?;
        let response = engine.connections.send(&engine.authority, request).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok((status, serde_json::from_slice(&bytes).unwrap_or(Value::Null)))
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| format!("no answer within {timeout:?}"))?
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_answers_usage_tells_its_prompt_and_cached_tokens_each_if_there() {
        let answer = json!({"usage": {"prompt_tokens": 9870, "prompt_tokens_details": {"cached_tokens": 512}}});
        assert_eq!(usage(&answer), (Some(9870), Some(512)));
        // vLLM without --enable-prompt-tokens-details: no details.
        let answer = json!({"usage": {"prompt_tokens": 12, "completion_tokens": 2}});
        assert_eq!(usage(&answer), (Some(12), None));
        assert_eq!(usage(&json!({"usage": null, "choices": []})), (None, None));
        assert_eq!(usage(&json!({"choices": [{"delta": {"content": " tok"}}]})), (None, None));
    }
}
