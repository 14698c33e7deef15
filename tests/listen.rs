//! The ingester against a real ZMQ publisher on loopback speaking vLLM's wire format: live
//! batches, lost batches covered by replays, a replay that answers too late (the node is
//! cleared), and `superfluid-warm listen` killed with SIGKILL mid-stream and restarted.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Reaped;
use common::Rng;
use superfluid_warm::tools::engine_sim::{Publisher, SimEngine as Engine};
use superfluid_warm::{EngineEndpoint, Error, Listener, ReadIndex, Snapshot, Warm};

/// Waits (up to a minute: the machine may be loaded) until `done`.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Tokens of each of `prompts` the index answers node `node` warm for, against what `engine`
/// can serve (whole 64-token blocks, from 2).
fn compare(warm: &Warm, engine: &Engine, prompts: &[Vec<u32>]) -> Result<Vec<(usize, usize)>, Error> {
    let mut out = Vec::new();
    for p in prompts {
        let answered = warm.warm_nodes("m", p)?.into_iter().find(|h| h.node == "gpu-0").map_or(0, |h| h.tokens);
        let serves = engine.holds(p) / 64 * 64;
        out.push((answered, if serves >= 128 { serves } else { 0 }));
    }
    Ok(out)
}

fn endpoint(publisher: &Publisher) -> EngineEndpoint {
    EngineEndpoint::parse(&format!("gpu-0={},replay={}", publisher.events, publisher.replay), Some("m"))
        .expect("an endpoint")
}

/// Conversations published live, one batch in five lost on the way: every lost batch is
/// replayed, and the index answers exactly what the engine holds.
#[test]
fn lost_batches_are_replayed_and_the_index_equals_the_engine() -> Result<(), Error> {
    let dir = common::tempdir();
    let warm = Arc::new(Warm::open(dir.path().join("l.redb"))?);
    let publisher = Publisher::new(Duration::ZERO)?;
    let listener = Listener::start(Arc::clone(&warm), &[endpoint(&publisher)], Duration::from_secs(30))?;
    let mut engine = Engine::new(16, 3000, "m", Some(2))?;
    let mut rng = Rng(7);
    let mut conversations = common::Conversations::new(8);
    for i in 0..120 {
        let (_, prompt) = conversations.turn(&mut rng);
        let batch = engine.run(&prompt);
        publisher.publish(&batch, i % 5 == 2)?;
        std::thread::sleep(Duration::from_millis(2));
    }
    let last = engine.published.back().map(|b| b.seq);
    wait_until("the last batch", || warm.engine_stats().is_ok_and(|s| s.first().and_then(|e| e.last_seq) == last));
    let stats = listener.stop();
    let pairs = compare(&warm, &engine, &conversations.prompts)?;
    assert!(pairs.iter().all(|(a, w)| a == w), "answered vs held: {pairs:?}");
    assert!(pairs.iter().filter(|(a, _)| *a > 0).count() >= 4, "warm answers to check: {pairs:?}");
    let counts = &warm.engine_stats()?[0].counts;
    assert!(stats[0].replays >= 20 && stats[0].replays_short == 0, "{stats:?}");
    assert!(counts.gaps >= 20 && counts.lost == 0, "{counts:?}");
    println!("{stats:?}\n{counts:?}");
    Ok(())
}

