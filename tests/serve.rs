//! `serve` as a client and an operator see it: a real `superfluid-warm serve` process in front of
//! simulated engines over HTTP and ZMQ (`harness::openai_engine`). Conversations land on the
//! engine that holds their prefix and the head's prediction matches what the engine delivers;
//! streams pass through with the usage the client asked for; engines that fail are skipped,
//! ejected and taken back; what is not served is refused clearly; SIGTERM closes the index
//! cleanly.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::Reaped;
use common::nats::NatsServer;
use harness::openai_engine::{EngineConfig, OpenAiEngine};
use serde_json::{Value, json};

const MODEL: &str = "m";

fn chatml() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/render/chatml"))
}

/// A `serve` process, its address, and its stderr lines so far.
struct Serve {
    child: Reaped,
    addr: SocketAddr,
    stderr: mpsc::Receiver<String>,
}

impl Serve {
    /// `serve` in front of `engines`, following their events.
    fn start(path: &Path, engines: &[&OpenAiEngine], extra: &[&str]) -> Serve {
        let specs: Vec<String> = engines
            .iter()
            .enumerate()
            .map(|(i, e)| format!("e{i}={},events={},replay={}", e.url(), e.events, e.replay))
            .collect();
        Serve::start_with(path, &specs, extra)
    }

    /// `serve` in front of `engines` without their events, rendering with the ChatML model: what
    /// it knows of the engines is its own claims.
    fn on_claims(path: &Path, engines: &[&OpenAiEngine], extra: &[&str]) -> Serve {
        let specs: Vec<String> = engines.iter().enumerate().map(|(i, e)| format!("e{i}={}", e.url())).collect();
        let chatml = chatml().display().to_string();
        Serve::start_with(path, &specs, &[&["--tokenizer", chatml.as_str()], extra].concat())
    }

