//! A simulated OpenAI-compatible engine over HTTP, as vLLM serves one: `POST /v1/completions`
//! and `/v1/chat/completions` (streamed as server-sent events or not), `POST /tokenize`, `GET
//! /health` and `/v1/models`. Behind it, vLLM's prefix cache model ([`SimEngine`]: blocks of the
//! engine's size, an LRU) publishing its KV events over ZMQ with a replay endpoint
//! ([`Publisher`]), `usage.prompt_tokens_details.cached_tokens` as vLLM reports it, and a time
//! model: a request waits for one of `batch` slots, then for the engine's prefill (one at a
//! time, as compute-bound prefills share an engine's steps; both in arrival order, as vLLM's
//! scheduler admits and prefills first come, first served), which takes a constant plus a time
//! per uncached token, then each output token a decode time (decodes share the batch). Text and chats are tokenized
//! through the model's folder with the library's [`Renderer`], as the head does.
//!
//! The HTTP is the least a client of vLLM needs: one request a connection (`Connection:
//! close`), bodies by `Content-Length`, a stream delimited by the close.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use superfluid_warm::{Error, Renderer, Result};

use crate::engine_sim::{Publisher, SimEngine};

/// Largest request head or body read.
const MAX_REQUEST_BYTES: usize = 64 << 20;

/// How the simulated engine is made.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The model's name (`/v1/models`, and the events' namespace).
    pub model: String,
    /// The model's folder (`tokenizer.json`, chat template); `None`: token-id prompts only.
    pub tokenizer: Option<PathBuf>,
    /// Tokens a KV block holds (16 on GPUs, 32 on vLLM's CPU build).
    pub block: usize,
    /// Blocks the prefix cache holds (an LRU).
    pub capacity: usize,
    /// Requests run at once; the rest wait.
    pub batch: usize,
    /// Prefill: a constant...
    pub prefill_base: Duration,
    /// ... and a time per prompt token not cached.
    pub prefill_per_token: Duration,
    /// Decode: a time per output token.
    pub decode_per_token: Duration,
    /// Loopback ports: HTTP, KV events, replays (0: of the system's choice).
    pub ports: (u16, u16, u16),
    /// A word-level vocabulary of `w0` .. `w{n-1}` (the benchmarks' tokenizer): completions'
    /// text read as those ids directly, the same ids its `tokenizer.json` gives, at a fraction
    /// of the cost (a real engine tokenizes on its own cores, not the benchmark's).
    pub word_level: Option<u32>,
}

impl EngineConfig {
    /// An engine of `model` with 16-token blocks, `capacity` blocks, 8 requests at once, and no
    /// time spent (tests).
    pub fn instant(model: &str, tokenizer: Option<PathBuf>, capacity: usize) -> EngineConfig {
        EngineConfig {
            model: model.into(),
            tokenizer,
            block: 16,
            capacity,
            batch: 8,
            prefill_base: Duration::ZERO,
            prefill_per_token: Duration::ZERO,
            decode_per_token: Duration::ZERO,
            ports: (0, 0, 0),
            word_level: None,
        }
    }
}

/// What the connections share.
struct Shared {
    config: EngineConfig,
    cache: Mutex<SimEngine>,
    /// Its events' sockets (a ZMQ socket is used by one thread at a time).
    publisher: Mutex<Publisher>,
    renderer: Option<Renderer>,
    /// The batch: `batch` requests run at once.
    slots: Fifo,
    /// The engine's compute for prefills, one at a time.
    prefill: Fifo,
    stop: AtomicBool,
    /// Completions and chats taken.
    served: std::sync::atomic::AtomicUsize,
}