/// A replay endpoint that answers after the listener gave up: the gap is lost, the node is
/// cleared (it is answered for less than its engine holds, never more) and its stream goes on.
#[test]
fn a_replay_that_answers_late_clears_the_node() -> Result<(), Error> {
    let dir = common::tempdir();
    let warm = Arc::new(Warm::open(dir.path().join("late.redb"))?);
    let publisher = Publisher::new(Duration::from_secs(2))?;
    let listener = Listener::start(Arc::clone(&warm), &[endpoint(&publisher)], Duration::from_millis(200))?;
    let mut engine = Engine::new(16, 1 << 20, "m", Some(2))?;
    let first: Vec<u32> = (0..64 * 5).collect();
    let second: Vec<u32> = (10_000..10_000 + 64 * 5).collect();
    // The first batch is sent until the subscriber has joined (ZMQ's slow joiner).
    let batch = engine.run(&first);
    wait_until("the first batch", || {
        publisher.publish(&batch, false).expect("publish");
        std::thread::sleep(Duration::from_millis(50));
        warm.warmest("m", &first).is_ok_and(|h| h.is_some())
    });
    // A batch lost, and the replay of it comes too late.
    publisher.publish(&engine.run(&second), true).expect("publish");
    let third: Vec<u32> = (20_000..20_000 + 64 * 5).collect();
    publisher.publish(&engine.run(&third), false).expect("publish");
    wait_until("the third batch", || warm.warmest("m", &third).is_ok_and(|h| h.is_some()));
    let stats = listener.stop();
    assert!(stats[0].replays_short >= 1, "{stats:?}");
    assert_eq!(warm.warmest("m", &first)?, None, "cleared: the index knows less than the engine");
    assert_eq!(warm.warmest("m", &second)?, None, "never seen");
    assert_eq!(warm.engine_stats()?[0].counts.lost, 1);
    Ok(())
}

/// A head that starts after its engine has been running (a deploy, a new head): the stores it
/// hears first name parents stored before it listened. Its stream's first batch is not the
/// engine's first, so it asks a replay from the engine's start; the parents arrive, nothing is
/// left unknown, and the index answers exactly what the engine holds.
#[test]
fn a_listener_that_joins_late_replays_the_engine_from_its_start() -> Result<(), Error> {
    let dir = common::tempdir();
    let publisher = Publisher::new(Duration::ZERO)?;
    let mut engine = Engine::new(16, 1 << 20, "m", None)?;
    let mut rng = Rng(23);
    let mut conversations = common::Conversations::new(6);
    // Published to nobody: only the replay buffer keeps them.
    for _ in 0..40 {
        let (_, prompt) = conversations.turn(&mut rng);
        publisher.publish(&engine.run(&prompt), false)?;
    }
    let warm = Arc::new(Warm::open(dir.path().join("late-joiner.redb"))?);
    let listener = Listener::start(Arc::clone(&warm), &[endpoint(&publisher)], Duration::from_secs(30))?;
    // Later turns of the same conversations (their parents are in the batches above), one a
    // poll until the subscriber has joined and caught up.
    let mut poked = Instant::now() - Duration::from_secs(1);
    wait_until("the last batch", || {
        let last = engine.published.back().map(|b| b.seq);
        if warm.engine_stats().is_ok_and(|s| s.first().and_then(|e| e.last_seq) == last) {
            return true;
        }
        if poked.elapsed() >= Duration::from_millis(200) {
            let (_, prompt) = conversations.turn(&mut rng);
            publisher.publish(&engine.run(&prompt), false).expect("publish");
            poked = Instant::now();
        }
        false
    });
    let stats = listener.stop();
    let counts = &warm.engine_stats()?[0].counts;
    assert_eq!((counts.unknown_parents, counts.lost), (0, 0), "replayed from the start: {counts:?}");
    assert!(stats[0].replays >= 1, "{stats:?}");
    let pairs = compare(&warm, &engine, &conversations.prompts)?;
    assert!(pairs.iter().all(|(a, w)| a == w), "answered vs held: {pairs:?}");
    assert!(pairs.iter().filter(|(a, _)| *a > 0).count() >= 4, "warm answers to check: {pairs:?}");
    println!("{stats:?}\n{counts:?}");
    Ok(())
}