    /// `serve` with these `--engine` specs.
    fn start_with(path: &Path, specs: &[String], extra: &[&str]) -> Serve {
        let mut args: Vec<String> =
            vec!["serve".into(), path.display().to_string(), "--listen".into(), "127.0.0.1:0".into()];
        args.extend(["--model".into(), MODEL.into(), "--status-every".into(), "0.2".into()]);
        for spec in specs {
            args.push("--engine".into());
            args.push(spec.clone());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = Command::new(common::bin())
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start serve");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let started = Instant::now();
        let addr = loop {
            let line = rx.recv_timeout(Duration::from_secs(60)).expect("serve says where it serves");
            if let Some(rest) = line.split(" on http://").nth(1) {
                break rest.split_whitespace().next().and_then(|a| a.parse().ok()).expect("an address");
            }
            assert!(started.elapsed() < Duration::from_secs(60), "serve did not start");
        };
        let serve = Serve { child: Reaped(child), addr, stderr: rx };
        // Its listener connects to every engine's events before the test counts on them.
        serve.until(Duration::from_secs(30), "the engines' events connected", |s| {
            let health = s.health();
            health["engines"].as_array().is_some_and(|es| es.iter().all(|e| e["events_up"] == true))
        });
        serve
    }

    fn call(&self, method: &str, path: &str, body: &Value) -> (u16, HashMap<String, String>, String) {
        http(self.addr, method, path, &if body.is_null() { String::new() } else { body.to_string() })
    }

    /// `GET /health`'s answer (its text as a string if it is not JSON).
    fn health(&self) -> Value {
        let (_, _, text) = self.call("GET", "/health", &Value::Null);
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    }

    fn post(&self, path: &str, body: &Value) -> (u16, HashMap<String, String>, Value) {
        let (status, headers, text) = self.call("POST", path, body);
        (status, headers, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    fn until(&self, within: Duration, what: &str, mut ok: impl FnMut(&Serve) -> bool) {
        let started = Instant::now();
        while !ok(self) {
            assert!(started.elapsed() < within, "not within {within:?}: {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM; its exit status, stdout and stderr.
    fn stop(mut self) -> (std::process::ExitStatus, String, String) {
        let pid = self.child.0.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
        let (status, _) = self.child.ends_within(Duration::from_secs(60), "SIGTERM");
        let mut out = String::new();
        if let Some(mut o) = self.child.0.stdout.take() {
            o.read_to_string(&mut out).expect("stdout");
        }
        let err: Vec<String> = self.stderr.try_iter().collect();
        (status, out, err.join("\n"))
    }
}

/// One HTTP/1.1 request on its own connection: status, headers (lower-case names), body (a
/// chunked body decoded).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, HashMap<String, String>, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read to the close");
    let text = String::from_utf8(raw).expect("UTF-8");
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response");
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|s| s.parse().ok()).expect("status");
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let body = if headers.get("transfer-encoding").is_some_and(|t| t == "chunked") {
        let (mut out, mut rest) = (String::new(), rest);
        while let Some((size, after)) = rest.split_once("\r\n") {
            let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
            if size == 0 {
                break;
            }
            out.push_str(after.get(..size).expect("a whole chunk"));
            rest = after.get(size + 2..).unwrap_or_default();
        }
        out
    } else {
        rest.to_string()
    };
    (status, headers, body)
}

fn engine(tokenizer: bool) -> OpenAiEngine {
    OpenAiEngine::start(EngineConfig::instant(MODEL, tokenizer.then(chatml), 65_536)).expect("engine")
}

fn cached(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens")
}

/// A user message of `words` words, distinct per `seed`.
fn message(seed: usize, words: usize) -> String {
    (0..words).map(|w| format!("c{seed}w{w}")).collect::<Vec<_>>().join(" ")
}

fn stats_json(path: &Path) -> Value {
    common::cli_json(&["stats", &path.display().to_string(), "--json"]).get(0).cloned().expect("stats")
}

#[test]
fn conversations_land_where_their_prefix_is_and_the_prediction_is_what_the_engine_delivers() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engines = [engine(true), engine(true)];
    let serve = Serve::start(&path, &[&engines[0], &engines[1]], &["--tokenizer", &chatml().display().to_string()]);
    let mut placed: HashMap<usize, String> = HashMap::new();
    let mut histories: Vec<Vec<Value>> = vec![Vec::new(); 6];
    let (mut answers, mut warm_answers) = (0, 0);
    for turn in 0..3 {
        for (c, history) in histories.iter_mut().enumerate() {
            history.push(json!({"role": "user", "content": message(c * 10 + turn, 120)}));
            let (status, headers, answer) =
                serve.post("/v1/chat/completions", &json!({"model": MODEL, "messages": history, "max_tokens": 8}));
            assert_eq!(status, 200, "{answer}");
            let chosen = headers.get("x-superfluid-warm-engine").cloned().expect("the engine is named");
            let predicted: u64 = headers["x-superfluid-warm-predicted"].parse().expect("a number");
            let delivered = cached(&answer);
            answers += 1;
            if turn == 0 {
                placed.insert(c, chosen);
                assert_eq!(predicted, 0, "a new conversation is cold");
            } else {
                assert_eq!(placed.get(&c), Some(&chosen), "conversation {c} turn {turn} stays where its prefix is");
                assert!(predicted >= 256, "turn {turn} of {c} predicted {predicted}");
                warm_answers += 1;
            }
            assert!(predicted.abs_diff(delivered) <= 64, "predicted {predicted}, delivered {delivered}");
            let content = answer["choices"][0]["message"]["content"].clone();
            history.push(json!({"role": "assistant", "content": content}));
        }
    }
    // Six new conversations on two idle engines: spread, not piled on one.
    let on_first = placed.values().filter(|e| *e == "e0").count();
    assert!((1..=5).contains(&on_first), "{placed:?}");
    assert_eq!((answers, warm_answers), (18, 12));
    // Its figures, as `stats` reads them from the status file while it serves.
    serve.until(Duration::from_secs(10), "the status file has every answer", |_| {
        let stats = stats_json(&path);
        stats["routes"]
            .as_array()
            .is_some_and(|r| r.iter().map(|r| r["answered"].as_u64().unwrap_or(0)).sum::<u64>() == 18)
    });
    let stats = stats_json(&path);
    for r in stats["routes"].as_array().expect("routes") {
        assert_eq!(r["mispredicted"], 0, "{r}");
        assert_eq!(r["failures"], 0, "{r}");
        assert!(r["delivered_tokens"].as_u64() > Some(0), "{r}");
    }
    let (status, out, err) = serve.stop();
    assert!(status.success(), "{err}");
    assert!(out.contains("closed cleanly"), "{out}");
    let text = Command::new(common::bin()).args(["stats", &path.display().to_string()]).output().expect("stats");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("routed (serve)") && text.contains("writer         none"), "{text}");
}

#[test]
fn streams_pass_through_with_the_usage_the_client_asked_for() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engines = [engine(true)];
    let serve = Serve::start(&path, &[&engines[0]], &["--tokenizer", &chatml().display().to_string()]);
    let chat = |extra: Value| {
        let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": message(1, 200)}], "max_tokens": 3, "stream": true});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let (status, headers, text) = serve.call("POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        assert!(headers["content-type"].starts_with("text/event-stream"), "{headers:?}");
        let events: Vec<String> = text.split("\n\n").filter(|e| !e.is_empty()).map(str::to_string).collect();
        assert_eq!(events.last().map(String::as_str), Some("data: [DONE]"), "{text}");
        events
    };
    // Not asked: no usage event, though the head asked the engine for one.
    let first = chat(json!({}));
    assert_eq!(first.len(), 4, "three tokens and [DONE]: {first:?}");
    assert!(first.iter().all(|e| !e.contains("\"usage\"")), "{first:?}");
    // Asked: the usage event, with the cached tokens of the first request's prefix.
    let second = chat(json!({"stream_options": {"include_usage": true}}));
    assert_eq!(second.len(), 5, "{second:?}");
    let usage: Value = serde_json::from_str(second[3].strip_prefix("data: ").expect("data")).expect("JSON");
    assert!(cached(&usage) >= 256, "{usage}");
    // Both answers counted as predicted against delivered: the stream's usage was read.
    serve.until(Duration::from_secs(10), "two answers counted", |_| stats_json(&path)["routes"][0]["answered"] == 2);
    let routes = stats_json(&path)["routes"][0].clone();
    assert_eq!(routes["mispredicted"], 0, "{routes}");
    assert!(routes["predicted_tokens"].as_u64() >= Some(256), "{routes}");
    let (status, _, err) = serve.stop();
    assert!(status.success(), "{err}");
}

#[test]
fn a_failing_engine_is_skipped_then_ejected_and_taken_back_when_it_answers_again() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let survivor = engine(false);
    let doomed = engine(false);
    let ports = (doomed.addr.port(), 0, 0);
    let serve = Serve::start(&path, &[&doomed, &survivor], &["--eject-after", "2"]);
    drop(doomed);
    // Cold prompts on two idle engines alternate; each one that goes to the dead engine is
    // retried on the other, and the client sees no failure.
    for i in 0..8u32 {
        let prompt: Vec<u32> = (0..200).map(|t| i * 1000 + t).collect();
        let (status, headers, answer) =
            serve.post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}));
        assert_eq!(status, 200, "{answer}");
        assert_eq!(headers["x-superfluid-warm-engine"], "e1");
    }
    let health = serve.health();
    assert_eq!(health["engines"][0]["up"], false, "{health}");
    assert_eq!(health["engines"][1]["up"], true, "{health}");
    serve.until(Duration::from_secs(10), "the failures counted", |_| {
        let routes = stats_json(&path)["routes"].clone();
        routes[0]["failures"] == 2 && routes[0]["ejections"] == 1
    });
    // Back on its port: its health check answers, and it is in the choice again.
    let mut config = EngineConfig::instant(MODEL, None, 65_536);
    config.ports = ports;
    let _back = OpenAiEngine::start(config).expect("the engine again, on its port");
    serve.until(Duration::from_secs(20), "the engine back in the choice", |s| s.health()["engines"][0]["up"] == true);
    // With both gone, a request is refused with the reason.
    drop(survivor);
    drop(_back);
    let (status, _, answer) =
        serve.post("/v1/completions", &json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}));
    assert_eq!(status, 503, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("no engine could take the request") && message.contains("refused"), "{message}");
    let (status, _, err) = serve.stop();
    assert!(status.success(), "{err}");
}