/// A running simulated engine; stopped when dropped.
pub struct OpenAiEngine {
    /// Where it serves HTTP.
    pub addr: SocketAddr,
    /// Its KV events' PUB endpoint.
    pub events: String,
    /// Its KV events' replay endpoint.
    pub replay: String,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl OpenAiEngine {
    /// Starts an engine on a loopback port of the system's choice.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a tokenizer folder that does not load, or a socket that
    /// cannot be bound; [`Error::Thread`].
    pub fn start(config: EngineConfig) -> Result<OpenAiEngine> {
        let renderer = config.tokenizer.as_ref().map(Renderer::open).transpose()?;
        let cache = SimEngine::new(config.block, config.capacity, &config.model, None)?;
        let (http, events, replay) = config.ports;
        let publisher = Publisher::at(Duration::ZERO, (events != 0 || replay != 0).then_some((events, replay)))?;
        let (events, replay) = (publisher.events.clone(), publisher.replay.clone());
        let listener = TcpListener::bind(("127.0.0.1", http))
            .map_err(|e| Error::InvalidConfig { detail: format!("simulated engine: bind: {e}") })?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::InvalidConfig { detail: format!("simulated engine: address: {e}") })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::InvalidConfig { detail: format!("simulated engine: listener: {e}") })?;
        let shared = Arc::new(Shared {
            cache: Mutex::new(cache),
            publisher: Mutex::new(publisher),
            renderer,
            slots: Fifo::new(config.batch),
            prefill: Fifo::new(1),
            stop: AtomicBool::new(false),
            served: std::sync::atomic::AtomicUsize::new(0),
            config,
        });
        let s = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name("sim-openai-accept".into())
            .spawn(move || accept(&listener, &s))
            .map_err(|source| Error::Thread { source: Arc::new(source) })?;
        Ok(OpenAiEngine { addr, events, replay, shared, acceptor: Some(acceptor) })
    }

    /// Its base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests it has answered or is answering (completions and chats).
    pub fn served(&self) -> usize {
        self.shared.served.load(Ordering::Relaxed)
    }

    /// Requests running now (holding a batch slot).
    pub fn running(&self) -> usize {
        self.shared.slots.holders()
    }

    /// Tokens of `tokens` its prefix cache holds (what a request of them would find cached).
    pub fn holds(&self, tokens: &[u32]) -> usize {
        self.shared.cache.lock().map_or(0, |c| c.holds(tokens))
    }
}

impl Drop for OpenAiEngine {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

fn accept(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let s = Arc::clone(shared);
                let _ = std::thread::Builder::new().name("sim-openai-conn".into()).spawn(move || {
                    let _ = serve(stream, &s);
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// A request: method, path, body.
struct Request {
    method: String,
    path: String,
    body: Vec<u8>,
}

/// Reads one request; a body longer than [`MAX_REQUEST_BYTES`] is `Err` (after a 413).
fn read_request(stream: &TcpStream) -> std::io::Result<Option<Request>> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or_default().to_string(), parts.next().unwrap_or_default().to_string());
    let (mut length, mut expect_continue) = (0usize, false);
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" || header == "\n" {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            let (name, value) = (name.trim(), value.trim());
            if name.eq_ignore_ascii_case("content-length") {
                length = value.parse().unwrap_or(0);
            } else if name.eq_ignore_ascii_case("expect") && value.eq_ignore_ascii_case("100-continue") {
                expect_continue = true;
            }
        }
    }
    if length > MAX_REQUEST_BYTES {
        let mut out = stream;
        respond(
            &mut out,
            "413 Payload Too Large",
            &json!({"error": {"message": "the body is too large", "code": 413}}),
        )?;
        return Err(std::io::Error::other("a body too large"));
    }
    if expect_continue {
        let mut out = stream;
        out.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body)?;
    Ok(Some(Request { method, path, body }))
}

