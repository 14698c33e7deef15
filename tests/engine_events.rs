//! Engine KV cache events (vLLM's, SGLang's) as the index's source of truth for nodes that
//! publish them: a model of engine caches (random stores through an LRU, evictions, duplicate
//! stores, restarts, lost and replayed batches, block sizes 16, 32 and 64) against the index's
//! answers, across reopens; claims of `ran`s and their grace window.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Rng;
use harness::engine_sim::{Publisher, SimEngine as Engine, engine_hash};
use superfluid_warm::{
    EngineBatch, EngineEndpoint, EngineEvent, EngineOutcome, EngineStored, Error, Hit, Listener, Medium, Namespace,
    ReadIndex, Warm,
};

/// Applies a batch as a listener does: on a gap, replays from where the index asks (or, if the
/// replay is lost, resyncs from the batch). Returns whether anything was lost.
fn deliver(warm: &Warm, node: &str, engine: &Engine, batch: &EngineBatch, replay: bool) -> Result<bool, Error> {
    match warm.engine_batch(node, batch)? {
        EngineOutcome::Applied | EngineOutcome::Duplicate => Ok(false),
        EngineOutcome::Gap { from } if replay => {
            let from = usize::try_from(from).expect("a small seq");
            for b in engine.published.iter().skip(from) {
                let outcome = warm.engine_batch(node, b)?;
                assert_ne!(outcome, EngineOutcome::Gap { from: from as u64 }, "a replay covers its gap");
            }
            Ok(false)
        }
        EngineOutcome::Gap { .. } => {
            warm.engine_resync(node, batch)?;
            Ok(true)
        }
        _ => unreachable!("no other outcome"),
    }
}

/// Tokens each node is answered warm for, by `warm_nodes`: (in any tier, in GPU memory).
fn answers(warm: &Warm, tokens: &[u32]) -> Result<HashMap<String, (usize, usize)>, Error> {
    let hits: Vec<Hit> = warm.warm_nodes("m", tokens)?;
    Ok(hits.into_iter().map(|h| (h.node, (h.tokens, h.gpu_tokens))).collect())
}

