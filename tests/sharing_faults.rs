//! A sharing head facing a server it cannot use: a malformed URL, no server at the address, a
//! server without JetStream, and a stream that vanished from under the heads (the server lost
//! its store). Each is refused or reported with its real reason, within seconds, never a hang.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::nats::{NatsServer, published};
use harness::replay::Config;
use harness::trace;
use superfluid_warm::{Builder, Error, SharedWarm, Sharing, Warm};

const MODEL: &str = "m";

fn builder() -> Builder {
    let mut b = Warm::builder();
    b.capacity(3_000).sync_window(Duration::from_millis(10));
    b
}

fn prompt(c: u32) -> Vec<u32> {
    (0..(64 * 4 + 17)).map(|i| (c + 1) * 1_000_000 + i).collect()
}

/// A loopback port nothing listens on.
fn dead_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
    format!("nats://127.0.0.1:{port}")
}

#[test]
fn a_malformed_server_url_is_refused_at_open_and_says_what_a_url_looks_like() {
    let dir = tempfile::tempdir().expect("dir");
    for url in ["garbage", "", "http://x", "nats://", "nats://:4222", "127.0.0.1:4222", "nats://h:notaport"] {
        let file = dir.path().join("a.redb");
        match SharedWarm::open(&builder(), &file, Sharing::nats(url, "s", "a")) {
            Err(e @ Error::Sharing { .. }) => {
                let text = e.to_string();
                assert!(text.contains(&format!("{url:?}")), "names the URL it refused: {text}");
                assert!(text.contains("nats://127.0.0.1:4222"), "says what a valid URL looks like: {text}");
            }
            other => panic!("{url:?} is not a NATS server URL, yet open gave {other:?}"),
        }
        assert!(!file.exists(), "{url:?}: refused before the file is made");
    }
    // Well-formed URLs open (nothing listens there: the head routes locally meanwhile).
    for url in [dead_url(), "tls://127.0.0.1:1".to_string(), "nats://localhost".to_string()] {
        let h = SharedWarm::open(&builder(), dir.path().join("ok.redb"), Sharing::nats(&url, "s", "a"))
            .unwrap_or_else(|e| panic!("{url} is a NATS URL: {e}"));
        h.close().expect("close");
    }
}

/// The replay over heads against `url`: its error, and how long it took to give it.
fn replay_heads(url: &str) -> (Error, Duration) {
    let dir = tempfile::tempdir().expect("dir");
    let requests = trace::synthetic(100, 10, 42);
    let started = Instant::now();
    let result = harness::heads::run_heads(&builder(), dir.path(), url, &requests, &Config::default(), 2);
    match result {
        Ok(r) => panic!("the replay over heads succeeded against {url}: {r:?}"),
        Err(e) => (e, started.elapsed()),
    }
}

#[test]
fn the_replay_over_heads_fails_fast_when_nothing_listens_at_the_address() {
    let url = dead_url();
    let (e, took) = replay_heads(&url);
    let text = e.to_string();
    assert!(took < Duration::from_secs(20), "failed after {took:?}, not within seconds: {text}");
    assert!(matches!(e, Error::Sharing { .. }), "{e:?}");
    assert!(text.contains(&url) && text.to_lowercase().contains("refused"), "names the address and why: {text}");
}

#[test]
fn the_replay_over_heads_fails_fast_on_a_server_without_jetstream() {
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start_without_jetstream(&dir.path().join("js"));
    let (e, took) = replay_heads(&server.url());
    let text = e.to_string();
    assert!(took < Duration::from_secs(20), "failed after {took:?}, not within seconds: {text}");
    assert!(matches!(e, Error::Sharing { .. }), "{e:?}");
    assert!(text.contains("JetStream") && text.contains("-js"), "says JetStream is off and how to turn it on: {text}");
}