#[test]
fn without_a_tokenizer_text_is_tokenized_by_an_engine_and_ids_are_used_as_given() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engines = [engine(true), engine(true)];
    let serve = Serve::start(&path, &[&engines[0], &engines[1]], &[]);
    let prompt = message(7, 300);
    let mut chosen = Vec::new();
    for _ in 0..3 {
        let (status, headers, answer) =
            serve.post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}));
        assert_eq!(status, 200, "{answer}");
        let predicted: u64 = headers["x-superfluid-warm-predicted"].parse().expect("a number");
        chosen.push((headers["x-superfluid-warm-engine"].clone(), predicted, cached(&answer)));
    }
    let (first, _, _) = chosen[0].clone();
    assert!(chosen.iter().all(|(e, _, _)| *e == first), "{chosen:?}");
    for (_, predicted, delivered) in chosen.iter().skip(1) {
        assert!(*predicted >= 512 && predicted.abs_diff(*delivered) <= 64, "{chosen:?}");
    }
    let (status, _, err) = serve.stop();
    assert!(status.success(), "{err}");
}

/// Runs a prompt of 640 ids through `serve`, then asks `/v1/route` for the same prompt and 100
/// tokens more: its answer.
fn run_then_route(serve: &Serve) -> Value {
    let prompt: Vec<u32> = (0..640).collect();
    let (status, _, answer) =
        serve.post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}));
    assert_eq!(status, 200, "{answer}");
    let mut longer = prompt;
    longer.extend(1000..1100);
    let (status, _, route) = serve.post("/v1/route", &json!({"model": MODEL, "prompt": longer}));
    assert_eq!(status, 200, "{route}");
    route
}

