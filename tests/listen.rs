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
use harness::engine_sim::{Publisher, SimEngine as Engine};
use superfluid_warm::{EngineEndpoint, Error, IndexFile, Listener, ReadIndex, Snapshot, Warm};

/// Waits until the index has applied the engine's last batch (`applied`: the last one it has),
/// running one more prompt (`poke`) every `every` meanwhile: a subscriber that has not joined
/// yet loses a batch without knowing, and only a later one shows it the gap.
fn until_caught_up(
    what: &str,
    engine: &mut Engine,
    every: Duration,
    applied: impl Fn() -> Option<u64>,
    mut poke: impl FnMut(&mut Engine),
) {
    let mut poked = Instant::now();
    wait_until(what, || {
        if applied() == engine.published.back().map(|b| b.seq) {
            return true;
        }
        if poked.elapsed() >= every {
            poke(engine);
            poked = Instant::now();
        }
        false
    });
}

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
    let applied = || warm.engine_stats().ok().and_then(|s| s.first().and_then(|e| e.last_seq));
    until_caught_up("the last batch", &mut engine, Duration::from_millis(200), applied, |engine| {
        let (_, prompt) = conversations.turn(&mut rng);
        publisher.publish(&engine.run(&prompt), false).expect("publish");
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

/// `superfluid-warm listen` on `path` for `publisher`'s engine, with `extra` arguments.
fn listen_command(path: &Path, publisher: &Publisher, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_superfluid-warm"));
    command
        .arg("listen")
        .arg(path)
        .arg("--engine")
        .arg(format!("gpu-0={},replay={}", publisher.events, publisher.replay))
        .args(["--model", "m", "--replay-timeout", "30"])
        .args(extra);
    command
}

/// `superfluid-warm listen` on `path` for `publisher`'s engine.
fn spawn_listen(path: &Path, publisher: &Publisher) -> Reaped {
    let mut command = listen_command(path, publisher, &["--status-every", "0.2"]);
    Reaped(command.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("spawn listen"))
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
    until_caught_up(
        "the last batch after the restart",
        &mut engine,
        Duration::from_secs(1),
        || last_seq(&path),
        |e| publish(1, e),
    );
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

/// `superfluid-warm listen` on `path` for `publisher`'s engine, its stderr piped, with `extra`
/// arguments.
fn spawn_listen_piped(path: &Path, publisher: &Publisher, extra: &[&str]) -> Reaped {
    let mut command = listen_command(path, publisher, extra);
    Reaped(command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn listen"))
}

/// Publishes batches of new prompts (one a `pace`) until `done`, at most a minute.
fn publish_until(publisher: &Publisher, engine: &mut Engine, pace: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    let mut c = 0u32;
    while !done() {
        assert!(started.elapsed() < Duration::from_secs(60), "timed out publishing");
        let prompt: Vec<u32> = (0..64 * 4).map(|t| (c + 1) * 100_000 + t).collect();
        publisher.publish(&engine.run(&prompt), false).expect("publish");
        c += 1;
        std::thread::sleep(pace);
    }
}

/// SIGTERM at many points of `listen`'s startup, on a file of some MB without its seal (the
/// open checks every page, a window of tens of ms): every time, either the file was not opened
/// yet or `listen` stops cleanly (exit 0) once it is; the file never needs recovery.
#[test]
fn sigterm_during_startup_never_leaves_the_file_to_recover() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = dir.path().join("startup.redb");
    let seal = dir.path().join("startup.redb.seal");
    let warm = Warm::open(&path)?;
    for c in 0..2_000u32 {
        let prompt: Vec<u32> = (0..64 * 24).map(|t| c * 100_000 + t).collect();
        warm.ran("m", &prompt, &format!("node-{}", c % 4))?;
    }
    warm.close()?;
    println!("file of {} bytes", std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0));
    let publisher = Publisher::new(Duration::ZERO)?;
    let (mut while_starting, mut before_opening, mut clean) = (0, 0, 0);
    for trial in 0..40u64 {
        // Without its seal, the open checks every page.
        std::fs::remove_file(&seal).ok();
        let mut child = spawn_listen_piped(&path, &publisher, &["--status-every", "0"]);
        std::thread::sleep(Duration::from_millis(3 * trial));
        let term = Command::new("kill").arg("-TERM").arg(child.0.id().to_string()).status().expect("kill -TERM");
        assert!(term.success());
        let (status, stderr) = child.ends_within(Duration::from_secs(60), "SIGTERM");
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(0), _) if stderr.contains("stopped while starting") => while_starting += 1,
            (Some(0), _) => clean += 1,
            // Before the handler is installed, which is before the file is opened.
            (None, Some(15)) => before_opening += 1,
            other => panic!("trial {trial}: SIGTERM at {} ms ended listen with {other:?}: {stderr}", 3 * trial),
        }
        match Snapshot::open(&path) {
            Ok(snapshot) => assert_eq!(snapshot.writer(), None, "trial {trial}: closed cleanly"),
            Err(e) => {
                panic!("trial {trial}: SIGTERM at {} ms left the file needing recovery: {e}; {stderr}", 3 * trial)
            }
        }
    }
    println!("{before_opening} before the open, {while_starting} while starting, {clean} once listening");
    assert!(while_starting + clean > 0, "some SIGTERMs came once the handler was installed");
    Ok(())
}