#[test]
fn a_sync_that_cannot_publish_says_why() {
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start_without_jetstream(&dir.path().join("js"));
    let sharing = Sharing::nats(&server.url(), "s", "a").publish_timeout(Duration::from_secs(1));
    let h = SharedWarm::open(&builder(), dir.path().join("a.redb"), sharing).expect("opens");
    h.ran(MODEL, &prompt(1), "node-1").expect("ran");
    match h.sync() {
        Err(e @ Error::Unpublished { events: 1, .. }) => {
            assert!(e.to_string().contains("JetStream"), "the link's reason is in the error: {e}");
        }
        other => panic!("sync against a server without JetStream: {other:?}"),
    }
}

fn head(dir: &Path, server: &NatsServer, name: &str) -> SharedWarm {
    let sharing = Sharing::nats(&server.url(), "lost", name).publish_timeout(Duration::from_secs(2));
    SharedWarm::open(&builder(), dir.join(format!("{name}.redb")), sharing).expect("a sharing head opens")
}

#[test]
fn a_stream_deleted_under_the_heads_is_reported_not_waited_on() {
    let dir = tempfile::tempdir().expect("dir");
    let mut server = NatsServer::start(&dir.path().join("js"));
    let (a, b) = (head(dir.path(), &server, "a"), head(dir.path(), &server, "b"));
    for i in 0..40u32 {
        [&a, &b][(i % 2) as usize].ran(MODEL, &prompt(i), "node-1").expect("ran");
    }
    for h in [&a, &b] {
        published(h);
    }
    for h in [&a, &b] {
        assert!(h.wait_applied(40, Duration::from_secs(30)), "{:?}", h.share_stats());
    }
    server.restart_without_store();
    for i in 0..10u32 {
        a.ran(MODEL, &prompt(100 + i), "node-2").expect("a ran never waits on the network");
    }
    // A new head makes a new stream of that name; a and b must not take it for theirs (it may
    // come before or after they notice theirs is gone).
    let c = head(dir.path(), &server, "c");
    c.ran(MODEL, &prompt(200), "node-3").expect("ran");
    let started = Instant::now();
    while let Err(e) = c.sync() {
        assert!(started.elapsed() < Duration::from_secs(20), "c publishes to the new stream: {e}");
    }
    assert!(c.wait_applied(1, Duration::from_secs(30)), "c applies the new stream: {:?}", c.share_stats());
    let started = Instant::now();
    while [&a, &b].iter().any(|h| h.share_stats().halted.is_none()) && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for h in [&a, &b] {
        let s = h.share_stats();
        let halted = s.halted.clone().unwrap_or_else(|| panic!("the head says its stream is gone: {s:?}"));
        assert!(halted.contains("was deleted") && halted.contains("new files"), "{halted}");
        assert_eq!((s.applied, s.durable), (40, 40), "nothing applied from the new stream: {s:?}");
    }
    // Waits end with the reason rather than run out (or, before, never end).
    let started = Instant::now();
    match a.sync() {
        Err(e @ Error::Sharing { .. }) => assert!(e.to_string().contains("was deleted"), "{e}"),
        other => panic!("sync after the stream was deleted: {other:?}"),
    }
    assert!(!b.wait_applied(41, Duration::from_secs(30)), "b applies nothing more");
    assert!(started.elapsed() < Duration::from_secs(20), "the waits ended at the halt: {:?}", started.elapsed());
}

/// `superfluid-warm listen PATH --nats URL` with `extra` arguments, its stderr piped.
fn listen_nats(path: &Path, url: &str, extra: &[String]) -> common::Reaped {
    common::Reaped(
        std::process::Command::new(common::bin())
            .arg("listen")
            .arg(path)
            .args(["--nats", url, "--stream", "warm", "--head", "bridge", "--model", "m"])
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn listen"),
    )
}

