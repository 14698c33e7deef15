//! Random operation sequences, reopens included, against the in-memory model of 0.1.7.

mod common;

use harness::baseline::Baseline;
use proptest::prelude::*;
use superfluid_warm::ReadIndex;
use superfluid_warm::{Hit, Warm};

#[derive(Clone, Debug)]
enum Op {
    Ran { conversation: usize, grow: usize, node: usize },
    Ask { conversation: usize, cut: usize },
    Sync,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..6usize, 0..400usize, 0..3usize).prop_map(|(conversation, grow, node)| Op::Ran { conversation, grow, node }),
        4 => (0..6usize, 0..2000usize).prop_map(|(conversation, cut)| Op::Ask { conversation, cut }),
        1 => Just(Op::Sync),
        1 => Just(Op::Reopen),
    ]
}

/// Runs `ops` on the index `open` opens and on `model`, comparing every answer and the final
/// count; returns the index, still open.
fn run_ops(ops: Vec<Op>, open: impl Fn() -> Warm, model: &mut Baseline) -> Result<Warm, TestCaseError> {
    let mut warm = open();
    // Conversation c's prompt: a shared 128-token system prompt, then its own turns.
    let mut prompts: Vec<Vec<u32>> = (0..6).map(|_| (0..128).collect()).collect();
    for op in ops {
        match op {
            Op::Ran { conversation, grow, node } => {
                let p = &mut prompts[conversation];
                common::next_turn(p, conversation, grow);
                let node = ["a", "b", "c"][node];
                model.ran("m", p, node);
                warm.ran("m", p, node).expect("ran");
            }
            Op::Ask { conversation, cut } => {
                let p = &prompts[conversation];
                let p = &p[..cut.min(p.len())];
                let want = model.warmest("m", p).map(|(node, tokens)| Hit::new(node, tokens));
                prop_assert_eq!(warm.warmest("m", p).expect("warmest"), want);
            }
            Op::Sync => warm.sync().expect("sync"),
            Op::Reopen => {
                warm.close().expect("close");
                warm = open();
            }
        }
    }
    prop_assert_eq!(warm.stats().expect("stats").entries, model.len() as u64);
    Ok(warm)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_answer_as_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        let dir = common::tempdir();
        let path = common::db_path(&dir);
        let mut model = Baseline::in_memory(1 << 20);
        run_ops(ops, || Warm::open(&path).expect("open"), &mut model)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The same at capacities small enough that most `ran`s evict (some `ran`s are longer than
    /// the capacity and evict themselves), with and without a commit thread: every answer, the
    /// count, and the file's invariants after a close.
    #[test]
    fn random_sequences_at_a_small_capacity_evict_as_the_model(
        ops in proptest::collection::vec(op(), 1..60),
        capacity in prop_oneof![Just(8u64), Just(24), Just(60)],
        threaded in any::<bool>(),
    ) {
        let dir = common::tempdir();
        let path = common::db_path(&dir);
        let window = if threaded { superfluid_warm::DEFAULT_SYNC_WINDOW } else { std::time::Duration::ZERO };
        let open = || Warm::builder().capacity(capacity).sync_window(window).open(&path).expect("open");
        let mut model = Baseline::in_memory(capacity as usize);
        run_ops(ops, open, &mut model)?.close().expect("close");
        let check = superfluid_warm::Snapshot::open(&path).expect("snapshot").check().expect("check");
        prop_assert!(check.problems.is_empty(), "{:?}", check.problems);
    }
}