/// The index file deleted under `listen`: it says so and stops with exit code 1 (a supervisor
/// restarts it on a new file), rather than go on writing a file no reader can see and then say
/// it "closed cleanly".
#[test]
fn a_deleted_index_file_stops_listen_with_an_error() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = dir.path().join("deleted.redb");
    let publisher = Publisher::new(Duration::ZERO)?;
    let mut engine = Engine::new(16, 3000, "m", None)?;
    let mut child = spawn_listen_piped(&path, &publisher, &["--status-every", "0"]);
    publish_until(&publisher, &mut engine, Duration::from_millis(20), || last_seq(&path).is_some());
    std::fs::remove_file(&path).expect("the file is deleted");
    let (status, stderr) = child.ends_within(Duration::from_secs(30), "the file was deleted");
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("was deleted") && !stderr.contains("closed cleanly\n"), "{stderr}");
    // Its last status, as a Rust user reads it (the library's type, `stats`'s source).
    let recorded = IndexFile::new(&path).listen_status()?.expect("the status file");
    assert!(recorded.error.as_deref().is_some_and(|e| e.contains("was deleted")), "{recorded:?}");
    assert!(!recorded.running && recorded.down().is_some_and(|d| d.starts_with("stopped")), "{recorded:?}");
    assert_eq!(recorded.engines.len(), 1, "{recorded:?}");
    assert!(recorded.engines.iter().all(|e| !e.connected && e.received > 0), "{recorded:?}");
    Ok(())
}