#[test]
fn route_decides_without_proxying_and_what_is_not_served_is_refused_clearly() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engines = [engine(false), engine(false)];
    // A deadline no busy machine misses, for the claims below.
    let serve = Serve::start(&path, &[&engines[0], &engines[1]], &["--deadline-ms", "60000"]);
    // The engine that ran it holds it: /v1/route names it, with 640 warm tokens, and the
    // decision's load on it until it is done.
    let route = run_then_route(&serve);
    let engine = route["engine"].as_str().expect("an engine").to_string();
    let priced = route["engines"].as_array().expect("engines").clone();
    let mine = priced.iter().find(|e| e["engine"] == engine.as_str()).expect("priced");
    assert_eq!(mine["warm_tokens"], 640, "{route}");
    assert_eq!(route["prompt_tokens"], 740);
    assert_eq!(mine["load"]["in_flight"], 1, "{route}");
    // Both claims were made on their requests' threads (the index took them at once, its reads
    // in time): none went to the claim thread.
    let health = serve.health();
    assert_eq!(health["claims_handed"], 0, "{health}");
    // A prompt of more than 512 blocks is claimed on the claim thread.
    let long: Vec<u32> = (0..513 * 64).map(|t| 5 + t % 20_000).collect();
    let (status, _, routed) = serve.post("/v1/route", &json!({"model": MODEL, "prompt": long}));
    assert_eq!(status, 200, "{routed}");
    let health = serve.health();
    assert_eq!(health["claims_handed"], 1, "{health}");
    let (status, _, done) = serve.post("/v1/route/done", &json!({"ticket": routed["ticket"]}));
    assert_eq!(status, 200, "{done}");
    let (status, _, done) = serve.post("/v1/route/done", &json!({"ticket": route["ticket"], "cached_tokens": 640}));
    assert_eq!(status, 200, "{done}");
    let (status, _, again) = serve.post("/v1/route/done", &json!({"ticket": route["ticket"]}));
    assert_eq!(status, 404, "{again}");
    // Refusals: each says what it is.
    let refused = [
        ("GET", "/v1/embeddings", Value::Null, 404, "is not served"),
        ("GET", "/v1/completions", Value::Null, 405, "is not served"),
        ("POST", "/v1/completions", json!({"model": "other", "prompt": "x"}), 404, "does not exist"),
        ("POST", "/v1/completions", json!({"prompt": "x"}), 400, "names no model"),
        ("POST", "/v1/chat/completions", json!([1]), 400, "JSON object"),
    ];
    for (method, path, body, code, says) in refused {
        let (status, _, text) = serve.call(method, path, &body);
        assert_eq!(status, code, "{method} {path}: {text}");
        assert!(text.contains(says), "{method} {path}: {text}");
    }
    let (status, _, text) = http(serve.addr, "POST", "/v1/completions", "{not json");
    assert_eq!(status, 400, "{text}");
    let (status, _, models) = serve.call("GET", "/v1/models", &Value::Null);
    assert_eq!(status, 200);
    assert!(models.contains("\"id\":\"m\""), "{models}");
    let (status, _, err) = serve.stop();
    assert!(status.success(), "{err}");
}