fn respond(mut stream: impl Write, status: &str, body: &Value) -> std::io::Result<()> {
    let body = body.to_string();
    write!(
        stream,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

fn error(stream: &mut TcpStream, status: &str, message: &str) -> std::io::Result<()> {
    let code: u16 = status.split_whitespace().next().and_then(|c| c.parse().ok()).unwrap_or(500);
    let kind = if code < 500 { "BadRequestError" } else { "InternalServerError" };
    respond(stream, status, &json!({"error": {"message": message, "type": kind, "code": code}}))
}

fn serve(mut stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    let Some(request) = read_request(&stream)? else { return Ok(()) };
    match (request.method.as_str(), request.path.as_str()) {
        ("GET", "/health") => respond(&mut stream, "200 OK", &json!({})),
        ("GET", "/v1/models") => respond(
            &mut stream,
            "200 OK",
            &json!({"object": "list", "data": [{"id": shared.config.model, "object": "model", "owned_by": "sim"}]}),
        ),
        ("POST", "/tokenize") => match tokens_of(shared, &request.body, Kind::Tokenize) {
            Ok((tokens, _)) => respond(
                &mut stream,
                "200 OK",
                &json!({"count": tokens.len(), "max_model_len": 1 << 20, "tokens": tokens, "token_strs": null}),
            ),
            Err(e) => error(&mut stream, "400 Bad Request", &e),
        },
        ("POST", "/v1/completions") => generate(&mut stream, shared, &request.body, Kind::Completion),
        ("POST", "/v1/chat/completions") => generate(&mut stream, shared, &request.body, Kind::Chat),
        _ => respond(&mut stream, "404 Not Found", &json!({"detail": "Not Found"})),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
    Tokenize,
}

/// The fields of a request body this engine reads (the arrays kept as their JSON text, so that
/// a template's `tojson` sees the client's key order).
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// A request's prompt tokens and its body; `Err` says why they cannot be had.
fn tokens_of<'a>(shared: &Shared, body: &'a [u8], kind: Kind) -> std::result::Result<(Vec<u32>, Body<'a>), String> {
    let parsed: Body<'a> = serde_json::from_slice(body).map_err(|e| format!("the body is not a request: {e}"))?;
    let renderer = || shared.renderer.as_ref().ok_or_else(|| "this engine has no tokenizer".to_string());
    let tokens = match (kind, parsed.prompt, parsed.messages) {
        (Kind::Completion | Kind::Tokenize, Some(prompt), _) => match serde_json::from_str::<Value>(prompt.get()) {
            Ok(Value::String(text)) => match shared.config.word_level {
                Some(vocab) => text
                    .split_whitespace()
                    .map(|w| {
                        w.strip_prefix('w').and_then(|n| n.parse::<u32>().ok()).filter(|&n| n < vocab).unwrap_or(vocab)
                    })
                    .collect(),
                None => renderer()?
                    .completion(&text, parsed.add_special_tokens.unwrap_or(true))
                    .map_err(|e| e.to_string())?,
            },
            Ok(Value::Array(ids)) => ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or("a token id out of range"))
                .collect::<std::result::Result<Vec<u32>, _>>()?,
            _ => return Err("the prompt is neither text nor token ids".into()),
        },
        (Kind::Chat | Kind::Tokenize, _, Some(messages)) => renderer()?
            .chat(messages.get(), parsed.tools.map(RawValue::get), parsed.add_generation_prompt.unwrap_or(true))
            .map_err(|e| e.to_string())?,
        _ => return Err("no prompt or messages".into()),
    };
    Ok((tokens, parsed))
}

fn generate(stream: &mut TcpStream, shared: &Shared, body: &[u8], kind: Kind) -> std::io::Result<()> {
    let (tokens, parsed) = match tokens_of(shared, body, kind) {
        Ok(t) => t,
        Err(e) => return error(stream, "400 Bad Request", &e),
    };
    if tokens.is_empty() {
        return error(stream, "400 Bad Request", "the prompt is empty");
    }
    let max_tokens = parsed.max_completion_tokens.or(parsed.max_tokens).unwrap_or(16).max(1);
    shared.served.fetch_add(1, Ordering::Relaxed);
    let include_usage = parsed.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let _slot = shared.slots.enter();
    let config = &shared.config;
    // What the engine finds cached: whole blocks, the prompt's last token always computed.
    let cached = {
        let Ok(mut cache) = shared.cache.lock() else { return error(stream, "500 Internal Server Error", "poisoned") };
        let block = config.block.max(1);
        let limit = (tokens.len() - 1) / block * block;
        let cached = cache.holds(&tokens).min(limit);
        let batch = cache.run(&tokens);
        if let Ok(publisher) = shared.publisher.lock() {
            let _ = publisher.publish(&batch, false);
        }
        cached
    };
    let uncached = u32::try_from(tokens.len() - cached).unwrap_or(u32::MAX);
    // Prefills take the engine's compute one at a time (vLLM's prefill is compute-bound: a
    // batch's prefills share the steps), decodes share the batch.
    {
        let _lane = shared.prefill.enter();
        std::thread::sleep(config.prefill_base + config.prefill_per_token * uncached);
    }
    let usage = json!({
        "prompt_tokens": tokens.len(), "completion_tokens": max_tokens, "total_tokens": tokens.len() + max_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    });
    let (object, chunk_object) = match kind {
        Kind::Chat => ("chat.completion", "chat.completion.chunk"),
        _ => ("text_completion", "text_completion"),
    };
    let model = &config.model;
    if !parsed.stream {
        std::thread::sleep(config.decode_per_token * u32::try_from(max_tokens).unwrap_or(u32::MAX));
        let text = vec!["tok"; max_tokens].join(" ");
        let choice = match kind {
            Kind::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
            }
            _ => json!({"index": 0, "text": text, "finish_reason": "length"}),
        };
        let body =
            json!({"id": "sim-1", "object": object, "created": 0, "model": model, "choices": [choice], "usage": usage});
        return respond(stream, "200 OK", &body);
    }
    write!(stream, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")?;
    for i in 0..max_tokens {
        let last = i + 1 == max_tokens;
        let finish = if last { json!("length") } else { Value::Null };
        let choice = match kind {
            Kind::Chat => json!({"index": 0, "delta": {"content": " tok"}, "finish_reason": finish}),
            _ => json!({"index": 0, "text": " tok", "finish_reason": finish}),
        };
        let chunk = json!({"id": "sim-1", "object": chunk_object, "created": 0, "model": model, "choices": [choice]});
        write!(stream, "data: {chunk}\n\n")?;
        stream.flush()?;
        std::thread::sleep(config.decode_per_token);
    }
    if include_usage {
        let chunk =
            json!({"id": "sim-1", "object": chunk_object, "created": 0, "model": model, "choices": [], "usage": usage});
        write!(stream, "data: {chunk}\n\n")?;
    }
    write!(stream, "data: [DONE]\n\n")?;
    stream.flush()
}

/// A gate that lets `width` holders through at once, in the order they came (tickets).
struct Fifo {
    width: u64,
    /// Tickets handed out, and holders gone.
    state: Mutex<(u64, u64)>,
    turn: Condvar,
}

impl Fifo {
    fn new(width: usize) -> Fifo {
        Fifo { width: width.max(1) as u64, state: Mutex::new((0, 0)), turn: Condvar::new() }
    }

    /// Waits for this caller's turn: every earlier caller through, and fewer than `width` in.
    fn enter(&self) -> Pass<'_> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let ticket = state.0;
        state.0 += 1;
        while ticket >= state.1 + self.width {
            state = self.turn.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        Pass(self)
    }

    /// Callers through and not gone.
    fn holders(&self) -> usize {
        let (handed, gone) = *self.state.lock().unwrap_or_else(PoisonError::into_inner);
        usize::try_from(handed.min(gone + self.width) - gone).unwrap_or(usize::MAX)
    }
}

/// A caller's place through a [`Fifo`], until dropped.
struct Pass<'a>(&'a Fifo);

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        self.0.state.lock().unwrap_or_else(PoisonError::into_inner).1 += 1;
        self.0.turn.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;
    use std::time::{Duration, Instant};

    use super::Fifo;

    /// Waits (at most 30 s, however busy the machine) until `n` tickets are handed out.
    fn until_handed(gate: &Fifo, n: u64) {
        let start = Instant::now();
        while gate.state.lock().map_or(0, |s| s.0) < n {
            assert!(start.elapsed() < Duration::from_secs(30), "{n} callers never came");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// One holder at a time: callers that wait go through in the order they came, whichever
    /// the system wakes first.
    #[test]
    fn callers_go_through_in_the_order_they_came() {
        let gate = Fifo::new(1);
        let (order, seen) = channel();
        let first = gate.enter();
        assert_eq!(gate.holders(), 1);
        std::thread::scope(|scope| {
            for (n, name) in ["second", "third", "fourth"].into_iter().enumerate() {
                let (gate, order) = (&gate, order.clone());
                scope.spawn(move || {
                    let _pass = gate.enter();
                    let _ = order.send(name);
                });
                until_handed(gate, n as u64 + 2);
            }
            assert_eq!(gate.holders(), 1, "the others wait");
            drop(first);
        });
        drop(order);
        assert_eq!(seen.iter().collect::<Vec<_>>(), ["second", "third", "fourth"]);
        assert_eq!(gate.holders(), 0);
    }

    /// A batch of two: two callers hold it at once, a third waits for one of them.
    #[test]
    fn a_gate_of_two_lets_two_through() {
        let gate = Fifo::new(2);
        let (a, b) = (gate.enter(), gate.enter());
        assert_eq!(gate.holders(), 2);
        std::thread::scope(|scope| {
            let third = scope.spawn(|| {
                let _pass = gate.enter();
                gate.holders()
            });
            until_handed(&gate, 3);
            assert_eq!(gate.holders(), 2, "the third waits");
            drop(b);
            assert_eq!(third.join().ok(), Some(2), "it went through once one left");
        });
        drop(a);
        assert_eq!(gate.holders(), 0);
    }
}
