//! The index against a faithful 0.1.7 baseline, in the same run: per-request index time on the
//! Mooncake conversation trace (caller latency and sustained throughput), the durable point at
//! 64k entries, and open at 64k entries. The rest of issue 5's figures are in `scale.rs`.
//! `cargo bench` prints criterion's figures, then the ratios (ours / 0.1.7).

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};
use superfluid_warm::ReadIndex;

use criterion::{Criterion, criterion_group};
use harness::baseline::{Baseline, MAX_0_1_7};
use harness::replay::node_name;
use harness::trace;
use superfluid_warm::{Namespace, Warm};

const MODEL: &str = "mooncake-conversation";

fn requests() -> Vec<Vec<u32>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces/mooncake-conversation.jsonl");
    trace::read(&path).expect("the trace").iter().map(trace::Request::tokens).collect()
}

/// 64k entries of distinct 4-block prompts, in both designs.
fn filled(dir: &Path) -> (Warm, Baseline, Vec<Vec<u32>>) {
    let warm = Warm::builder().capacity(1 << 20).open(dir.join("bench.redb")).expect("open");
    let mut base = Baseline::kept_in(dir.join("bench.json"), MAX_0_1_7);
    let prompts: Vec<Vec<u32>> = (0..16_384u32).map(|i| (0..256).map(|t| i * 1000 + t).collect()).collect();
    for (i, p) in prompts.iter().enumerate() {
        warm.ran(MODEL, p, &node_name(i % 8)).expect("ran");
        base.ran(MODEL, p, &node_name(i % 8));
    }
    warm.sync().expect("sync");
    base.save();
    (warm, base, prompts)
}

/// Per request on the Mooncake trace, nodes round-robin (so every block is written each time).
/// "caller": the time `prefix` + `warmest` + `ran` take on the head's thread while the commit
/// thread keeps up (it is given a `sync` outside the timed region every 64 requests, as a head
/// at the trace's own rate, 3.4 requests/s, always gives it); "sustained": back to back with the
/// commit thread saturated, so the time includes waiting for it (throughput).
fn per_request(c: &mut Criterion) {
    let reqs = requests();
    let dir = tempfile::tempdir().expect("tempdir");
    let warm = Warm::open(dir.path().join("trace.redb")).expect("open");
    let ns = Namespace::new(MODEL).expect("namespace");
    let mut base = Baseline::in_memory(MAX_0_1_7);
    let mut group = c.benchmark_group("request (warmest + ran), Mooncake trace");
    caller(&mut group, "superfluid-warm caller", &reqs);
    let mut i = 0;
    group.bench_function("superfluid-warm sustained", |b| {
        b.iter(|| {
            let tokens = &reqs[i % reqs.len()];
            let prefix = warm.prefix(&ns, tokens);
            black_box(warm.warmest_prefix(&prefix).expect("warmest"));
            warm.ran_prefix(&prefix, &node_name(i % 8)).expect("ran");
            i += 1;
        })
    });
    let mut j = 0;
    group.bench_function("0.1.7", |b| {
        b.iter(|| {
            let tokens = &reqs[j % reqs.len()];
            black_box(base.warmest(MODEL, tokens));
            base.ran(MODEL, tokens, &node_name(j % 8));
            j += 1;
        })
    });
    group.finish();
}

/// The caller's time per request (see [`per_request`]) on a fresh index, as bench `name`.
fn caller(group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, name: &str, reqs: &[Vec<u32>]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let warm = Warm::open(dir.path().join("caller.redb")).expect("open");
    let ns = Namespace::new(MODEL).expect("namespace");
    let mut i = 0;
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let tokens = &reqs[i % reqs.len()];
                let t = Instant::now();
                let prefix = warm.prefix(&ns, tokens);
                black_box(warm.warmest_prefix(&prefix).expect("warmest"));
                warm.ran_prefix(&prefix, &node_name(i % 8)).expect("ran");
                timed += t.elapsed();
                i += 1;
                if i % 64 == 0 {
                    warm.sync().expect("sync");
                }
            }
            timed
        })
    });
}

