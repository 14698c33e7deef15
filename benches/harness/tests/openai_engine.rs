//! The simulated OpenAI-compatible engine (`harness::openai_engine`) as a client and a head see
//! it: completions and chats, streamed and not, `cached_tokens` as vLLM reports it, `/tokenize`
//! giving the library's `Renderer` ids, its KV events followed by a head's listener, its batch
//! limit, and clear refusals.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::openai_engine::{EngineConfig, OpenAiEngine};
use serde_json::{Value, json};
use superfluid_warm::{EngineEndpoint, Listener, Namespace, ReadIndex, Renderer, Warm};

fn chatml() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/render/chatml"))
}

/// One HTTP request; (status, body).
fn call(addr: SocketAddr, method: &str, path: &str, body: &Value) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    let body = if body.is_null() { String::new() } else { body.to_string() };
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut out = String::new();
    stream.read_to_string(&mut out).expect("read to the close");
    let (head, body) = out.split_once("\r\n\r\n").expect("a response");
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("a status");
    (status, body.to_string())
}

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).expect("JSON")
}

fn cached(response: &Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens")
}

#[test]
fn requests_are_served_with_cached_tokens_and_the_events_reach_a_head() {
    let engine = OpenAiEngine::start(EngineConfig::instant("m", Some(chatml()), 4096)).expect("an engine");
    let dir = tempfile::tempdir().expect("a folder");
    let warm = Arc::new(Warm::open(dir.path().join("warm.redb")).expect("an index"));
    let endpoint = EngineEndpoint::parse(&format!("gpu-0={},replay={}", engine.events, engine.replay), Some("m"))
        .expect("an endpoint");
    let listener = Listener::start(Arc::clone(&warm), &[endpoint], Duration::from_secs(30)).expect("a listener");
    std::thread::sleep(Duration::from_millis(300)); // ZMQ's subscription settles

    // Token ids: the first request finds nothing, the same again its whole blocks but the last
    // token's.
    let ids: Vec<u32> = (0..200).map(|i| (i * 7 + 3) % 1500).collect();
    let request = json!({"model": "m", "prompt": ids, "max_tokens": 3});
    let (status, first) = call(engine.addr, "POST", "/v1/completions", &request);
    assert_eq!(status, 200, "{first}");
    let first = json_of(&first);
    assert_eq!((cached(&first), first["usage"]["prompt_tokens"].as_u64()), (0, Some(200)));
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let second = json_of(&call(engine.addr, "POST", "/v1/completions", &request).1);
    assert_eq!(cached(&second), 192, "12 blocks of 16; the 200th token is always computed");
    // The head follows the engine's events: the prompt is warm on gpu-0, 3 blocks of ours.
    let ns = Namespace::new("m").expect("a namespace");
    let deadline = Instant::now() + Duration::from_secs(20);
    let warm_on_engine = loop {
        let hits = warm.warm_nodes_prefix(&warm.prefix(&ns, &ids)).expect("an answer");
        if let Some(hit) = hits.into_iter().find(|h| h.node == "gpu-0") {
            break hit.tokens;
        }
        assert!(Instant::now() < deadline, "the engine's events never arrived");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(warm_on_engine, 192);

    // A chat in text: `/tokenize` gives the library's ids, and a turn that extends it finds
    // the first's blocks cached, streamed with the usage last.
    let messages = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cache and the prefix of the router ".repeat(8)}]);
    let renderer = Renderer::open(chatml()).expect("the model");
    let want = renderer.chat(&messages.to_string(), None, true).expect("renders");
    let (status, tokenized) = call(engine.addr, "POST", "/tokenize", &json!({"model": "m", "messages": messages}));
    assert_eq!(status, 200, "{tokenized}");
    let tokenized: Vec<u32> = serde_json::from_value(json_of(&tokenized)["tokens"].clone()).expect("tokens");
    assert_eq!(tokenized, want);
    let chat = json!({"model": "m", "messages": messages, "max_tokens": 2});
    let first = json_of(&call(engine.addr, "POST", "/v1/chat/completions", &chat).1);
    assert_eq!((cached(&first), first["choices"][0]["message"]["role"].as_str()), (0, Some("assistant")));
    let mut longer = messages.clone();
    if let Some(list) = longer.as_array_mut() {
        list.push(json!({"role": "assistant", "content": "ok"}));
        list.push(json!({"role": "user", "content": "and more"}));
    }
    let streamed = json!({"model": "m", "messages": longer, "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}});
    let (status, events) = call(engine.addr, "POST", "/v1/chat/completions", &streamed);
    assert_eq!(status, 200);
    let data: Vec<&str> = events.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!((data.len(), data.last().copied()), (6, Some("[DONE]")), "4 tokens, the usage, the end");
    let usage = json_of(data[4]);
    let held = want.len() / 16 * 16;
    assert_eq!(cached(&usage) as usize, held, "the first turn's whole blocks");
    assert_eq!(json_of(data[3])["choices"][0]["finish_reason"], "length");
    drop(listener);
}

#[test]
fn what_is_not_served_is_refused_clearly_and_the_batch_limit_queues() {
    let mut config = EngineConfig::instant("m", None, 1024);
    (config.batch, config.prefill_base) = (1, Duration::from_millis(100));
    let engine = OpenAiEngine::start(config).expect("an engine");
    assert_eq!(call(engine.addr, "GET", "/health", &Value::Null).0, 200);
    let models = json_of(&call(engine.addr, "GET", "/v1/models", &Value::Null).1);
    assert_eq!(models["data"][0]["id"], "m");
    assert_eq!(call(engine.addr, "GET", "/v1/nope", &Value::Null).0, 404);
    for bad in
        [json!({"prompt": "text, and no tokenizer"}), json!({"prompt": [1, -2]}), json!({"prompt": []}), json!({})]
    {
        let (status, body) = call(engine.addr, "POST", "/v1/completions", &bad);
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(json_of(&body)["error"]["message"].is_string(), "{body}");
    }
    // One slot: two requests at once take two prefills, one after the other.
    let started = Instant::now();
    let addr = engine.addr;
    let both: Vec<_> = (0..2)
        .map(|i| {
            std::thread::spawn(move || {
                call(addr, "POST", "/v1/completions", &json!({"prompt": [i, 1, 2], "max_tokens": 1})).0
            })
        })
        .collect();
    for t in both {
        assert_eq!(t.join().expect("a client"), 200);
    }
    assert!(started.elapsed() >= Duration::from_millis(200), "{:?}", started.elapsed());
}
