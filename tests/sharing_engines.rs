//! Engine KV cache events across heads, through a real NATS JetStream server and loopback vLLM
//! publishers: 3 heads and 4 engines, with every head subscribed to every engine (llm-d's way)
//! or one head bridging them, batches lost on the way (replayed from the engines), an engine
//! restart, and a bridge (`superfluid-warm listen --nats`, itself a head) killed with SIGKILL and
//! restarted.
//! Every head ends with the same engine streams, the same blocks and the same answers, what the
//! engines hold, and no batch is applied twice.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Reaped;
use common::Rng;
use common::nats::{NatsServer, published};
use harness::engine_sim::{Publisher, SimEngine as Engine};
use superfluid_warm::{
    EngineBlockEntry, EngineEndpoint, EngineStats, Listener, ReadIndex, SharedWarm, Sharing, Snapshot, Warm,
};

const ENGINES: usize = 4;

fn head(dir: &Path, server: &NatsServer, stream: &str, name: &str) -> Arc<SharedWarm> {
    let mut b = Warm::builder();
    b.sync_window(Duration::from_millis(10));
    Arc::new(
        SharedWarm::open(&b, dir.join(format!("{name}.redb")), Sharing::nats(&server.url(), stream, name))
            .expect("a sharing head opens"),
    )
}

fn endpoints(publishers: &[Publisher]) -> Vec<EngineEndpoint> {
    publishers
        .iter()
        .enumerate()
        .map(|(i, p)| {
            EngineEndpoint::parse(&format!("gpu-{i}={},replay={}", p.events, p.replay), Some("m")).expect("a spec")
        })
        .collect()
}

/// Waits (up to two minutes: the machine may be loaded) until `done`.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(120), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether every head has applied every engine's last batch (its number and publish time: a
/// restarted engine's numbers meet the old process's again).
fn caught_up(heads: &[Arc<SharedWarm>], engines: &[Engine]) -> bool {
    heads.iter().all(|h| {
        let stats = h.engine_stats().unwrap_or_default();
        engines.iter().enumerate().all(|(i, e)| {
            let last = e.published.back().map(|b| (b.seq, b.ts.to_bits()));
            let applied = stats.iter().find(|s| s.node == format!("gpu-{i}"));
            applied.map(|s| s.last_seq.map(|seq| (seq, s.last_ts.to_bits()))) == Some(last)
        })
    })
}

/// A head's engine streams, comparable across heads (publish times included).
fn streams(h: &SharedWarm) -> Vec<EngineStats> {
    let mut s = h.engine_stats().expect("engine stats");
    s.sort_by(|a, b| a.node.cmp(&b.node));
    s
}

/// Every engine block a head's file holds, as `dump --engines` lists them (read live).
fn blocks(dir: &Path, name: &str) -> Vec<EngineBlockEntry> {
    let snapshot = Snapshot::open(dir.join(format!("{name}.redb"))).expect("a snapshot");
    let mut out = Vec::new();
    snapshot
        .visit_engine_blocks(|b| {
            out.push(b);
            true
        })
        .expect("engine blocks");
    out.sort_by(|a, b| (&a.node, a.hash).cmp(&(&b.node, b.hash)));
    out
}

/// The engines run conversations; one batch in `lose_one_in` never reaches the subscribers
/// (the next shows the gap, and the engine replays it). Returns the batches published.
fn run_engines(
    engines: &mut [Engine],
    publishers: &[Publisher],
    steps: usize,
    lose_one_in: u64,
    rng: &mut Rng,
    conversations: &mut common::Conversations,
) -> u64 {
    for _ in 0..steps {
        let (_, prompt) = conversations.turn(rng);
        let e = rng.below(ENGINES as u64) as usize;
        let batch = engines[e].run(&prompt);
        publishers[e].publish(&batch, rng.below(lose_one_in) == 0).expect("publish");
        std::thread::sleep(Duration::from_millis(2));
    }
    steps as u64
}

/// Waits until every head has applied every engine's last batch. Until a listener hears a live
/// batch after a loss it does not know of it: the engines run one more request a second
/// meanwhile. Returns the batches they published so.
fn catch_up(
    heads: &[Arc<SharedWarm>],
    engines: &mut [Engine],
    publishers: &[Publisher],
    rng: &mut Rng,
    conversations: &mut common::Conversations,
) -> u64 {
    let what = "every head to apply every engine's last batch";
    run_until(what, |engines| caught_up(heads, engines), engines, publishers, rng, conversations)
}