/// Random conversations on 3 engines of each block size (16, 32, 64; 1, as SGLang pages a token
/// at a time; 48, which does not divide 64 and so keys nothing), some with an offload tier in CPU
/// memory: after every batch delivered, every answer is at most what the engine can serve, and
/// exactly that (in whole blocks of 64, from 2) while no batch was lost, and so is the part in
/// GPU memory; the same after a reopen.
#[test]
fn answers_are_what_the_engines_hold_through_duplicates_restarts_and_gaps() -> Result<(), Error> {
    for (seed, size, offload) in
        [(1u64, 16usize, 0), (2, 32, 0), (3, 64, 0), (4, 16, 0), (5, 48, 0), (6, 1, 0), (7, 16, 300), (8, 32, 120)]
    {
        let dir = common::tempdir();
        let path = dir.path().join("engines.redb");
        let mut warm = Warm::open(&path)?;
        let mut rng = Rng(seed);
        let mut engines: Vec<Engine> = (0..3)
            .map(|i| Engine::new(size, 4096 / size * 3, "m", Some(seed * 10 + i)).map(|e| e.with_offload(offload)))
            .collect::<Result<_, _>>()?;
        let mut offloaded = 0;
        let mut lost = [false; 3];
        // A batch not delivered yet: until the next, the index is behind that engine.
        let mut behind = [false; 3];
        let mut conversations = common::Conversations::new(12);
        let (mut checked, mut warm_answers) = (0, 0);
        for step in 0..300 {
            let (_, prompt) = conversations.turn(&mut rng);
            let e = rng.below(3) as usize;
            let node = format!("engine-{e}");
            match rng.below(40) {
                0 => {
                    engines[e].restart();
                    lost[e] = false;
                }
                1 | 2 => {
                    // A batch the listener never sees; the next one shows the gap.
                    engines[e].run(&prompt);
                    behind[e] = true;
                    continue;
                }
                _ => {}
            }
            let batch = engines[e].run(&prompt);
            let replay = rng.below(3) > 0;
            lost[e] |= deliver(&warm, &node, &engines[e], &batch, replay)?;
            behind[e] = false;
            if step % 50 == 49 {
                warm.close()?;
                warm = Warm::open(&path)?;
            }
            for c in &conversations.prompts {
                let got = answers(&warm, c)?;
                for (i, engine) in engines.iter().enumerate().filter(|&(i, _)| !behind[i]) {
                    let name = format!("engine-{i}");
                    let (on_gpu, serves) = engine.holds_by_tier(c);
                    let serves = serves / 64 * 64;
                    // Blocks whose ends are not ends of ours key nothing.
                    let want = if serves >= 128 && 64 % size == 0 { serves } else { 0 };
                    let want_gpu = (on_gpu / 64 * 64).min(want);
                    let (answered, gpu) = got.get(&name).copied().unwrap_or((0, 0));
                    assert!(answered <= want, "seed {seed} step {step}: {name} answered {answered}, holds {want}");
                    if !lost[i] {
                        assert_eq!(answered, want, "seed {seed} step {step}: {name} lost nothing");
                        assert_eq!(gpu, want_gpu, "seed {seed} step {step}: {name}'s part in GPU memory");
                    }
                    offloaded += usize::from(want > want_gpu);
                    checked += 1;
                    warm_answers += usize::from(answered > 0);
                }
            }
        }
        let stats = warm.engine_stats()?;
        assert_eq!(stats.len(), 3);
        let restarts: u64 = stats.iter().map(|s| s.counts.restarts).sum();
        let gaps: u64 = stats.iter().map(|s| s.counts.gaps).sum();
        let dups: u64 = stats.iter().map(|s| s.counts.duplicate_blocks).sum();
        if 64 % size == 0 {
            assert!(warm_answers > checked / 20, "the model has warm answers to check ({warm_answers} of {checked})");
        } else {
            assert!(stats.iter().all(|s| s.counts.unaligned > 0 && s.blocks == 0), "counted, and nothing keyed");
        }
        assert!(restarts > 0 && gaps > 0 && dups > 0, "restarts {restarts}, gaps {gaps}, duplicates {dups}");
        if offload > 0 {
            assert!(offloaded > checked / 50, "answers warm partly in CPU memory to check ({offloaded} of {checked})");
        }
        println!(
            "block size {size}, offload {offload}: {checked} answers checked, {warm_answers} warm ({offloaded} partly offloaded); {restarts} restarts, {gaps} gaps"
        );
        warm.close()?;
    }
    Ok(())
}

