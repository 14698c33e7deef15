//! Crashes: kill -9 of a writing process at random moments, and power loss at every write and
//! sync of a workload. Nothing acknowledged durable is lost; the file is always consistent.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use superfluid_warm::ReadIndex;

use common::backend::{Disk, Op, crash_images};
use common::{Conversations, Rng, db_path, tempdir, torture, torture_writer};
use harness::baseline::Baseline;
use superfluid_warm::{Error, Hit, IndexFile, OpenCheck, Snapshot, Warm};

/// Opens (so recovers) the file as a head would, then checks every invariant read-only. Returns
/// the clock and how the open verified the file.
fn recover_and_check(path: &Path) -> Result<(u64, OpenCheck), Error> {
    let (clock, opened) = {
        let warm = Warm::open(path)?;
        let stats = warm.stats()?;
        warm.close()?;
        (stats.clock, stats.open_check)
    };
    let snapshot = Snapshot::open(path)?;
    let check = snapshot.check()?;
    assert!(check.problems.is_empty(), "invariants after recovery: {:?}", check.problems);
    assert!(IndexFile::new(path).integrity_check_copy()?, "redb integrity after recovery");
    Ok((clock, opened))
}

/// Opens the file as a head and asserts that each of `prompts` answers as `model` does; returns
/// how many were compared.
fn answers_as_the_model<'a>(
    path: &Path,
    model: &Baseline,
    prompts: impl Iterator<Item = &'a Vec<u32>>,
    round: usize,
) -> Result<usize, Error> {
    let warm = Warm::open(path)?;
    let mut compared = 0;
    for tokens in prompts {
        let want = model.warmest("torture", tokens).map(|(node, tokens)| Hit::new(node, tokens));
        assert_eq!(warm.warmest("torture", tokens)?, want, "round {round}");
        compared += 1;
    }
    warm.close()?;
    Ok(compared)
}