/// Waits until `done`, the engines running a few more requests (and publishing their batches,
/// none lost) each second meanwhile: a listener learns of what it missed only from a live
/// batch. Returns the batches they published so.
fn run_until(
    what: &str,
    mut done: impl FnMut(&[Engine]) -> bool,
    engines: &mut [Engine],
    publishers: &[Publisher],
    rng: &mut Rng,
    conversations: &mut common::Conversations,
) -> u64 {
    let mut published = 0;
    let mut poked = Instant::now();
    wait_until(what, || {
        if done(engines) {
            return true;
        }
        if poked.elapsed() > Duration::from_secs(1) {
            published += run_engines(engines, publishers, 4, u64::MAX, rng, conversations);
            poked = Instant::now();
        }
        false
    });
    published
}

/// Every head holds the same streams and blocks, answers alike, and answers what the engines
/// hold; no batch was applied twice. Returns the batches applied per head.
fn check_heads(dir: &Path, names: &[&str], heads: &[Arc<SharedWarm>], engines: &[Engine], prompts: &[Vec<u32>]) -> u64 {
    // What each has applied, committed: the files are read as they are on disk.
    for h in heads {
        published(h);
    }
    let first = streams(&heads[0]);
    let first_blocks = blocks(dir, names[0]);
    for (h, name) in heads.iter().zip(names).skip(1) {
        assert_eq!(streams(h), first, "{name}'s engine streams");
        assert_eq!(blocks(dir, name), first_blocks, "{name}'s engine blocks");
    }
    let mut warm = 0;
    for p in prompts {
        let answers = heads[0].warm_nodes("m", p).expect("warm_nodes");
        for h in &heads[1..] {
            assert_eq!(h.warm_nodes("m", p).expect("warm_nodes"), answers, "every head answers alike");
        }
        for (i, e) in engines.iter().enumerate() {
            let held = e.holds(p) / 64 * 64;
            let want = if held >= 128 { held } else { 0 };
            let got = answers.iter().find(|h| h.node == format!("gpu-{i}")).map_or(0, |h| h.tokens);
            assert_eq!(got, want, "gpu-{i} is answered for what its engine holds");
            warm += usize::from(got > 0);
        }
    }
    assert!(warm >= 8, "warm answers to check: {warm}");
    for s in &first {
        assert_eq!(s.counts.lost, 0, "{}: every gap replayed", s.node);
    }
    first.iter().map(|s| s.counts.batches).sum()
}

#[test]
fn three_heads_and_four_engines_share_one_view_whoever_subscribes() {
    for every_head_subscribes in [true, false] {
        let dir = common::tempdir();
        let server = NatsServer::start(&dir.path().join("nats"));
        let names = ["head-a", "head-b", "head-c"];
        let heads: Vec<Arc<SharedWarm>> = names.iter().map(|n| head(dir.path(), &server, "warm", n)).collect();
        let publishers: Vec<Publisher> =
            (0..ENGINES).map(|_| Publisher::new(Duration::ZERO).expect("a publisher")).collect();
        let mut engines: Vec<Engine> =
            (0..ENGINES).map(|i| Engine::new(16, 600, "m", Some(i as u64 + 1)).expect("an engine")).collect();
        let subscribing = if every_head_subscribes { &heads[..] } else { &heads[..1] };
        let listeners: Vec<Listener> = subscribing
            .iter()
            .map(|h| Listener::start(Arc::clone(h), &endpoints(&publishers), Duration::from_secs(30)).expect("listen"))
            .collect();
        let mut rng = Rng(if every_head_subscribes { 5 } else { 6 });
        let mut conversations = common::Conversations::new(10);
        // ZMQ's slow joiner: what is published before the subscribers join is replayed from 0.
        let mut published = run_engines(&mut engines, &publishers, 150, 10, &mut rng, &mut conversations);
        // An engine restarts (a new process: numbers from 0, an empty cache, nothing to replay);
        // another restarts with its clock 60 s behind the old process's (an NTP step): a
        // restart too, not copies of batches already forwarded. Both once every gap so far is
        // replayed: a gap the listener sees only after the restart cannot be (its batches are
        // gone with the old process) and clears the node, as it must.
        published += catch_up(&heads, &mut engines, &publishers, &mut rng, &mut conversations);
        engines[1].restart();
        publishers[1].restart();
        engines[2].restart_with_clock(-60.0);
        publishers[2].restart();
        published += run_engines(&mut engines, &publishers, 60, 10, &mut rng, &mut conversations);
        published += catch_up(&heads, &mut engines, &publishers, &mut rng, &mut conversations);
        let seen: Vec<_> = listeners.into_iter().map(Listener::stop).collect();
        let applied = check_heads(dir.path(), &names, &heads, &engines, &conversations.prompts);
        assert_eq!(applied, published, "every batch applied once by each head");
        let replays: u64 = seen.iter().flatten().map(|s| s.replays).sum();
        let stats = streams(&heads[0]);
        let restarts: u64 = stats.iter().map(|s| s.counts.restarts).sum();
        let copies: u64 = stats.iter().map(|s| s.counts.duplicate_batches).sum();
        assert!(replays > 0 && restarts == 2, "replays {replays}, restarts {restarts}");
        println!(
            "every head subscribes: {every_head_subscribes}; {published} batches published, each applied once by every head; stream at {}; {replays} replays; {copies} late copies skipped; {restarts} engine restarts",
            server.last_seq("warm")
        );
        for h in heads {
            Arc::try_unwrap(h).expect("the only handle").close().expect("close");
        }
    }
}