/// A stream opened through the head on its own connection: the raw bytes read until `until`
/// says enough (the connection is then closed), or to the end.
fn stream_until(addr: SocketAddr, body: &Value, mut until: impl FnMut(&str) -> bool) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let body = body.to_string();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let (mut seen, mut buffer) = (String::new(), [0u8; 4096]);
    loop {
        let n = stream.read(&mut buffer).expect("read");
        if n == 0 {
            return seen;
        }
        seen.push_str(&String::from_utf8_lossy(buffer.get(..n).unwrap_or_default()));
        if until(&seen) {
            return seen;
        }
    }
}

fn slow_engine(decode: Duration) -> OpenAiEngine {
    let mut config = EngineConfig::instant(MODEL, Some(chatml()), 65_536);
    config.decode_per_token = decode;
    OpenAiEngine::start(config).expect("engine")
}

#[test]
fn a_client_that_goes_away_cancels_the_engines_request_and_its_load() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engine = slow_engine(Duration::from_millis(50));
    let serve = Serve::start(&path, &[&engine], &["--tokenizer", &chatml().display().to_string()]);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": message(3, 150)}], "max_tokens": 400, "stream": true});
    // 400 tokens at 50 ms: 20 s of decoding; the client leaves after its first token.
    let seen = stream_until(serve.addr, &body, |seen| seen.contains("data: {"));
    assert!(seen.contains(" tok"), "{seen}");
    assert_eq!(engine.running(), 1, "the engine is decoding it");
    let in_flight = |s: &Serve| s.health()["engines"][0]["in_flight"].as_u64();
    serve.until(Duration::from_secs(10), "the head takes the load off", |s| in_flight(s) == Some(0));
    let started = Instant::now();
    while engine.running() > 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "the engine still runs the request of a client gone");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, _, err) = serve.stop();
    assert!(status.success(), "{err}");
}

#[test]
fn sigterm_finishes_the_streams_in_flight_then_closes_the_index_cleanly() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engine = slow_engine(Duration::from_millis(20));
    let serve = Serve::start(&path, &[&engine], &["--tokenizer", &chatml().display().to_string()]);
    let addr = serve.addr;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": message(4, 150)}], "max_tokens": 60, "stream": true});
    let (tx, rx) = mpsc::channel();
    let client = std::thread::spawn(move || {
        stream_until(addr, &body, |seen| {
            if seen.contains("data: {") {
                let _ = tx.send(());
            }
            false
        })
    });
    rx.recv_timeout(Duration::from_secs(30)).expect("the first token");
    // SIGTERM while 60 tokens at 20 ms stream: the stream ends whole, then the head exits.
    let (status, out, err) = serve.stop();
    let seen = client.join().expect("the client");
    assert_eq!(seen.matches("data: {").count(), 60, "{seen}");
    assert!(seen.contains("data: [DONE]"), "{seen}");
    assert!(status.success(), "{err}");
    assert!(out.contains("closed cleanly"), "{out}");
    assert!(err.contains("1 connection(s) finished"), "{err}");
    // Nothing listens any more.
    assert!(TcpStream::connect(addr).is_err(), "still accepting after it stopped");
}

#[test]
fn heads_sharing_through_nats_route_a_conversation_alike() {
    let dir = common::tempdir();
    let server = NatsServer::start(&dir.path().join("js"));
    let engines = [engine(false), engine(false)];
    // No events: each head knows where a prefix is only by the choices, its own and the other's.
    let specs: Vec<String> = engines.iter().enumerate().map(|(i, e)| format!("e{i}={}", e.url())).collect();
    let url = server.url();
    let head = |name: &str| {
        let path = dir.path().join(format!("{name}.redb"));
        Serve::start_with(&path, &specs, &["--nats", &url, "--head", name])
    };
    let (a, b) = (head("a"), head("b"));
    for c in 0..4u32 {
        let mut prompt: Vec<u32> = (0..512).map(|t| c * 10_000 + t).collect();
        let (status, headers, answer) =
            a.post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}));
        assert_eq!(status, 200, "{answer}");
        let chosen = headers["x-superfluid-warm-engine"].clone();
        prompt.extend(500_000..500_100);
        // Head b applies a's choice from the stream (the stream holds each head's choices: a's
        // c + 1 and b's c so far), and sends the next turn there.
        b.until(Duration::from_secs(30), "head b applies head a's choice", |b| {
            let health = b.health();
            health["sharing"]["applied"].as_u64() >= Some(u64::from(2 * c + 1))
        });
        let (status, headers, answer) =
            b.post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}));
        assert_eq!(status, 200, "{answer}");
        assert_eq!(headers["x-superfluid-warm-engine"], chosen, "conversation {c}");
        assert_eq!(headers["x-superfluid-warm-predicted"], "512");
        assert!(cached(&answer) >= 496, "{answer}");
    }
    for head in [a, b] {
        let (status, out, err) = head.stop();
        assert!(status.success(), "{err}");
        assert!(out.contains("closed cleanly"), "{out}");
    }
}

