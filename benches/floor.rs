//! The least a new block costs the commit thread under this crate's shape (each block a key of
//! a redb table): one redb insert into a table of the prefix table's types, in sorted batches of
//! 65,536 keys clustered 16 a segment as block keys are, four batches timed starting from 64k or
//! 1M entries (the table grows by the 262,144 while timed: an index at capacity 65,536 fed back
//! to back takes batches of ~160k new keys before the batch's eviction). Beside it, in the same
//! run, 0.1.7's whole cost per block on the Mooncake conversation trace (its `warmest` + `ran`,
//! in memory), and what the two give for the whole trace: the blocks it inserts (each distinct
//! block once, the fewest any layout with a key a block must insert) times the insert, against
//! 0.1.7's total. 5 runs, each printed.
//!
//! `cargo bench --bench floor` (~1 min).

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use harness::baseline::Baseline;
use harness::replay::node_name;
use harness::trace;
use redb::{Database, TableDefinition};

const MODEL: &str = "mooncake-conversation";
/// The prefix table's key and value types (`docs/design.md`).
const PREFIXES: TableDefinition<u128, (u32, u32, u32, u64)> = TableDefinition::new("prefixes");
const BATCH: usize = 1 << 16;
const SEGMENT: usize = 16;

/// xorshift64: reproducible keys without a dependency.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// `n` fresh keys, `SEGMENT` sharing their first 8 bytes, sorted.
fn keys(state: &mut u64, n: usize) -> Vec<u128> {
    let mut keys = Vec::with_capacity(n);
    while keys.len() < n {
        let segment = u128::from(next(state)) << 64;
        keys.extend((0..SEGMENT).map(|_| segment | u128::from(next(state))));
    }
    keys.truncate(n);
    keys.sort_unstable();
    keys
}

fn insert_all(db: &Database, keys: &[u128], clock: u64) -> Duration {
    let txn = db.begin_write().expect("write");
    let t = Instant::now();
    {
        let mut table = txn.open_table(PREFIXES).expect("table");
        for &k in keys {
            table.insert(k, (1, 1, 1, clock)).expect("insert");
        }
    }
    let spent = t.elapsed();
    txn.commit().expect("commit");
    spent
}

/// Microseconds per insert of a fresh key into a table of `filled` entries.
fn redb_insert(dir: &Path, run: u64, filled: usize) -> f64 {
    let path = dir.join(format!("floor-{run}.redb"));
    let db = Database::create(&path).expect("create");
    let mut state = 0x9E37_79B9_7F4A_7C15 ^ run;
    for clock in 0..(filled / BATCH) as u64 {
        insert_all(&db, &keys(&mut state, BATCH), clock);
    }
    let (mut spent, mut n) = (Duration::ZERO, 0);
    for clock in 0..4 {
        let batch = keys(&mut state, BATCH);
        spent += insert_all(&db, &batch, 100 + clock);
        n += batch.len();
    }
    drop(db);
    let _ = std::fs::remove_file(&path);
    spent.as_secs_f64() * 1e6 / n as f64
}

fn main() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces/mooncake-conversation.jsonl");
    let prompts: Vec<Vec<u32>> = trace::read(&path).expect("the trace").iter().map(trace::Request::tokens).collect();
    let blocks: usize = prompts.iter().map(|p| p.len() / 64).sum();
    let distinct = {
        let mut all = Baseline::in_memory(usize::MAX);
        for p in &prompts {
            all.ran(MODEL, p, "n");
        }
        all.len()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    println!(
        "the trace: {} requests, {blocks} blocks, {distinct} distinct (each inserted at least once)",
        prompts.len()
    );
    for run in 0..5 {
        let small = redb_insert(dir.path(), run, 1 << 16);
        let insert = redb_insert(dir.path(), run, 1 << 20);
        let mut base = Baseline::in_memory(harness::baseline::MAX_0_1_7);
        let t = Instant::now();
        for (i, p) in prompts.iter().enumerate() {
            black_box(base.warmest(MODEL, p));
            base.ran(MODEL, p, &node_name(i % 8));
        }
        let theirs = t.elapsed().as_secs_f64();
        let floor = distinct as f64 * small.min(insert) * 1e-6;
        println!(
            "run {run}: redb insert of a new key at 64k / 1M entries {small:.2} / {insert:.2} µs; 0.1.7 {:.2} µs a block ({:.0} ms the trace); \
             the trace's inserts alone, at the cheaper: {:.0} ms = {:.2}x 0.1.7's total",
            theirs * 1e6 / blocks as f64,
            theirs * 1e3,
            floor * 1e3,
            floor / theirs
        );
    }
}