/// `superfluid-warm listen` on `path` for `publisher`'s engine.
fn spawn_listen(path: &Path, publisher: &Publisher) -> Reaped {
    Reaped(
        Command::new(env!("CARGO_BIN_EXE_superfluid-warm"))
            .arg("listen")
            .arg(path)
            .arg("--engine")
            .arg(format!("gpu-0={},replay={}", publisher.events, publisher.replay))
            .args(["--model", "m", "--status-every", "0.2", "--replay-timeout", "30"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn listen"),
    )
}

/// `superfluid-warm stats --json` of `path`.
fn stats_json(path: &Path) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_superfluid-warm")).arg("stats").arg(path).arg("--json").output();
    let out = out.expect("run stats");
    assert!(out.status.success(), "stats: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stats --json is JSON")
}

/// The last batch the file holds (read live, beside the listener).
fn last_seq(path: &Path) -> Option<u64> {
    Snapshot::open(path).ok()?.stats().ok()?.engines.first()?.last_seq
}

/// The ingester killed with SIGKILL mid-stream, batches published while it is down, then
/// restarted: it resumes from the position it committed, replays what it missed, and the index
/// answers exactly what the engine holds. SIGTERM then closes the file cleanly.
#[test]
fn a_killed_listener_resumes_from_its_position() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = dir.path().join("killed.redb");
    let publisher = Publisher::new(Duration::ZERO)?;
    let mut engine = Engine::new(16, 3000, "m", Some(2))?;
    let mut rng = Rng(11);
    let mut conversations = common::Conversations::new(8);
    let mut child = spawn_listen(&path, &publisher);
    let mut publish = |n: usize, engine: &mut Engine| {
        for _ in 0..n {
            let (_, prompt) = conversations.turn(&mut rng);
            publisher.publish(&engine.run(&prompt), false).expect("publish");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    publish(40, &mut engine);
    wait_until("a committed position", || last_seq(&path).is_some_and(|s| s >= 20));
    publish(20, &mut engine);
    child.0.kill().expect("SIGKILL");
    child.0.wait().expect("reaped");
    let before = last_seq(&path);
    publish(30, &mut engine);
    let mut child = spawn_listen(&path, &publisher);
    // Until it hears a live batch it does not know it missed any: one more every second (a
    // subscriber that has not joined yet loses it) until it has caught up with the last.
    let mut poked = Instant::now();
    wait_until("the last batch after the restart", || {
        let last = engine.published.back().map(|b| b.seq);
        if last_seq(&path) == last {
            return true;
        }
        if poked.elapsed() >= Duration::from_secs(1) {
            publish(1, &mut engine);
            poked = Instant::now();
        }
        false
    });
    let last = engine.published.back().map(|b| b.seq);
    // `stats` on the live file shows what the listener sees: connected, its replays and lag
    // (its status file is rewritten every 0.2 s: the first ones may predate the replay).
    wait_until("stats to show the engine connected, its replay and its lag", || {
        let live = stats_json(&path);
        let l = &live["engines"][0]["listener"];
        live["listener_running"] == true
            && l["connected"] == true
            && l["replays"].as_u64() >= Some(1)
            && l["lag_p50_ms"].as_f64().is_some()
    });
    let status = Command::new("kill").arg("-TERM").arg(child.0.id().to_string()).status().expect("kill -TERM");
    assert!(status.success());
    assert!(child.0.wait().expect("exit").success(), "SIGTERM is a clean stop");
    let snapshot = Snapshot::open(&path)?;
    assert_eq!(snapshot.writer(), None, "closed cleanly");
    drop(snapshot);
    let stopped = stats_json(&path);
    assert_eq!(stopped["listener_running"], false, "{stopped}");
    assert!(stopped["listener_down"].as_str().is_some_and(|w| w.starts_with("stopped")), "{stopped}");
    assert_eq!(stopped["engines"][0]["listener"]["connected"], false, "{stopped}");
    let warm = Warm::open(&path)?;
    let prompts: Vec<Vec<u32>> = conversations.prompts.clone();
    let pairs = compare(&warm, &engine, &prompts)?;
    assert!(pairs.iter().all(|(a, w)| a == w), "answered vs held: {pairs:?}");
    assert!(pairs.iter().filter(|(a, _)| *a > 0).count() >= 4, "warm answers to check: {pairs:?}");
    let counts = &warm.engine_stats()?[0].counts;
    assert_eq!(counts.lost, 0, "the restart replayed what it missed: {counts:?}");
    println!("position before the restart {before:?}, last {last:?}; {counts:?}");
    Ok(())
}