#[test]
fn an_engine_back_from_an_ejection_is_priced_cold_until_its_events_speak_again() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let first = engine(false);
    let port = |endpoint: &str| endpoint.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()).expect("a port");
    let ports = (first.addr.port(), port(&first.events), port(&first.replay));
    let serve = Serve::start(&path, &[&first], &["--eject-after", "1"]);
    let prompt: Vec<u32> = (0..640).collect();
    let send = |prompt: &[u32]| {
        let (status, headers, answer) =
            serve.post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}));
        let predicted = headers.get("x-superfluid-warm-predicted").and_then(|p| p.parse::<u64>().ok());
        (status, predicted, answer)
    };
    assert_eq!(send(&prompt).0, 200);
    serve.until(Duration::from_secs(10), "the engine's events say it holds the prompt", |_| {
        let (status, predicted, answer) = send(&prompt);
        status == 200 && predicted == Some(640) && cached(&answer) >= 624
    });
    // The engine dies: the request fails, the engine is ejected; it restarts on its ports with
    // an empty cache, and nobody tells the head.
    drop(first);
    assert_eq!(send(&prompt).0, 503);
    let mut config = EngineConfig::instant(MODEL, None, 65_536);
    config.ports = ports;
    let _again = OpenAiEngine::start(config).expect("the engine again, on its ports");
    serve.until(Duration::from_secs(20), "the engine back in the choice", |s| s.health()["engines"][0]["up"] == true);
    // Its first request is predicted cold (the index still holds the old process's blocks),
    // which is what it delivers.
    let (status, predicted, answer) = send(&prompt);
    assert_eq!(status, 200, "{answer}");
    assert_eq!((predicted, cached(&answer)), (Some(0), 0));
    // Its events speak again (the restart seen): the prediction follows them.
    serve.until(Duration::from_secs(10), "the restarted engine's holdings predicted", |_| {
        let (status, predicted, answer) = send(&prompt);
        status == 200 && predicted == Some(640) && cached(&answer) >= 624
    });
    let (status, _, err) = serve.stop();
    assert!(status.success(), "{err}");
}

#[test]
fn after_a_lookup_past_the_deadline_lookups_are_handed_over_and_a_late_answer_goes_by_load() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engines = [engine(false), engine(false)];
    // A deadline no lookup meets: the first runs on its request's thread and is used all the
    // same; it hands lookups over to the blocking pool, where each is late.
    let serve = Serve::start(&path, &[&engines[0], &engines[1]], &["--deadline-ms", "0"]);
    // With the deadline met, this is 640 warm tokens on the engine that ran it
    // (`route_decides_without_proxying…`); handed over and late, it is priced on load alone.
    let route = run_then_route(&serve);
    assert_eq!(route["prompt_tokens"], 740, "{route}");
    let priced = route["engines"].as_array().expect("engines");
    assert_eq!(priced.len(), 2, "{route}");
    assert!(priced.iter().all(|e| e["warm_tokens"] == 0), "a late answer was used: {route}");
    // Reads being slow, the completion's claim went to the claim thread (the route's answer,
    // late, gave no prefix to claim).
    let health = serve.health();
    assert_eq!((&health["claims_handed"], &health["claims_dropped"]), (&json!(1), &json!(0)), "{health}");
    let (status, _, err) = serve.stop();
    assert!(status.success(), "{err}");
    assert!(err.contains("a lookup ran past the deadline"), "{err}");
}