/// Unmounts a test's filesystem when dropped.
struct Mounted(std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// The disk fills under `listen`: the commit's I/O error latches (redb takes no more writes
/// through the handle), so `listen` says so and stops at once with exit code 1, for a
/// supervisor to restart it once there is room; the error is in its status file, and `stats`
/// shows it. (A small tmpfs: needs root; skipped, saying so, where it cannot be mounted.)
#[test]
fn a_full_disk_stops_listen_at_once_and_says_why() -> Result<(), Error> {
    let dir = common::tempdir();
    let small = dir.path().join("small");
    std::fs::create_dir(&small).expect("a mount point");
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"]).arg(&small).output();
    if !mounted.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("SKIPPED: cannot mount a 4 MiB tmpfs here (needs root and mount(8)): {mounted:?}");
        return Ok(());
    }
    let _mounted = Mounted(small.clone());
    let path = small.join("full.redb");
    let publisher = Publisher::new(Duration::ZERO)?;
    let mut engine = Engine::new(16, 1 << 20, "m", None)?;
    let mut child = spawn_listen_piped(&path, &publisher, &["--status-every", "0.2"]);
    publish_until(&publisher, &mut engine, Duration::from_millis(20), || last_seq(&path).is_some_and(|s| s >= 5));
    // Fill what is left.
    let filler = small.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).expect("filler");
        let chunk = vec![7u8; 4096];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
    }
    publish_until(&publisher, &mut engine, Duration::from_millis(10), || child.0.try_wait().ok().flatten().is_some());
    let (status, stderr) = child.ends_within(Duration::from_secs(30), "the disk filled");
    assert_eq!(status.code(), Some(1), "exits non-zero at once: {stderr}");
    assert!(stderr.contains("failed for good") && stderr.contains("exit code 1"), "{stderr}");
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(small.join("full.redb.listen.json")).expect("the status file"))
            .expect("JSON");
    assert_eq!(recorded["running"], false, "{recorded}");
    assert!(recorded["error"].as_str().is_some_and(|e| e.contains("failed for good")), "{recorded}");
    // Room again: `stats` says why the listener stopped (the file, whose close could not
    // commit, is recovered by the next head).
    std::fs::remove_file(&filler).expect("room again");
    let out = Command::new(env!("CARGO_BIN_EXE_superfluid-warm")).arg("stats").arg(&path).arg("--json").output();
    let out = out.expect("stats");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("failed for good"), "stats shows why the listener stopped: {said}");
    let warm = Warm::open(&path)?;
    assert!(
        warm.engine_stats()?.first().and_then(|e| e.last_seq).is_some_and(|s| s >= 5),
        "what was committed is there"
    );
    warm.close()?;
    Ok(())
}

/// An engine on IPv6 (`tcp://[::1]:P`, events and replay): its batches are received, a lost
/// one is replayed, and the index answers what the engine holds.
#[test]
fn an_engine_on_ipv6_is_followed_and_replayed() -> Result<(), Error> {
    let dir = common::tempdir();
    let warm = Arc::new(Warm::open(dir.path().join("v6.redb"))?);
    let publisher = Publisher::ipv6(Duration::ZERO)?;
    assert!(publisher.events.starts_with("tcp://[::1]:"), "{}", publisher.events);
    let listener = Listener::start(Arc::clone(&warm), &[endpoint(&publisher)], Duration::from_secs(30))?;
    let mut engine = Engine::new(16, 3000, "m", Some(3))?;
    let mut rng = Rng(9);
    let mut conversations = common::Conversations::new(6);
    for i in 0..30 {
        let (_, prompt) = conversations.turn(&mut rng);
        publisher.publish(&engine.run(&prompt), i % 7 == 3)?;
        std::thread::sleep(Duration::from_millis(2));
    }
    let applied = || warm.engine_stats().ok().and_then(|s| s.first().and_then(|e| e.last_seq));
    until_caught_up("the last batch over IPv6", &mut engine, Duration::from_secs(1), applied, |engine| {
        let (_, prompt) = conversations.turn(&mut rng);
        publisher.publish(&engine.run(&prompt), false).expect("publish");
    });
    let stats = listener.stop();
    assert!(stats[0].replays >= 1 && stats[0].replays_short == 0, "{stats:?}");
    let pairs = compare(&warm, &engine, &conversations.prompts)?;
    assert!(pairs.iter().all(|(a, w)| a == w), "answered vs held: {pairs:?}");
    assert!(pairs.iter().any(|(a, _)| *a > 0), "warm answers to check: {pairs:?}");
    Ok(())
}