/// A `ran` on a node with an event stream is answered until its grace window passes or its
/// engine removes something; its engine's events are answered all along.
#[test]
fn a_ran_is_a_claim_until_the_grace_window_or_a_removal() -> Result<(), Error> {
    let dir = common::tempdir();
    let prompt: Vec<u32> = (0..64 * 4).collect();
    let other: Vec<u32> = (1000..1000 + 64 * 4).collect();
    let mut engine = Engine::new(16, 1 << 20, "m", Some(1))?;
    // A long grace: the claim stands until the engine removes a block.
    let warm = Warm::builder().engine_grace(Duration::from_secs(3600)).open(dir.path().join("a.redb"))?;
    warm.engine_batch("gpu-0", &engine.run(&other))?;
    warm.ran("m", &prompt, "gpu-0")?;
    assert_eq!(warm.warmest("m", &prompt)?, Some(Hit::new("gpu-0", 256)), "a claim");
    let removal = engine.publish(vec![EngineEvent::Removed {
        hashes: vec![engine_hash(None, &other[..16])],
        medium: Medium::Gpu,
        group: None,
    }]);
    warm.engine_batch("gpu-0", &removal)?;
    assert_eq!(warm.warmest("m", &prompt)?, None, "a removal ends the claims before it");
    // A node without a stream is answered as before.
    warm.ran("m", &prompt, "plain")?;
    assert_eq!(warm.warmest("m", &prompt)?, Some(Hit::new("plain", 256)));
    drop(warm);
    // A short grace: the claim ends by itself; what the engine stored stays.
    let grace = Duration::from_millis(50);
    let warm = Warm::builder().engine_grace(grace).open(dir.path().join("b.redb"))?;
    let mut engine = Engine::new(16, 1 << 20, "m", Some(1))?;
    warm.engine_batch("gpu-0", &engine.run(&other))?;
    warm.ran("m", &prompt, "gpu-0")?;
    std::thread::sleep(grace * 3);
    assert_eq!(warm.warmest("m", &prompt)?, None, "the grace window passed");
    assert_eq!(warm.warmest("m", &other)?, Some(Hit::new("gpu-0", 256)), "the engine's own");
    // Stores in CPU memory (an offloading connector's, with tokens) are warm in that tier;
    // stores of a medium this build does not know, or under no namespace of the index, are not
    // answered.
    let stores = |batch: &mut EngineBatch, change: &dyn Fn(&mut EngineStored)| {
        let mut n = 0;
        for event in &mut batch.events {
            if let EngineEvent::Stored(s) = event {
                change(s);
                n += 1;
            }
        }
        n
    };
    let mut offload = engine.run(&prompt);
    stores(&mut offload, &|s| s.medium = Medium::Cpu);
    warm.engine_batch("gpu-0", &offload)?;
    let hit = warm.warmest("m", &prompt)?.expect("warm on CPU");
    assert_eq!((hit.tokens, hit.tier, hit.gpu_tokens), (256, Medium::Cpu, 0), "warm in CPU memory only");
    let fourth: Vec<u32> = (7000..7000 + 64 * 4).collect();
    let mut foreign = engine.run(&fourth);
    let other = stores(&mut foreign, &|s| s.medium = Medium::Other);
    warm.engine_batch("gpu-0", &foreign)?;
    assert_eq!(warm.warmest("m", &fourth)?, None, "an unknown medium is not answered");
    let third: Vec<u32> = (5000..5000 + 64 * 4).collect();
    let mut unkeyed = engine.run(&third);
    let none = stores(&mut unkeyed, &|s| s.namespace = None);
    warm.engine_batch("gpu-0", &unkeyed)?;
    assert_eq!(warm.warmest("m", &third)?, None, "an unkeyed store keys nothing");
    let counts = &warm.engine_stats()?[0].counts;
    assert_eq!((counts.other_medium, counts.unkeyed), (other, none));
    Ok(())
}

/// Malformed events are counted and change nothing; a forgotten node's stream goes with it.
#[test]
fn malformed_events_are_counted_and_a_forget_drops_the_stream() -> Result<(), Error> {
    let dir = common::tempdir();
    let warm = Warm::open(dir.path().join("m.redb"))?;
    let mut engine = Engine::new(16, 1 << 20, "m", Some(1))?;
    let prompt: Vec<u32> = (0..64 * 3).collect();
    warm.engine_batch("gpu-0", &engine.run(&prompt))?;
    let bad = EngineStored {
        parent: None,
        hashes: vec![1, 2],
        tokens: vec![0; 17],
        block_size: 16,
        medium: Medium::Gpu,
        namespace: Some(Namespace::new("m")?),
        group: None,
    };
    let zero = EngineStored { block_size: 0, tokens: vec![], ..bad.clone() };
    warm.engine_batch("gpu-0", &engine.publish(vec![EngineEvent::Stored(bad), EngineEvent::Stored(zero)]))?;
    assert_eq!(warm.engine_stats()?[0].counts.malformed, 2);
    assert_eq!(warm.warmest("m", &prompt)?, Some(Hit::new("gpu-0", 192)));
    warm.forget_node("gpu-0")?;
    assert_eq!(warm.warmest("m", &prompt)?, None);
    assert!(warm.engine_stats()?.is_empty(), "the stream went with the node");
    // Its next batch starts a new stream, which asks for the engine's history.
    let next = engine.run(&prompt);
    assert_eq!(warm.engine_batch("gpu-0", &next)?, EngineOutcome::Gap { from: 0 });
    warm.close()?;
    Ok(())
}