#[test]
fn a_rendered_prompts_answer_past_the_deadline_is_not_used() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engines = [engine(false), engine(false)];
    let tokenizer = chatml().display().to_string();
    let text = message(3, 200);
    let ids = superfluid_warm::Renderer::open(chatml()).expect("the tokenizer").completion(&text, true).expect("ids");
    assert!(ids.len() > 128, "{} tokens", ids.len());
    let route_text = |serve: &Serve| {
        let (status, _, route) = serve.post("/v1/route", &json!({"model": MODEL, "prompt": text}));
        assert_eq!(status, 200, "{route}");
        assert_eq!(route["prompt_tokens"], ids.len(), "{route}");
        route["engines"].as_array().expect("engines").iter().map(|e| e["warm_tokens"].as_u64()).collect::<Vec<_>>()
    };
    // Its tokens run as ids: the head claims them for the engine it chose, and routes the
    // text (rendered and looked up on its request's thread) warm there.
    let serve = Serve::start(&path, &[&engines[0], &engines[1]], &["--tokenizer", &tokenizer]);
    let (status, _, answer) = serve.post("/v1/completions", &json!({"model": MODEL, "prompt": ids, "max_tokens": 2}));
    assert_eq!(status, 200, "{answer}");
    let warm = route_text(&serve);
    assert!(warm.iter().any(|w| w.is_some_and(|w| w >= 128)), "routed cold: {warm:?}");
    let (status, _, err) = serve.stop();
    assert!(status.success(), "{err}");
    // The same file, with a deadline no lookup meets: that answer comes, and is not used,
    // however soon after it the request reads it; the next render and lookup go to the
    // blocking pool, whose answer is late too.
    let serve = Serve::start(&path, &[&engines[0], &engines[1]], &["--tokenizer", &tokenizer, "--deadline-ms", "0"]);
    for (round, how) in ["on its request's thread", "on the blocking pool"].iter().enumerate() {
        let late = route_text(&serve);
        assert_eq!(late, vec![Some(0), Some(0)], "a late answer was used, {how} (round {round})");
    }
    let (status, _, err) = serve.stop();
    assert!(status.success(), "{err}");
    // Each lookup past the deadline says so, wherever it ran.
    assert_eq!(err.matches("a lookup ran past the deadline").count(), 2, "{err}");
}

#[test]
fn a_long_cold_prompt_is_routed_on_its_start_and_claimed_whole() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engines = [engine(true), engine(true)];
    let serve = Serve::on_claims(&path, &[&engines[0], &engines[1]], &["--route-on-start"]);
    let renderer = superfluid_warm::Renderer::open(chatml()).expect("the tokenizer");
    // Long enough for many pieces; cold everywhere, so its start settles the answer.
    let prompt = message(7, 3000);
    let whole = renderer.completion(&prompt, true).expect("tokens").len();
    assert!(whole > 8 * 1024, "{whole} tokens");
    let (status, headers, answer) =
        serve.post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(headers["x-superfluid-warm-predicted"], "0");
    let first = headers["x-superfluid-warm-engine"].clone();
    // The whole prompt is claimed once its rest is tokenized: a longer prompt is priced warm on
    // that engine for all of it (whole blocks, the last token computed).
    let longer = format!("{prompt} and then some more words");
    let n = renderer.completion(&longer, true).expect("tokens").len();
    let want = (whole - 1) / 64 * 64;
    let mut route = Value::Null;
    serve.until(Duration::from_secs(10), "the whole prompt claimed", |s| {
        let (status, _, r) = s.post("/v1/route", &json!({"model": MODEL, "prompt": longer}));
        assert_eq!(status, 200, "{r}");
        route = r;
        route["engines"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["engine"] == first.as_str() && e["warm_tokens"].as_u64() >= Some(want as u64))
    });
    // /v1/route does not route on a start: its count is the prompt's.
    assert_eq!(route["prompt_tokens"], n, "{route}");
    assert_eq!(route["engine"], first.as_str(), "{route}");
    // The proxied next turn lands there, predicted as the engine delivers.
    let (status, headers, answer) =
        serve.post("/v1/completions", &json!({"model": MODEL, "prompt": longer, "max_tokens": 2}));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(headers["x-superfluid-warm-engine"], first);
    let predicted: u64 = headers["x-superfluid-warm-predicted"].parse().expect("a number");
    assert!(
        predicted >= want as u64 && predicted.abs_diff(cached(&answer)) <= 64,
        "predicted {predicted}, delivered {}",
        cached(&answer)
    );
}

