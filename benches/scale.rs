//! The figures of issue 5 that criterion does not fit: open after a clean close and after a
//! crash, the durable point (time and bytes written), at 64k and 1M entries; warmest at 10M
//! entries with resident memory; 4 threads of `ran` with group commit. The 0.1.7 design is
//! measured in the same run where it has a counterpart, and ratios are printed.
//!
//! `cargo bench --bench scale` (all, ~3 min); `cargo bench --bench scale -- 64k 1m 10m threads`
//! picks parts. A crash is a child process (this binary again) that fills a file and aborts.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use superfluid_warm::ReadIndex;

use harness::baseline::Baseline;
use harness::replay::{Timing, node_name};
use superfluid_warm::{Namespace, OpenCheck, Warm};

const MODEL: &str = "bench";
/// Blocks per filler prompt.
const BLOCKS: u32 = 64;

/// A distinct prompt of `BLOCKS` blocks.
fn prompt(i: u32) -> Vec<u32> {
    (0..BLOCKS * 64).map(|t| i.wrapping_mul(1_000_003).wrapping_add(t * 7919)).collect()
}

/// Fills `path` with `entries` blocks (distinct prompts, 8 nodes), committed.
fn fill(path: &Path, entries: u64) -> Warm {
    let warm = Warm::builder().capacity(entries + entries / 4).open(path).expect("open");
    let ns = Namespace::new(MODEL).expect("namespace");
    for i in 0..(entries / u64::from(BLOCKS)) as u32 {
        let p = warm.prefix(&ns, &prompt(i));
        warm.ran_prefix(&p, &node_name(i as usize % 8)).expect("ran");
    }
    warm.sync().expect("sync");
    warm
}

/// The same entries in the 0.1.7 design, saved.
fn fill_baseline(path: &Path, entries: u64) -> Baseline {
    let mut base = Baseline::kept_in(path.to_path_buf(), entries as usize + 1);
    for i in 0..(entries / u64::from(BLOCKS)) as u32 {
        base.ran(MODEL, &prompt(i), &node_name(i as usize % 8));
    }
    base.save();
    base
}