/// The caller bench again once a Prometheus recorder is installed (the process's, as `listen
/// --metrics` installs it): what the metrics cost a head that exports them. Runs last: a
/// global recorder cannot be taken back, and every bench before it ran without one.
fn with_recorder(c: &mut Criterion) {
    let reqs = requests();
    // With the library's buckets, as the binary's exporter keeps them.
    harness::prometheus::builder().expect("buckets").install_recorder().expect("a recorder");
    superfluid_warm::describe_metrics();
    let mut group = c.benchmark_group("request (warmest + ran), Mooncake trace");
    caller(&mut group, "superfluid-warm caller, Prometheus recorder installed", &reqs);
    group.finish();
}

fn durable_and_open(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (warm, mut base, prompts) = filled(dir.path());
    let mut group = c.benchmark_group("durable point at 64k entries (one new ran, then sync/save)");
    group.sample_size(20);
    let mut k = 0u32;
    group.bench_function("superfluid-warm sync", |b| {
        b.iter(|| {
            warm.ran(MODEL, &prompts[k as usize % prompts.len()], &node_name(k as usize % 7)).expect("ran");
            warm.sync().expect("sync");
            k += 1;
        })
    });
    group.bench_function("0.1.7 save", |b| {
        b.iter(|| {
            base.ran(MODEL, &prompts[k as usize % prompts.len()], &node_name(k as usize % 7));
            black_box(base.save());
            k += 1;
        })
    });
    group.finish();
    drop(warm);
    let mut group = c.benchmark_group("open at 64k entries");
    group.sample_size(10);
    group.bench_function("superfluid-warm open", |b| {
        // The close (and the seal it writes) is not timed: what a restarted head waits for.
        b.iter_custom(|iters| {
            let mut opened = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                let warm = black_box(Warm::open(dir.path().join("bench.redb")).expect("open"));
                opened += t.elapsed();
                warm.close().expect("close");
            }
            opened
        })
    });
    group.bench_function("0.1.7 load", |b| {
        b.iter(|| black_box(Baseline::kept_in(dir.path().join("bench.json"), MAX_0_1_7)))
    });
    group.finish();
}

fn time(n: u32, mut f: impl FnMut()) -> Duration {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed() / n
}

/// The ratios, measured again side by side (medians of criterion are in its own output).
fn ratios() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (warm, mut base, prompts) = filled(dir.path());
    let ours = time(50, || {
        warm.ran(MODEL, &prompts[7], "node-x").expect("ran");
        warm.ran(MODEL, &prompts[7], "node-y").expect("ran");
        warm.sync().expect("sync");
    });
    let theirs = time(10, || {
        base.ran(MODEL, &prompts[7], "node-x");
        black_box(base.save());
    });
    let json_bytes = std::fs::metadata(dir.path().join("bench.json")).map(|m| m.len()).unwrap_or(0);
    drop(warm);
    // Open only: each head is closed (and the file sealed) outside the timed part.
    let mut opened = Duration::ZERO;
    for _ in 0..5 {
        let t = Instant::now();
        let warm = black_box(Warm::open(dir.path().join("bench.redb")).expect("open"));
        opened += t.elapsed();
        warm.close().expect("close");
    }
    let open = opened / 5;
    let load = time(5, || drop(black_box(Baseline::kept_in(dir.path().join("bench.json"), MAX_0_1_7))));
    println!("\nratios at 64k entries (ours / 0.1.7):");
    println!(
        "  durable point: {ours:?} vs save {theirs:?} ({json_bytes} bytes rewritten): {:.3}x",
        ratio(ours, theirs)
    );
    println!("  open:          {open:?} vs load {load:?}: {:.3}x", ratio(open, load));
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-12)
}

criterion_group!(benches, per_request, durable_and_open, with_recorder);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    ratios();
}