#[test]
fn a_prompt_routed_on_its_start_counts_its_true_length_on_its_engine_once_tokenized() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    // Engines whose prefill takes seconds: the request waits for its first token meanwhile.
    let slow = || {
        let mut config = EngineConfig::instant(MODEL, Some(chatml()), 65_536);
        config.prefill_base = Duration::from_secs(4);
        OpenAiEngine::start(config).expect("engine")
    };
    let engines = [slow(), slow()];
    let serve = Serve::on_claims(&path, &[&engines[0], &engines[1]], &["--route-on-start"]);
    let renderer = superfluid_warm::Renderer::open(chatml()).expect("the tokenizer");
    // Words of growing length: the start's tokens a byte are not the whole's, so the count the
    // head routed on (from the start's bytes) is not the prompt's.
    let prompt: String = (0..4000).map(|w| format!("w{}", "x".repeat(w / 400))).collect::<Vec<_>>().join(" ");
    let whole = renderer.completion(&prompt, true).expect("tokens").len();
    std::thread::scope(|scope| {
        let (addr, body) = (serve.addr, json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}).to_string());
        let sent = scope.spawn(move || {
            let (status, headers, answer) = http(addr, "POST", "/v1/completions", &body);
            let answer: Value = serde_json::from_str(&answer).expect("JSON");
            assert_eq!(status, 200, "{answer}");
            assert!(headers["server-timing"].contains("desc=\"start\""), "routed on its whole: {headers:?}");
            assert_eq!(answer["usage"]["prompt_tokens"], whole, "{answer}");
        });
        // Before its first token, the engine it went to counts the whole prompt's prefill ahead.
        serve.until(Duration::from_secs(3), "the true length counted", |s| {
            let health = s.health();
            let engines = health["engines"].as_array().cloned().unwrap_or_default();
            engines.iter().any(|e| e["in_flight"] == 1 && e["prefill_tokens"] == whole)
        });
        sent.join().expect("the request");
    });
}

#[test]
fn a_next_turn_is_routed_once_its_new_text_passes_what_its_engine_holds() {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let engines = [engine(true), engine(true)];
    let serve = Serve::on_claims(&path, &[&engines[0], &engines[1]], &[]);
    let renderer = superfluid_warm::Renderer::open(chatml()).expect("the tokenizer");
    let history = message(11, 2000);
    let held = renderer.completion(&history, true).expect("tokens").len();
    let (status, headers, answer) =
        serve.post("/v1/completions", &json!({"model": MODEL, "prompt": history, "max_tokens": 2}));
    assert_eq!(status, 200, "{answer}");
    let first = headers["x-superfluid-warm-engine"].clone();
    // Its next turn: the history and as many words again, less than twice the history's
    // tokens. Its start is looked up as its pieces come (the history's found kept); once the
    // new text is two blocks past what the engine holds, the answer is settled.
    let turn = format!("{history} {}", message(12, 1500));
    let whole = renderer.completion(&turn, true).expect("tokens").len();
    assert!(whole < 2 * held && whole > held + 1024, "{held} then {whole} tokens");
    let want = (held - 1) / 64 * 64;
    // (Asked with the history alone: the turn's new text is not tokenized before it is sent.
    // Each ask claims the history too, for the engine it picks: either may hold it then.)
    serve.until(Duration::from_secs(10), "the history claimed", |s| {
        let (status, _, r) = s.post("/v1/route", &json!({"model": MODEL, "prompt": history}));
        assert_eq!(status, 200, "{r}");
        let warm = |e: &Value| e["engine"] == first.as_str() && e["warm_tokens"].as_u64() >= Some(want as u64);
        r["engines"].as_array().into_iter().flatten().any(warm)
    });
    let (status, headers, answer) =
        serve.post("/v1/completions", &json!({"model": MODEL, "prompt": turn, "max_tokens": 2}));
    assert_eq!(status, 200, "{answer}");
    assert!(headers["server-timing"].contains("desc=\"start\""), "routed on its whole: {}", headers["server-timing"]);
    let predicted: u64 = headers["x-superfluid-warm-predicted"].parse().expect("a number");
    assert!(
        predicted >= want as u64 && predicted.abs_diff(cached(&answer)) <= 64,
        "predicted {predicted}, delivered {}",
        cached(&answer)
    );
}