/// Bytes this process has written to storage so far (`/proc/self/io`).
fn written() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    io.lines().find_map(|l| l.strip_prefix("write_bytes: ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Resident and peak resident memory in MiB (`/proc/self/status`).
fn rss() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn median(v: &[Duration]) -> Duration {
    Timing::of(v).p50
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Opens after a clean close and after a crash at `entries`, and the durable point, beside the
/// 0.1.7 design's load and save.
fn open_and_durable(label: &str, entries: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("warm.redb");
    let json = dir.path().join("warm.json");
    let warm = fill(&path, entries);
    let mut base = fill_baseline(&json, entries);
    // Durable point: one new ran (64 blocks) made durable, ours and 0.1.7's taken in turn (both
    // see the same state of the machine), each on a quiet disk: 0.1.7's file is synced after its
    // timed `save`, which does not sync, so that its writeback is not timed as ours.
    let rounds = 20u32;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let (mut our_bytes, mut their_bytes) = (0u64, 0u64);
    for k in 0..rounds {
        warm.ran(MODEL, &prompt(10_000_000 + k), "node-new").expect("ran");
        let before = written();
        ours.push(timed(|| warm.sync().expect("sync")));
        our_bytes += written() - before;
        base.ran(MODEL, &prompt(10_000_000 + k), "node-new");
        let before = written();
        theirs.push(timed(|| {
            base.save();
        }));
        their_bytes += written() - before;
        std::fs::File::open(&json).and_then(|f| f.sync_all()).expect("sync 0.1.7's file");
    }
    let (our_bytes, their_bytes) = (our_bytes / u64::from(rounds), their_bytes / u64::from(rounds));
    let (ours, theirs) = (median(&ours), median(&theirs));
    println!(
        "{label}: durable point {} and {} KiB written vs 0.1.7 save {} and {} KiB: {:.1}x cheaper in time, {:.1}x in bytes",
        ms(ours),
        our_bytes / 1024,
        ms(theirs),
        their_bytes / 1024,
        theirs.as_secs_f64() / ours.as_secs_f64(),
        their_bytes as f64 / our_bytes.max(1) as f64
    );
    let before_close = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let closing = Instant::now();
    warm.close().expect("close");
    let closed = closing.elapsed();
    let file = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    // Open only (the close, and the seal it writes, are not timed): what a restarted head waits.
    let open_with = |builder: &superfluid_warm::Builder, unseal: bool, expect: OpenCheck| {
        median(
            &(0..7)
                .map(|_| {
                    if unseal {
                        let _ = std::fs::remove_file(superfluid_warm::IndexFile::new(&path).seal_path());
                    }
                    let t = Instant::now();
                    let warm = builder.open(&path).expect("open");
                    let took = t.elapsed();
                    assert_eq!(warm.stats().expect("stats").open_check, expect);
                    warm.close().expect("close");
                    took
                })
                .collect::<Vec<_>>(),
        )
    };
    let sealed = open_with(&Warm::builder(), false, OpenCheck::Seal);
    let pages = open_with(&Warm::builder(), true, OpenCheck::Pages);
    let unchecked = open_with(Warm::builder().check_integrity_on_open(false), true, OpenCheck::Skipped);
    let load = median(
        &(0..3)
            .map(|_| timed(|| drop(black_box(Baseline::kept_in(json.clone(), entries as usize + 1)))))
            .collect::<Vec<_>>(),
    );
    let ratio = |d: Duration| d.as_secs_f64() / load.as_secs_f64();
    println!(
        "{label}: close {} (the file {:.1} -> {:.1} MiB: compacted when a quarter of it is free pages, then sealed)",
        ms(closed),
        before_close as f64 / 1048576.0,
        file as f64 / 1048576.0
    );
    println!(
        "{label}: open after a clean close {} (default: the seal verified) vs 0.1.7 load {}: {:.3}x; without a seal (every page verified by redb) {} ({:.3}x); unchecked {} ({:.3}x); file {:.1} MiB",
        ms(sealed),
        ms(load),
        ratio(sealed),
        ms(pages),
        ratio(pages),
        ms(unchecked),
        ratio(unchecked),
        file as f64 / 1048576.0
    );
    // After a crash: a child process writes more and aborts without closing.
    let crashed = dir.path().join("crashed.redb");
    std::fs::copy(&path, &crashed).expect("copy");
    let status = Command::new(std::env::current_exe().expect("exe"))
        .env("SCALE_CRASH_CHILD", &crashed)
        .status()
        .expect("spawn the crashing child");
    assert!(!status.success(), "the child aborts");
    let t = Instant::now();
    let warm = Warm::open(&crashed).expect("open after a crash");
    let after_crash = t.elapsed();
    let hit = warm.warmest(MODEL, &prompt(3)).expect("warmest");
    println!(
        "{label}: open after a crash {} (redb's repair verifies every page); a committed prompt answers {:?}",
        ms(after_crash),
        hit.map(|h| h.tokens)
    );
}

fn timed(f: impl FnOnce()) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

/// The crashing child: opens, writes a few rans, makes them durable, writes more, aborts.
fn crash_child(path: &Path) -> ! {
    let warm = Warm::open(path).expect("child open");
    for i in 0..50 {
        warm.ran(MODEL, &prompt(20_000_000 + i), "node-crash").expect("ran");
    }
    warm.sync().expect("sync");
    for i in 50..100 {
        warm.ran(MODEL, &prompt(20_000_000 + i), "node-crash").expect("ran");
    }
    std::process::abort();
}

/// Warmest at 10M entries: filled here, answered by a fresh process (so its resident memory is
/// what a head that opens such a file uses, not what filling it left behind).
fn ten_million() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path: PathBuf = dir.path().join("warm.redb");
    let entries = 10_000_000u64;
    // Each in a fresh process, so that what the parts run before left in this one's heap (the
    // 0.1.7 design's 1M-entry map among them, freed but kept by the allocator) is not counted:
    // a head that fills the file, then one that opens it and answers.
    for child in ["SCALE_FILL_CHILD", "SCALE_ANSWER_CHILD"] {
        let status = Command::new(std::env::current_exe().expect("exe"))
            .env(child, &path)
            .env("SCALE_ENTRIES", entries.to_string())
            .status()
            .expect("spawn a child");
        assert!(status.success(), "{child} failed");
    }
}

/// Fills a 10M-entry file from one thread, as a head would, and closes it.
fn fill_child(path: &Path, entries: u64) {
    let t = Instant::now();
    let warm = fill(path, entries);
    let filled = t.elapsed();
    let (_, peak) = rss();
    let before_close = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let closing = Instant::now();
    warm.close().expect("close");
    let closed = closing.elapsed();
    let file = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    println!(
        "10M: filled {entries} entries in {:.1} s from one thread (peak resident while filling {peak:.0} MiB); close {} (file {:.0} -> {:.0} MiB)",
        filled.as_secs_f64(),
        ms(closed),
        before_close as f64 / 1048576.0,
        file as f64 / 1048576.0
    );
}

/// The answering child: opens the 10M file and times warmest on random filled prompts.
fn answer_child(path: &Path, entries: u64) {
    let t = Instant::now();
    let warm = Warm::open(path).expect("open");
    let open = t.elapsed();
    let ns = Namespace::new(MODEL).expect("namespace");
    let n = (entries / u64::from(BLOCKS)) as u32;
    let mut state = 12345u64;
    let mut times = Vec::new();
    let mut hits = 0;
    for _ in 0..20_000 {
        state = harness::trace::splitmix64(state);
        let i = (state % u64::from(n)) as u32;
        let p = warm.prefix(&ns, &prompt(i));
        let t = Instant::now();
        hits += usize::from(black_box(warm.warmest_prefix(&p).expect("warmest")).is_some());
        times.push(t.elapsed());
    }
    let (now, peak) = rss();
    println!(
        "10M: open {}; warmest of a {BLOCKS}-block prompt p50 {:.1} us p99 {:.1} us ({hits}/20000 hits); resident {now:.0} MiB (peak {peak:.0} MiB)",
        ms(open),
        Timing::of(&times).p50.as_secs_f64() * 1e6,
        Timing::of(&times).p99.as_secs_f64() * 1e6
    );
}

/// 4 threads of `ran` (conversation turns), group commit: rans/s and the latency until durable.
fn threads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let warm = Warm::open(dir.path().join("warm.redb")).expect("open");
    let per_thread = 2_000u32;
    let t = Instant::now();
    let latencies: Vec<Duration> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4u32)
            .map(|th| {
                let warm = &warm;
                s.spawn(move || {
                    let ns = Namespace::new(MODEL).expect("namespace");
                    let mut out = Vec::new();
                    for i in 0..per_thread {
                        // 100 conversations per thread, each turn one block longer.
                        let conv = th * 1000 + i % 100;
                        let turn = i / 100 + 2;
                        let tokens: Vec<u32> = (0..turn * 64).map(|t| conv * 100_000 + t).collect();
                        let p = warm.prefix(&ns, &tokens);
                        let _ = warm.warmest_prefix(&p).expect("warmest");
                        warm.ran_prefix(&p, &node_name((conv % 8) as usize)).expect("ran");
                        if i % 50 == 0 {
                            // How long until this ran is durable: sync waits for the commit.
                            let t = Instant::now();
                            warm.sync().expect("sync");
                            out.push(t.elapsed());
                        }
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("thread")).collect()
    });
    let wall = t.elapsed();
    let lat = latencies;
    let rans = 4 * per_thread;
    println!(
        "4 threads: {rans} rans (incl. warmest) in {:.2} s = {:.0} rans/s with group commit; sync latency p50 {} p99 {}",
        wall.as_secs_f64(),
        f64::from(rans) / wall.as_secs_f64(),
        ms(Timing::of(&lat).p50),
        ms(Timing::of(&lat).p99)
    );
    let t = Instant::now();
    for i in 0..400u32 {
        let tokens: Vec<u32> = (0..256).map(|t| 9_000_000 + i * 1000 + t).collect();
        warm.ran(MODEL, &tokens, "node-x").expect("ran");
    }
    let queued = t.elapsed();
    let t = Instant::now();
    warm.sync().expect("sync");
    println!(
        "4 threads: without sync, 400 rans return in {} and are durable {} later (default window 50 ms)",
        ms(queued),
        ms(t.elapsed())
    );
}

/// Engines: 8 simulated engines of 65,536 blocks of 16 tokens fed the shared trace until all
/// are full (and on, evicting), their batches written to a file; a fresh process then applies
/// them as a listening head does (decode, `engine_batch`), closes, and reopens the file: its
/// peak resident memory is what a head following 8 full engines needs.
fn engines() {
    use harness::engine_sim::{SimEngine, encode};
    use harness::trace;
    let dir = tempfile::tempdir().expect("tempdir");
    let batches = dir.path().join("batches.bin");
    let requests =
        trace::read(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/mooncake-conversation.jsonl")))
            .expect("the shared trace");
    let (nodes, capacity) = (8usize, 65_536usize);
    let mut sims: Vec<SimEngine> =
        (0..nodes).map(|_| SimEngine::new(16, capacity, "mooncake", None).expect("engine")).collect();
    let mut out = Vec::new();
    let (mut n, mut full_at) = (0usize, None);
    for (i, r) in requests.iter().enumerate() {
        // Round robin: every engine fills.
        let node = i % nodes;
        let batch = sims[node].run(&r.tokens());
        let payload = encode(&batch);
        out.push(node as u8);
        out.extend_from_slice(&batch.seq.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&payload);
        n += 1;
        if full_at.is_none() && sims.iter().all(|s| s.len() >= capacity) {
            full_at = Some(i);
        }
    }
    std::fs::write(&batches, &out).expect("write the batches");
    println!(
        "engines: {} batches ({:.0} MiB of vLLM payloads) for {nodes} engines of {capacity} blocks; all full from request {}",
        n,
        out.len() as f64 / 1048576.0,
        full_at.map_or_else(|| "never".to_string(), |i| i.to_string())
    );
    drop((sims, out));
    // SCALE_ENGINES_BATCHES: keep a copy of the batches there (to profile a child by hand).
    if let Some(keep) = std::env::var_os("SCALE_ENGINES_BATCHES") {
        std::fs::copy(&batches, keep).expect("keep the batches");
    }
    // A head with redb's default cache, and one with a 32 MiB cache (a listener that answers
    // little needs little of it).
    for cache in [None, Some("32")] {
        let mut child = Command::new(std::env::current_exe().expect("exe"));
        child.env("SCALE_ENGINES_CHILD", &batches);
        if let Some(mb) = cache {
            child.env("SCALE_ENGINES_CACHE_MB", mb);
        }
        assert!(child.status().expect("spawn a child").success(), "the engines child failed");
    }
}

/// Applies the batches of [`engines`] as a listening head does, then reopens the file.
fn engines_child(batches: &Path) {
    // Streamed from the file, a batch at a time, as a listener receives them.
    let mut file = std::io::BufReader::new(std::fs::File::open(batches).expect("the batches"));
    // The redb cache: the default, or SCALE_ENGINES_CACHE_MB.
    let cache = std::env::var("SCALE_ENGINES_CACHE_MB").ok().and_then(|c| c.parse::<usize>().ok());
    let path = batches.with_file_name(format!("engines-{}.redb", cache.unwrap_or(0)));
    let open = || {
        let mut b = Warm::builder();
        if let Some(mb) = cache {
            b.cache_size(mb << 20);
        }
        b.open(&path).expect("open")
    };
    let warm = open();
    let names: Vec<String> = (0..8).map(node_name).collect();
    let t = Instant::now();
    let mut events = 0usize;
    let mut head = [0u8; 13];
    let mut payload = Vec::new();
    // SCALE_ENGINES_LIMIT: stop after that many batches (for a heap profile of the full engines).
    let limit = std::env::var("SCALE_ENGINES_LIMIT").ok().and_then(|c| c.parse::<usize>().ok()).unwrap_or(usize::MAX);
    let mut applied_batches = 0usize;
    while applied_batches < limit && std::io::Read::read_exact(&mut file, &mut head).is_ok() {
        applied_batches += 1;
        let node = head[0] as usize;
        let seq = u64::from_le_bytes(head[1..9].try_into().expect("seq"));
        let len = u32::from_le_bytes(head[9..13].try_into().expect("len")) as usize;
        payload.resize(len, 0);
        std::io::Read::read_exact(&mut file, &mut payload).expect("a payload");
        let batch = superfluid_warm::decode_engine_batch(seq, &payload, "mooncake").expect("decode");
        events += batch.events.len();
        warm.engine_batch(&names[node], &batch).expect("apply");
    }
    warm.sync().expect("sync");
    let applied = t.elapsed();
    let (rss_applied, peak_applied) = rss();
    let stats = warm.engine_stats().expect("stats");
    let engine_blocks: usize = stats.iter().map(|s| s.engine_blocks).sum();
    let ours: usize = stats.iter().map(|s| s.blocks).sum();
    warm.close().expect("close");
    let t = Instant::now();
    let warm = open();
    let reopened = t.elapsed();
    let again: usize = warm.engine_stats().expect("stats").iter().map(|s| s.engine_blocks).sum();
    assert_eq!(again, engine_blocks, "a reopen keeps what the engines hold");
    let (rss_reopened, peak) = rss();
    let file = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    println!(
        "engines ({} redb cache): applied {events} events in {:.1} s; {engine_blocks} engine blocks held ({ours} of 64 tokens); resident {rss_applied:.0} MiB (peak {peak_applied:.0}); reopened in {} with resident {rss_reopened:.0} MiB (peak of the process {peak:.0} MiB); file {:.0} MiB",
        cache.map_or_else(|| "default".to_string(), |c| format!("{c} MiB")),
        applied.as_secs_f64(),
        ms(reopened),
        file as f64 / 1048576.0
    );
}

fn main() {
    if let Some(path) = std::env::var_os("SCALE_ENGINES_CHILD") {
        engines_child(Path::new(&path));
        return;
    }
    if let Some(path) = std::env::var_os("SCALE_CRASH_CHILD") {
        crash_child(Path::new(&path));
    }
    let entries = || std::env::var("SCALE_ENTRIES").ok().and_then(|e| e.parse().ok()).unwrap_or(0);
    if let Some(path) = std::env::var_os("SCALE_FILL_CHILD") {
        fill_child(Path::new(&path), entries());
        return;
    }
    if let Some(path) = std::env::var_os("SCALE_ANSWER_CHILD") {
        answer_child(Path::new(&path), entries());
        return;
    }
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let want = |part: &str| args.is_empty() || args.iter().any(|a| a == part);
    println!("superfluid-warm scale benchmark ({} cores)", std::thread::available_parallelism().map_or(1, |n| n.get()));
    if want("64k") {
        open_and_durable("64k", 1 << 16);
    }
    if want("1m") {
        open_and_durable("1M", 1 << 20);
    }
    if want("threads") {
        threads();
    }
    if want("10m") {
        ten_million();
    }
    if want("engines") {
        engines();
    }
}