/// An engine restarts with its clock 60 s behind the old process's (an NTP step, a move to
/// another host): its numbers going back are a restart, whatever the clock says. The node is
/// cleared, the new process's batches are applied, none is taken for a copy, and the old
/// prompts are no longer answered warm on it; a true copy is still a duplicate, across a reopen.
#[test]
fn a_restart_with_its_clock_behind_is_seen() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = dir.path().join("m.redb");
    let mut warm = Warm::open(&path)?;
    let mut engine = Engine::new(16, 1 << 20, "m", None)?;
    let prompt = |i: u32| -> Vec<u32> { (0..64 * 3).map(|t| t + i * 1000).collect() };
    let old: Vec<Vec<u32>> = (0..10).map(prompt).collect();
    for p in &old {
        assert_eq!(warm.engine_batch("gpu-0", &engine.run(p))?, EngineOutcome::Applied);
    }
    engine.restart_with_clock(-60.0);
    let new: Vec<Vec<u32>> = (10..20).map(prompt).collect();
    let mut last = None;
    for p in &new {
        let batch = engine.run(p);
        assert_eq!(warm.engine_batch("gpu-0", &batch)?, EngineOutcome::Applied, "seq {}", batch.seq);
        last = Some(batch);
    }
    let counts = warm.engine_stats()?[0].counts.clone();
    assert_eq!((counts.restarts, counts.duplicate_batches), (1, 0));
    for p in &old {
        assert_eq!(warm.warmest("m", p)?, None, "the old process's prompts are not warm");
    }
    for p in &new {
        assert_eq!(warm.warmest("m", p)?, Some(Hit::new("gpu-0", 192)), "the new process's are");
    }
    // A copy of the last batch is a duplicate, after a reopen too.
    let last = last.expect("a batch");
    assert_eq!(warm.engine_batch("gpu-0", &last)?, EngineOutcome::Duplicate);
    warm.close()?;
    warm = Warm::open(&path)?;
    assert_eq!(warm.engine_batch("gpu-0", &last)?, EngineOutcome::Duplicate);
    assert_eq!(warm.engine_stats()?[0].counts.restarts, 1);
    warm.close()?;
    Ok(())
}

/// A live frame over the size cap (a smaller cap here than 256 MiB): ZMQ drops the
/// connection and would never make it again. The listener connects again, counts it, says
/// it is connected only while it is, and the node starts again at the next batch (cleared:
/// the frame is lost); what follows is applied.
#[test]
fn a_frame_over_the_cap_is_counted_and_the_engine_followed_again() -> Result<(), Error> {
    let dir = tempfile::tempdir().map_err(|e| Error::InvalidConfig { detail: e.to_string() })?;
    let warm = Arc::new(Warm::open(dir.path().join("cap.redb"))?);
    let publisher = Publisher::new(Duration::ZERO)?;
    let spec = format!("gpu-0={},replay={}", publisher.events, publisher.replay);
    let engines = [EngineEndpoint::parse(&spec, Some("m"))?];
    let listener = Listener::start_with(Arc::clone(&warm), &engines, Duration::from_secs(30), 16 << 10)?;
    let mut engine = Engine::new(16, 1 << 20, "m", None)?;
    let prompt = |i: u32, blocks: u32| -> Vec<u32> { (0..64 * blocks).map(|t| 100_000 + t + i * 100_000).collect() };
    let applied = |n: u32| warm.warmest("m", &prompt(n, 3)).is_ok_and(|h| h.is_some());
    let dropped = |listener: &Listener| listener.stats().first().map_or(0, |s| s.dropped);
    // One small batch every 50 ms until `done` (a subscriber not joined yet loses them).
    let mut n = 0;
    let mut pace = |engine: &mut Engine, done: &dyn Fn(u32) -> bool| -> Result<u32, Error> {
        let start = Instant::now();
        loop {
            assert!(start.elapsed() < Duration::from_secs(60), "timed out");
            n += 1;
            publisher.publish(&engine.run(&prompt(n, 3)), false)?;
            std::thread::sleep(Duration::from_millis(50));
            if done(n) {
                return Ok(n);
            }
        }
    };
    let first = pace(&mut engine, &applied)?;
    let big = engine.run(&prompt(1000, 100));
    publisher.publish(&big, false)?;
    std::thread::sleep(Duration::from_millis(100));
    pace(&mut engine, &|n| dropped(&listener) == 1 && applied(n))?;
    let stats = listener.stop();
    let stats = stats.first().expect("the engine's stats");
    let counts = warm.engine_stats()?.first().map(|s| s.counts.clone()).expect("a stream");
    assert_eq!((stats.dropped, counts.lost), (1, 1), "{stats:?} {counts:?}");
    assert!(stats.connected, "{stats:?}");
    assert_eq!(warm.warmest("m", &prompt(1000, 100))?, None, "the frame over the cap was never applied");
    assert!(!applied(first), "cleared: the index knows less than the engine");
    Ok(())
}