/// `superfluid-warm check PATH` exits 0: the file was closed cleanly.
fn checks_healthy(path: &Path) {
    let out = std::process::Command::new(common::bin()).arg("check").arg(path).output().expect("check");
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// `listen --nats` against a server without JetStream, and against an address nothing listens
/// at: a warning with the reason at once, status lines that say the link is not up, and, with
/// no stream by --nats-wait, exit code 1 (the file closed cleanly), the reason in `stats`.
#[test]
fn listen_without_a_usable_nats_server_warns_and_exits_non_zero() {
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start_without_jetstream(&dir.path().join("js"));
    for (url, why, state) in
        [(server.url(), "JetStream", "connected, no stream yet"), (dead_url(), "refused", "NOT connected")]
    {
        let path = dir.path().join("listen.redb");
        let started = Instant::now();
        let extra = ["--nats-wait", "3", "--status-every", "0.5"].map(String::from);
        let mut child = listen_nats(&path, &url, &extra);
        let (status, stderr) = child.ends_within(Duration::from_secs(30), "no usable server");
        let code = status.code();
        assert_eq!(code, Some(1), "{url}: {stderr}");
        assert!(started.elapsed() >= Duration::from_secs(3), "waited --nats-wait first");
        let warning = stderr.lines().find(|l| l.contains("WARN") && l.contains(why));
        assert!(warning.is_some(), "{url}: a warning says why: {stderr}");
        assert!(stderr.contains(state), "{url}: the status lines say so: {stderr}");
        assert!(stderr.contains("no NATS stream") && stderr.contains("exit code 1"), "{url}: {stderr}");
        checks_healthy(&path);
        let out = std::process::Command::new(common::bin()).arg("stats").arg(&path).arg("--json").output();
        let stats: serde_json::Value = serde_json::from_slice(&out.expect("stats").stdout).expect("JSON");
        assert_eq!(stats["listener_running"], false, "{stats}");
        assert!(stats["listener_error"].as_str().is_some_and(|e| e.contains(why)), "{url}: {stats}");
    }
}

/// The stream `listen --nats` bridges into is deleted: the link halts, and `listen` says so and
/// exits 1 rather than go on taking batches that no head will ever apply; its file is closed
/// cleanly.
#[test]
fn listen_stops_when_its_stream_is_deleted() -> Result<(), Error> {
    use harness::engine_sim::{Publisher, SimEngine};
    use superfluid_warm::Snapshot;
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start(&dir.path().join("js"));
    let publisher = Publisher::new(Duration::ZERO)?;
    let mut engine = SimEngine::new(16, 1 << 20, MODEL, None)?;
    let path = dir.path().join("bridge.redb");
    let engine_spec = format!("gpu-0={},replay={}", publisher.events, publisher.replay);
    let extra = ["--engine", &engine_spec, "--status-every", "0.5", "--replay-timeout", "30"].map(String::from);
    let mut child = listen_nats(&path, &server.url(), &extra);
    let applied = || {
        Snapshot::open(&path).ok().and_then(|s| s.stats().ok()).and_then(|s| s.engines.first().and_then(|e| e.last_seq))
    };
    let mut c = 0u32;
    let mut publish = |engine: &mut SimEngine| {
        publisher.publish(&engine.run(&prompt(c)), false).expect("publish");
        c += 1;
        std::thread::sleep(Duration::from_millis(20));
    };
    let started = Instant::now();
    while applied().is_none_or(|s| s < 5) {
        assert!(started.elapsed() < Duration::from_secs(60), "the bridge applies the stream");
        publish(&mut engine);
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    runtime.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.expect("a client"));
        js.delete_stream("warm").await.expect("the stream is deleted");
    });
    let started = Instant::now();
    while child.0.try_wait().ok().flatten().is_none() && started.elapsed() < Duration::from_secs(30) {
        publish(&mut engine);
    }
    let (status, stderr) = child.ends_within(Duration::from_secs(5), "the stream was deleted");
    let code = status.code();
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("halted") && stderr.contains("was deleted"), "{stderr}");
    assert!(stderr.contains("closed cleanly"), "{stderr}");
    checks_healthy(&path);
    Ok(())
}