#[test]
fn kill_9_at_random_moments_never_loses_a_durable_ran() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let mut rng = Rng(0xdead);
    let kills = 200;
    let (mut acked_total, mut last_clock, mut compared, mut sealed) = (0, 0, 0, 0);
    // The model of 0.1.7's semantics, fed exactly the rans that survived each round.
    let mut model = Baseline::in_memory(1 << 22);
    let started = Instant::now();
    for round in 0..kills {
        let seed = round as u64 + 1;
        // As the last round's head closed it (and sealed it).
        let closed = std::fs::read(&path).ok();
        let mut child = Command::new(torture_writer())
            .args(["--db", path.to_str().expect("utf-8"), "--capacity", "1048576"])
            .args(["--seed", &seed.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("writer starts");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout"));
        // Let it run a random number of durable points (0 to 12), plus a random slice of time.
        let wanted = rng.below(13);
        let mut last_acked: Option<(u64, u64)> = None;
        let mut line = String::new();
        for _ in 0..wanted {
            line.clear();
            if lines.read_line(&mut line).expect("read") == 0 {
                break;
            }
            let mut parts = line.split_whitespace().skip(1).map(|p| p.parse::<u64>().expect("number"));
            last_acked = parts.next().zip(parts.next());
        }
        std::thread::sleep(Duration::from_micros(rng.below(8000)));
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        let unchanged = closed.is_some() && std::fs::read(&path).ok() == closed;
        let (clock, check) = recover_and_check(&path)?;
        // The seal is trusted exactly when the writer was killed before it touched the file.
        assert_eq!(check == OpenCheck::Seal, unchanged, "round {round}: opened by {check:?}");
        sealed += usize::from(unchanged);
        assert!(clock >= last_clock, "round {round}: the clock went back from {last_clock} to {clock}");
        let survived = (clock - last_clock) as usize;
        let mut prompts = torture::prompts(seed);
        prompts.truncate(survived.max(1));
        for (i, tokens) in prompts.iter().enumerate().take(survived) {
            model.ran("torture", tokens, &harness::replay::node_name(i % 5));
        }
        if let Some((i, acked_clock)) = last_acked {
            acked_total += 1;
            assert!(clock >= acked_clock, "round {round}: acknowledged clock {acked_clock} lost (now {clock})");
            assert!(i < survived as u64, "round {round}: durable ran {i} is there");
        }
        // Every prompt of this round answers as the model replayed up to what survived.
        compared += answers_as_the_model(&path, &model, prompts.iter().rev().take(8), round)?;
        last_clock = clock;
    }
    println!(
        "kill -9: {kills} kills, {acked_total} with an acknowledged durable ran checked, {compared} answers compared, {sealed} files the writer never touched opened by their seal, final clock {last_clock}, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(acked_total > kills / 2);
    Ok(())
}

/// Kill -9 while a head closes a churned file, at random moments of the close (which compacts
/// such a file before it seals it): the file always recovers, with every `ran` (all durable
/// before the close began) answered as the model answers.
#[test]
fn kill_9_during_the_compacting_close_loses_nothing() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let mut rng = Rng(0xc105e);
    let (rounds, capacity, rans) = (16, 2048u64, 1500usize);
    let (mut killed_closing, mut closed, mut compared) = (0, 0, 0);
    for round in 0..rounds {
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(superfluid_warm::IndexFile::new(&path).seal_path());
        let seed = 100 + round as u64;
        let mut child = Command::new(torture_writer())
            .args(["--db", path.to_str().expect("utf-8"), "--capacity", &capacity.to_string()])
            .args(["--seed", &seed.to_string(), "--rans", &rans.to_string(), "--distinct"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("writer starts");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let closing_clock = loop {
            line.clear();
            assert!(lines.read_line(&mut line).expect("read") > 0, "round {round}: the writer ended early");
            if let Some(rest) = line.strip_prefix("closing ") {
                break rest.split_whitespace().nth(1).and_then(|c| c.parse::<u64>().ok()).expect("clock");
            }
        };
        let file_at_close = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        std::thread::sleep(Duration::from_micros(rng.below(20_000)));
        let finished = child.try_wait().expect("wait").is_some();
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        if finished {
            closed += 1;
        } else {
            killed_closing += 1;
        }
        let (clock, _) = recover_and_check(&path)?;
        assert_eq!(clock, closing_clock, "round {round}: every ran was durable before the close");
        let mut model = Baseline::in_memory(capacity as usize);
        let prompts: Vec<Vec<u32>> =
            torture::prompts(seed).iter().take(rans).enumerate().map(|(i, p)| torture::distinct(p, i)).collect();
        for (i, tokens) in prompts.iter().enumerate() {
            model.ran("torture", tokens, &harness::replay::node_name(i % 5));
        }
        compared += answers_as_the_model(&path, &model, prompts.iter().rev().take(40), round)?;
        if round == 0 {
            let now = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            println!("the file was {file_at_close} bytes as the close began, {now} after recovery and a close");
        }
    }
    println!(
        "kill -9 during the close: {rounds} rounds, {killed_closing} killed while closing, {closed} after the close returned, {compared} answers compared"
    );
    assert!(killed_closing >= rounds / 4, "{killed_closing} of {rounds} rounds killed mid-close");
    Ok(())
}

#[test]
fn power_loss_at_every_write_and_sync_leaves_a_prefix_of_the_history() -> Result<(), Error> {
    power_loss_leaves_a_prefix_of_the_history(None)
}

/// The same where most `ran`s evict: the callers' floor, carried by each `ran`, is applied in
/// the same transaction as the `ran`.
#[test]
fn power_loss_while_evicting_leaves_a_prefix_of_the_history() -> Result<(), Error> {
    power_loss_leaves_a_prefix_of_the_history(Some(48))
}

fn power_loss_leaves_a_prefix_of_the_history(capacity: Option<u64>) -> Result<(), Error> {
    let disk = Disk::default();
    let mut builder = Warm::builder();
    builder.sync_window(Duration::ZERO);
    if let Some(c) = capacity {
        builder.capacity(c);
    }
    let warm = builder.open_with_backend(disk.backend())?;
    let start = {
        let mut state = disk.state();
        state.record = true;
        state.durable.clone()
    };
    let mut rng = Rng(42);
    let mut conversations = Conversations::new(8);
    let nodes = ["a", "b", "c"];
    let mut history = Vec::new(); // (model, prompt, node) in clock order
    let mut acked = Vec::new(); // (ops recorded when the ran returned, its clock)
    let base_clock = warm.stats()?.clock;
    for i in 0..40 {
        let (m, prompt) = conversations.turn(&mut rng);
        warm.ran(m, &prompt, nodes[i % 3])?;
        history.push((m, prompt, nodes[i % 3]));
        acked.push((disk.state().ops.len(), warm.stats()?.clock));
    }
    if let Some(c) = capacity {
        let mut unbounded = Baseline::in_memory(1 << 20);
        for (m, prompt, node) in &history {
            unbounded.ran(m, prompt, node);
        }
        let entries = warm.stats()?.entries;
        assert!(
            entries <= c && (unbounded.len() as u64) > 2 * c,
            "{entries} of {} blocks kept: it evicted",
            unbounded.len()
        );
    }
    drop(warm);
    let ops = disk.state().ops.clone();
    assert_eq!(base_clock, 0);
    let dir = tempdir();
    let (mut images, mut crash_points) = (0, 0);
    for k in 0..=ops.len() {
        crash_points += 1;
        let durable_clock = acked.iter().filter(|(n, _)| *n <= k).map(|&(_, c)| c).max().unwrap_or(0);
        for (which, image) in crash_images(&start, &ops, k).into_iter().enumerate() {
            if which > 0 && k % 2 == 1 {
                continue; // the unsynced variants at every other point keep the run short
            }
            images += 1;
            let path = dir.path().join(format!("crash-{k}-{which}.redb"));
            std::fs::write(&path, &image).expect("write image");
            let (clock, check) = recover_and_check(&path)?;
            assert_eq!(check, OpenCheck::Pages, "a crash image has no seal");
            assert!(clock >= durable_clock, "crash at op {k} ({which}): acknowledged clock {durable_clock} lost");
            assert!(clock as usize <= history.len());
            // Every ran up to the surviving clock is there, and none after it (atomic rans).
            let mut model = Baseline::in_memory(capacity.unwrap_or(1 << 20) as usize);
            for (m, prompt, node) in &history[..clock as usize] {
                model.ran(m, prompt, node);
            }
            let warm = Warm::open(&path)?;
            for (m, prompt, _) in &history {
                let want = model.warmest(m, prompt).map(|(node, tokens)| Hit::new(node, tokens));
                assert_eq!(warm.warmest(m, prompt)?, want, "crash at op {k} ({which}), clock {clock}");
            }
            drop(warm);
            std::fs::remove_file(&path).expect("remove");
        }
    }
    println!(
        "power loss (capacity {capacity:?}): {} operations recorded, {crash_points} crash points, {images} crash images reopened",
        ops.len()
    );
    assert!(crash_points > 80);
    Ok(())
}

/// Power loss inside an engine batch of 140,000 blocks, which is committed in parts, at every
/// sync: the file answers as of whole batches (the one before, or the huge one), or, if it was
/// left between two parts, knows the node to hold nothing, never a part of the batch without
/// the removals of its rest.
#[test]
fn power_loss_inside_a_huge_engine_batch_leaves_whole_batches_or_nothing() -> Result<(), Error> {
    use superfluid_warm::{EngineBatch, EngineEvent, EngineStored, Medium, Namespace};
    let disk = Disk::default();
    let mut builder = Warm::builder();
    builder.sync_window(Duration::ZERO);
    let warm = builder.open_with_backend(disk.backend())?;
    let ns = Namespace::of("m", None)?;
    let blocks = 100u64;
    let tokens = |p: u64| -> Vec<u32> { (0..16 * blocks).map(|t| (p * 16 * blocks + t) as u32).collect() };
    let stored = |p: u64| {
        EngineEvent::Stored(EngineStored {
            parent: None,
            hashes: (0..blocks).map(|b| p * 1_000 + b + 1).collect(),
            tokens: tokens(p),
            block_size: 16,
            medium: Medium::Gpu,
            namespace: Some(ns.clone()),
            group: None,
        })
    };
    // Prompt 0 first, whole; the huge batch stores 1,400 more and then cuts prompt 0 in half.
    warm.engine_batch("gpu-0", &EngineBatch { seq: 0, ts: 1.0, events: vec![stored(0)] })?;
    warm.sync()?;
    let start = {
        let mut state = disk.state();
        state.record = true;
        state.durable.clone()
    };
    let mut events: Vec<EngineEvent> = (1..=1_400).map(stored).collect();
    events.push(EngineEvent::Removed { hashes: vec![51], medium: Medium::Gpu, group: None });
    warm.engine_batch("gpu-0", &EngineBatch { seq: 1, ts: 2.0, events })?;
    warm.close()?;
    let ops = disk.state().ops.clone();
    let syncs: Vec<usize> = ops.iter().enumerate().filter(|(_, op)| matches!(op, Op::Sync)).map(|(k, _)| k).collect();
    // What a prompt is answered: gpu-0's tokens.
    let answer = |warm: &Warm, p: u64| -> Result<usize, Error> {
        Ok(warm.warm_nodes("m", &tokens(p))?.first().map_or(0, |h| h.tokens))
    };
    let full = 16 * blocks as usize;
    let dir = tempdir();
    let (mut images, mut between) = (0, 0);
    for &k in &syncs {
        for (which, image) in crash_images(&start, &ops, k + 1).into_iter().enumerate().take(2) {
            images += 1;
            let path = dir.path().join(format!("crash-{k}-{which}.redb"));
            std::fs::write(&path, &image).expect("write image");
            let warm = Warm::open(&path)?;
            let last = warm.engine_stats()?.first().and_then(|s| s.last_seq);
            let got: Vec<usize> = [0, 1, 700, 1_400].into_iter().map(|p| answer(&warm, p)).collect::<Result<_, _>>()?;
            let want = match last {
                Some(0) => vec![full, 0, 0, 0],
                Some(1) => vec![768, full, full, full],
                None => {
                    between += 1;
                    vec![0, 0, 0, 0]
                }
                other => panic!("crash at op {k}: last batch {other:?}"),
            };
            assert_eq!(got, want, "crash at op {k} ({which}), last batch {last:?}");
            warm.close()?;
            std::fs::remove_file(&path).expect("remove");
        }
    }
    println!("power loss in a huge engine batch: {} syncs, {images} images, {between} between parts", syncs.len());
    assert!(between > 0, "some image was left between two parts");
    Ok(())
}