/// A batch of 140,000 blocks (1,400 prompts, then removals of a block in 100 of them) is applied
/// in parts by `engine_batch`: answered and written as the same events applied as 1,400 small
/// batches, before and after a reopen, and the stream goes on from it.
#[test]
fn a_huge_batch_is_applied_in_parts_as_small_batches_are() -> Result<(), Error> {
    let dir = tempfile::tempdir().map_err(|e| Error::InvalidConfig { detail: e.to_string() })?;
    let ns = Namespace::of("m", None)?;
    let (prompts, blocks) = (1_400u64, 100u64);
    let hash = |p: u64, b: u64| p * 1_000 + b + 1;
    let tokens = |p: u64| -> Vec<u32> { (0..16 * blocks).map(|t| (p * 16 * blocks + t) as u32).collect() };
    let stored = |p: u64| {
        EngineEvent::Stored(EngineStored {
            parent: None,
            hashes: (0..blocks).map(|b| hash(p, b)).collect(),
            tokens: tokens(p),
            block_size: 16,
            medium: Medium::Gpu,
            namespace: Some(ns.clone()),
            group: None,
        })
    };
    let removed =
        EngineEvent::Removed { hashes: (0..100).map(|p| hash(p * 7, 50)).collect(), medium: Medium::Gpu, group: None };
    let mut events: Vec<EngineEvent> = (0..prompts).map(stored).collect();
    events.push(removed.clone());
    let huge = EngineBatch { seq: 0, ts: 1.0, events };
    let whole = Warm::open(dir.path().join("whole.redb"))?;
    assert_eq!(whole.engine_batch("gpu-0", &huge)?, EngineOutcome::Applied);
    let small = Warm::open(dir.path().join("small.redb"))?;
    for p in 0..prompts {
        let batch = EngineBatch { seq: p, ts: 1.0 + p as f64, events: vec![stored(p)] };
        assert_eq!(small.engine_batch("gpu-0", &batch)?, EngineOutcome::Applied);
    }
    let last = EngineBatch { seq: prompts, ts: 2_000.0, events: vec![removed] };
    assert_eq!(small.engine_batch("gpu-0", &last)?, EngineOutcome::Applied);
    let sample: Vec<u64> = (0..prompts).step_by(13).chain([0, 7, 693, prompts - 1]).collect();
    let held = |warm: &Warm| -> Result<Vec<usize>, Error> {
        sample.iter().map(|&p| Ok(warm.warm_nodes("m", &tokens(p))?.first().map_or(0, |h| h.tokens))).collect()
    };
    let want = held(&small)?;
    assert!(want.iter().filter(|&&t| t == 50 * 16 / 64 * 64).count() >= 2, "removals cut prompts: {want:?}");
    assert!(want.contains(&(16 * blocks as usize)), "whole prompts held: {want:?}");
    assert_eq!(held(&whole)?, want, "answered as small batches");
    let counts = |warm: &Warm| -> Result<(u64, u64, usize), Error> {
        let stats = warm.engine_stats()?;
        let s = stats.first().ok_or(Error::Poisoned)?;
        Ok((s.counts.stored, s.counts.removed, s.engine_blocks))
    };
    assert_eq!(counts(&whole)?, counts(&small)?);
    whole.close()?;
    let whole = Warm::open(dir.path().join("whole.redb"))?;
    assert_eq!(held(&whole)?, want, "the same after a reopen");
    assert_eq!(whole.engine_stats()?.first().and_then(|s| s.last_seq), Some(0), "the batch is the stream's last");
    let next = EngineBatch { seq: 1, ts: 3_000.0, events: vec![] };
    assert_eq!(whole.engine_batch("gpu-0", &next)?, EngineOutcome::Applied, "the stream goes on from it");
    whole.close()?;
    small.close()?;
    Ok(())
}