/// Two engines given one node name are refused at startup, naming both: by
/// `Listener::start`, and by `listen` (non-zero, before it touches the file).
#[test]
fn two_engines_of_one_node_are_refused_at_startup() -> Result<(), Error> {
    let dir = common::tempdir();
    let warm = Arc::new(Warm::open(dir.path().join("twice.redb"))?);
    let (a, b) = (Publisher::new(Duration::ZERO)?, Publisher::new(Duration::ZERO)?);
    let engines = [endpoint(&a), endpoint(&b)];
    match Listener::start(Arc::clone(&warm), &engines, Duration::from_secs(1)) {
        Err(Error::InvalidConfig { detail }) => {
            assert!(detail.contains(&a.events) && detail.contains(&b.events), "{detail}");
        }
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("two engines of node gpu-0 were accepted"),
    }
    let path = dir.path().join("cli.redb");
    let specs = [format!("gpu-0={}", a.events), format!("gpu-0={}", b.events)];
    let out = Command::new(env!("CARGO_BIN_EXE_superfluid-warm"))
        .arg("listen")
        .arg(&path)
        .args(["--engine", &specs[0], "--engine", &specs[1], "--model", "m", "--duration", "5"])
        .output()
        .expect("run listen");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "refused: {stderr}");
    assert!(stderr.contains(&specs[0]) && stderr.contains(&specs[1]), "{stderr}");
    assert!(!path.exists(), "refused before the file was made");
    Ok(())
}

/// `listen` refuses a spec that can never work (here a port out of range) at startup, saying
/// what is wrong, rather than following another port.
#[test]
fn listen_refuses_a_spec_that_can_never_work() {
    let dir = common::tempdir();
    let path = dir.path().join("bad.redb");
    let out = Command::new(env!("CARGO_BIN_EXE_superfluid-warm"))
        .arg("listen")
        .arg(&path)
        .args(["--engine", "gpu-0=tcp://127.0.0.1:99999", "--model", "m", "--duration", "5"])
        .output()
        .expect("run listen");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "refused: {stderr}");
    assert!(stderr.contains("port 99999 is not a port"), "{stderr}");
}

/// A replay endpoint where nothing listens: the first gap waits for the replay timeout, then
/// the endpoint is left alone for a while (shown in the stats) and the gaps meanwhile clear the
/// node at once, so the engine's later batches are applied as they come, not one replay
/// timeout per gap later.
#[test]
fn a_mute_replay_endpoint_is_backed_off_and_ingest_goes_on() -> Result<(), Error> {
    let dir = common::tempdir();
    let warm = Arc::new(Warm::open(dir.path().join("mute.redb"))?);
    let publisher = Publisher::new(Duration::ZERO)?;
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
    let spec = format!("gpu-0={},replay=tcp://127.0.0.1:{nobody}", publisher.events);
    let engines = [EngineEndpoint::parse(&spec, Some("m"))?];
    let listener = Listener::start(Arc::clone(&warm), &engines, Duration::from_secs(2))?;
    let mut engine = Engine::new(16, 1 << 20, "m", None)?;
    let prompt = |i: u32| -> Vec<u32> { (0..64 * 3).map(|t| t + i * 1000).collect() };
    let mut n = 0;
    wait_until("the first batch", || {
        n += 1;
        publisher.publish(&engine.run(&prompt(n)), false).expect("publish");
        std::thread::sleep(Duration::from_millis(50));
        warm.warmest("m", &prompt(n)).is_ok_and(|h| h.is_some())
    });
    // 8 gaps, one every 5 batches, over about a second.
    let start = Instant::now();
    for i in 0..40 {
        n += 1;
        publisher.publish(&engine.run(&prompt(n)), i % 5 == 0)?;
        std::thread::sleep(Duration::from_millis(25));
    }
    let last = engine.published.back().map(|b| b.seq);
    wait_until("the last batch", || warm.engine_stats().is_ok_and(|s| s.first().and_then(|e| e.last_seq) == last));
    let took = start.elapsed();
    let stats = listener.stats();
    let stats = stats.first().expect("the engine's stats");
    assert_eq!(stats.replays, 1, "asked once, then left alone: {stats:?}");
    assert!(stats.replays_skipped >= 6, "{stats:?}");
    assert!(stats.replay_backoff.is_some_and(|b| b > 0.0), "shown as backed off: {stats:?}");
    // One replay timeout (2 s) in all, not one per gap (16 s).
    assert!(took < Duration::from_secs(8), "the last batch came {took:?} after the first gap");
    assert_eq!(warm.warmest("m", &prompt(n))?, Some(superfluid_warm::Hit::new("gpu-0", 192)));
    drop(listener);
    Ok(())
}