/// `superfluid-warm listen --nats`: a bridge that publishes the engines' batches to the stream
/// (and applies the stream to its own file).
fn bridge(dir: &Path, server: &NatsServer, publishers: &[Publisher]) -> Reaped {
    let mut command = Command::new(env!("CARGO_BIN_EXE_superfluid-warm"));
    command.arg("listen").arg(dir.join("bridge.redb")).args([
        "--model",
        "m",
        "--status-every",
        "0",
        "--replay-timeout",
        "30",
    ]);
    command.args(["--nats", &server.url(), "--stream", "warm", "--head", "bridge"]);
    for spec in endpoints(publishers) {
        command.arg("--engine").arg(format!(
            "{}={},replay={}",
            spec.node,
            spec.events,
            spec.replay.unwrap_or_default()
        ));
    }
    Reaped(command.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("spawn listen --nats"))
}

/// The bridge killed with SIGKILL mid-stream, batches published while it is down, then
/// restarted; and the NATS server restarted under the heads: the bridge resumes from its
/// file's position (replaying what it missed, the stream keeping each batch once) and every
/// head converges on what the engines hold.
#[test]
fn a_killed_bridge_and_a_restarted_server_lose_nothing() {
    let dir = common::tempdir();
    let mut server = NatsServer::start(&dir.path().join("nats"));
    let names = ["head-a", "head-b"];
    let heads: Vec<Arc<SharedWarm>> = names.iter().map(|n| head(dir.path(), &server, "warm", n)).collect();
    let publishers: Vec<Publisher> =
        (0..ENGINES).map(|_| Publisher::new(Duration::ZERO).expect("a publisher")).collect();
    let mut engines: Vec<Engine> =
        (0..ENGINES).map(|i| Engine::new(16, 600, "m", Some(i as u64 + 11)).expect("an engine")).collect();
    let mut rng = Rng(17);
    let mut conversations = common::Conversations::new(10);
    let mut child = bridge(dir.path(), &server, &publishers);
    let mut published = run_engines(&mut engines, &publishers, 80, 12, &mut rng, &mut conversations);
    // ZMQ's slow joiner: a bridge that subscribes after the engines' last batch (it starts
    // slowly on a loaded machine) hears of none until the next, so the engines run on meanwhile.
    let first_batch =
        |_: &[Engine]| heads.iter().all(|h| h.engine_stats().is_ok_and(|s| s.iter().any(|e| e.counts.batches > 10)));
    let what = "a first batch applied by the heads";
    published += run_until(what, first_batch, &mut engines, &publishers, &mut rng, &mut conversations);
    child.0.kill().expect("SIGKILL");
    child.0.wait().expect("reaped");
    published += run_engines(&mut engines, &publishers, 40, 12, &mut rng, &mut conversations);
    server.restart();
    let _child = bridge(dir.path(), &server, &publishers);
    published += run_engines(&mut engines, &publishers, 40, 12, &mut rng, &mut conversations);
    published += catch_up(&heads, &mut engines, &publishers, &mut rng, &mut conversations);
    let applied = check_heads(dir.path(), &names, &heads, &engines, &conversations.prompts);
    assert_eq!(applied, published, "every batch applied once by each head");
    // The bridge is a head too: killed mid-stream, it resumed from its file's position, and its
    // file converges on the same blocks (read live, beside it).
    let want = blocks(dir.path(), names[0]);
    wait_until("the bridge's file to hold what the heads hold", || {
        Snapshot::open(dir.path().join("bridge.redb")).is_ok() && blocks(dir.path(), "bridge") == want
    });
    println!(
        "bridge killed and restarted, server restarted: {published} batches, each applied once by every head and the bridge"
    );
    for h in heads {
        Arc::try_unwrap(h).expect("the only handle").close().expect("close");
    }
}