/// While a listener waits for a replay to cover a gap, what the node holds is not answered (the
/// batches lost may have removed some of it), and its status says it is replaying; once the
/// replay is applied, the node is answered for what its engine holds, the lost batch included.
#[test]
fn a_node_is_not_answered_while_its_gap_is_being_covered() -> Result<(), Error> {
    let dir = tempfile::tempdir().map_err(|e| Error::InvalidConfig { detail: e.to_string() })?;
    let warm = Arc::new(Warm::open(dir.path().join("doubt.redb"))?);
    let publisher = Publisher::new(Duration::from_secs(2))?;
    let spec = format!("gpu-0={},replay={}", publisher.events, publisher.replay);
    let engines = [EngineEndpoint::parse(&spec, Some("m"))?];
    let listener = Listener::start(Arc::clone(&warm), &engines, Duration::from_secs(60))?;
    let mut engine = Engine::new(16, 1 << 20, "m", None)?;
    let prompt = |i: u32| -> Vec<u32> { (0..64 * 3).map(|t| 100_000 + t + i * 100_000).collect() };
    let answered = |i: u32| warm.warm_nodes("m", &prompt(i)).map(|h| h.first().map_or(0, |h| h.tokens));
    // Batches until the subscriber has joined and one is applied (the first are lost to it).
    let (mut n, started) = (0, Instant::now());
    while answered(n)? == 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "the listener never applied a batch");
        n += 1;
        publisher.publish(&engine.run(&prompt(n)), false)?;
        std::thread::sleep(Duration::from_millis(50));
    }
    let held = n;
    let replays = |listener: &Listener| listener.stats().first().map_or(0, |s| s.replays);
    // (The batches before the subscriber joined may have been replayed already.)
    while replays(&listener) > 0 && listener.stats().first().is_some_and(|s| s.replaying) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let replays_before = replays(&listener);
    // One batch lost live, then the next one shows the gap.
    publisher.publish(&engine.run(&prompt(1_000)), true)?;
    publisher.publish(&engine.run(&prompt(1_001)), false)?;
    let replaying = |listener: &Listener| listener.stats().first().is_some_and(|s| s.replaying);
    while !replaying(&listener) {
        assert!(started.elapsed() < Duration::from_secs(60), "the gap was never seen");
        std::thread::sleep(Duration::from_millis(5));
    }
    let in_doubt = answered(held)?;
    let still_replaying = replaying(&listener);
    while replaying(&listener) || answered(1_001)? == 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "the replay was never applied");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(still_replaying, "the answer was read while the replay was waited for");
    assert_eq!(in_doubt, 0, "what the node held was answered while its gap was being covered");
    assert_eq!((answered(held)?, answered(1_000)?, answered(1_001)?), (192, 192, 192), "all held once covered");
    assert_eq!(replays(&listener), replays_before + 1, "one replay covered the gap");
    let stats = listener.stop();
    assert_eq!(stats.first().map(|s| (s.replays_short, s.replaying)), Some((0, false)));
    Ok(())
}
