//! Several nodes per block, forgetting a node and node caches of finite size, against a small
//! model of what they mean: random sequences of `ran`s (conversations moving between nodes),
//! forgets, cache sizes, syncs and reopens, at capacities that evict, with and without a commit
//! thread.

mod common;

use std::collections::HashMap;
use superfluid_warm::ReadIndex;

use proptest::prelude::*;
use superfluid_warm::{Hit, Warm};

/// The model. A block (the tokens up to its end) names up to `k` nodes, each an incarnation
/// (name, how many times it was forgotten) with the clock it last ran the block at. Capacity
/// counts blocks, evicted by 0.1.7's rule on the newest clock of each block; every node seen at
/// or before the floor is evicted too. A forgotten incarnation still holds its place in a block
/// until it is pushed out or evicted, but is never answered.
///
/// A node's cache is an engine's LRU of whole `ran`s: every block the node ran, by the clock it
/// last ran it at (whether or not the block still names it); while it holds more than its
/// capacity, its oldest clock leaves, and a block is answered for the node only while in it.
/// A node incarnation (name, times forgotten before it) and the clock it last ran a block at.
type Member = ((String, u32), u64);
/// A node's cache: block (its tokens) → the clock the node last ran it at.
type Cache = HashMap<Vec<u32>, u64>;

struct Model {
    k: usize,
    capacity: usize,
    clock: u64,
    floor: u64,
    blocks: HashMap<Vec<u32>, Vec<Member>>,
    incarnation: HashMap<String, u32>,
    /// Per incarnation: its cache and its floor.
    caches: HashMap<(String, u32), (Cache, u64)>,
    /// Cache sizes by name, and the default.
    sizes: HashMap<String, u64>,
    default_size: Option<u64>,
}

impl Model {
    fn new(k: usize, capacity: usize) -> Model {
        Model {
            k,
            capacity,
            clock: 0,
            floor: 0,
            blocks: HashMap::new(),
            incarnation: HashMap::new(),
            caches: HashMap::new(),
            sizes: HashMap::new(),
            default_size: None,
        }
    }

    fn me(&self, node: &str) -> (String, u32) {
        (node.to_string(), self.incarnation.get(node).copied().unwrap_or(0))
    }

    /// Drops the oldest clocks of `who`'s cache while it holds more than its size.
    fn enforce(&mut self, who: &(String, u32)) {
        let Some(size) = self.sizes.get(&who.0).copied().or(self.default_size) else { return };
        let Some((cache, floor)) = self.caches.get_mut(who) else { return };
        while cache.len() as u64 > size {
            let Some(oldest) = cache.values().copied().min() else { break };
            cache.retain(|_, c| *c > oldest);
            *floor = oldest;
        }
    }

    fn set_size(&mut self, node: &str, size: Option<u64>) {
        match size {
            Some(s) => self.sizes.insert(node.to_string(), s),
            None => self.sizes.remove(node),
        };
        let me = self.me(node);
        self.enforce(&me);
    }

    /// Blocks of `tokens` that `node`'s cache holds, from the first on, in tokens.
    fn cached(&self, tokens: &[u32], node: &str) -> usize {
        let Some((cache, _)) = self.caches.get(&self.me(node)) else { return 0 };
        (64..=tokens.len()).step_by(64).take_while(|&end| cache.contains_key(&tokens[..end])).last().unwrap_or(0)
    }

    fn ran(&mut self, tokens: &[u32], node: &str) {
        self.clock += 1;
        let me = (node.to_string(), self.incarnation.get(node).copied().unwrap_or(0));
        for end in (64..=tokens.len()).step_by(64) {
            let set = self.blocks.entry(tokens[..end].to_vec()).or_default();
            set.retain(|(who, clock)| *who != me && *clock > self.floor);
            set.insert(0, (me.clone(), self.clock));
            set.sort_by_key(|m| std::cmp::Reverse(m.1));
            set.truncate(self.k);
        }
        if self.blocks.len() > self.capacity {
            let mut newest: Vec<u64> = self.blocks.values().map(|s| s[0].1).collect();
            newest.sort_unstable();
            let cut = newest[self.capacity / 8];
            self.blocks.retain(|_, s| s[0].1 > cut);
            self.floor = cut;
        }
        let (clock, floor) = (self.clock, self.floor);
        let (cache, _) = self.caches.entry(me.clone()).or_default();
        for end in (64..=tokens.len()).step_by(64) {
            cache.insert(tokens[..end].to_vec(), clock);
        }
        for (cache, _) in self.caches.values_mut() {
            cache.retain(|_, c| *c > floor);
        }
        self.enforce(&me);
    }

    fn forget(&mut self, node: &str) {
        let me = self.me(node);
        self.caches.remove(&me);
        *self.incarnation.entry(node.to_string()).or_default() += 1;
    }

    fn live(&self, who: &(String, u32), clock: u64) -> bool {
        clock > self.floor
            && self.incarnation.get(&who.0).copied().unwrap_or(0) == who.1
            && self.caches.get(who).is_none_or(|(_, floor)| clock > *floor)
    }

    fn warm_nodes(&self, tokens: &[u32]) -> Vec<Hit> {
        let mut deepest: Vec<(String, usize, u64)> = Vec::new();
        for end in (64..=tokens.len()).step_by(64) {
            let Some(set) = self.blocks.get(&tokens[..end]) else { break };
            for (who, clock) in set.iter().filter(|(w, c)| self.live(w, *c)) {
                match deepest.iter_mut().find(|d| d.0 == who.0) {
                    Some(d) => *d = (who.0.clone(), end, *clock),
                    None => deepest.push((who.0.clone(), end, *clock)),
                }
            }
        }
        deepest.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.cmp(&a.2)));
        deepest.into_iter().filter(|d| d.1 >= 128).map(|(node, tokens, _)| Hit::new(node, tokens)).collect()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Ran { conversation: usize, grow: usize, node: usize },
    Ask { conversation: usize, cut: usize },
    Forget { node: usize },
    Size { node: usize, blocks: Option<u64> },
    Sync,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..4usize, 0..300usize, 0..4usize).prop_map(|(conversation, grow, node)| Op::Ran { conversation, grow, node }),
        4 => (0..4usize, 0..2000usize).prop_map(|(conversation, cut)| Op::Ask { conversation, cut }),
        1 => (0..4usize).prop_map(|node| Op::Forget { node }),
        1 => Just(Op::Sync),
        1 => Just(Op::Reopen),
    ]
}

/// [`op`], and setting a node's cache size (or back to the default).
fn op_with_sizes() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => op(),
        1 => (0..4usize, prop_oneof![Just(None), (4..40u64).prop_map(Some)])
            .prop_map(|(node, blocks)| Op::Size { node, blocks }),
    ]
}

const NODES: [&str; 4] = ["a", "b", "c", "d"];

/// How answers are held to the model.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Every answer and count is the model's.
    Exact,
    /// And each node's cache count too (blocks keep every node, so none is dropped).
    ExactCaches,
    /// Blocks drop nodes (`nodes_per_prefix` is small): every node answered holds at least
    /// what it is answered for in its cache (the index may know less, never more).
    Cached,
}

fn run_ops(ops: Vec<Op>, open: impl Fn() -> Warm, model: &mut Model) -> Result<(), TestCaseError> {
    run_ops_expecting(ops, open, model, Expect::Exact)
}

fn run_ops_expecting(
    ops: Vec<Op>,
    open: impl Fn() -> Warm,
    model: &mut Model,
    expect: Expect,
) -> Result<(), TestCaseError> {
    let mut warm = open();
    // A shared 128-token system prompt, then each conversation's own turns.
    let mut prompts: Vec<Vec<u32>> = (0..4).map(|_| (0..128).collect()).collect();
    let mut answered = 0;
    for op in ops {
        match op {
            Op::Ran { conversation, grow, node } => {
                let p = &mut prompts[conversation];
                common::next_turn(p, conversation, grow);
                model.ran(p, NODES[node]);
                warm.ran("m", p, NODES[node]).expect("ran");
            }
            Op::Ask { conversation, cut } => {
                let p = &prompts[conversation];
                let p = &p[..cut.min(p.len())];
                let got = warm.warm_nodes("m", p).expect("warm_nodes");
                if expect != Expect::Cached {
                    let want = model.warm_nodes(p);
                    answered += want.len();
                    prop_assert_eq!(&got, &want);
                }
                for hit in &got {
                    let cached = model.cached(p, &hit.node);
                    prop_assert!(hit.tokens <= cached, "{:?} answered, {} tokens cached", hit, cached);
                }
                prop_assert_eq!(warm.warmest("m", p).expect("warmest"), got.first().cloned());
            }
            Op::Forget { node } => {
                model.forget(NODES[node]);
                warm.forget_node(NODES[node]).expect("forget");
            }
            Op::Size { node, blocks } => {
                model.set_size(NODES[node], blocks);
                warm.set_node_capacity(NODES[node], blocks).expect("set_node_capacity");
            }
            Op::Sync => warm.sync().expect("sync"),
            Op::Reopen => {
                warm.close().expect("close");
                warm = open();
            }
        }
    }
    let stats = warm.stats().expect("stats");
    prop_assert_eq!(stats.entries, model.blocks.len() as u64);
    for cache in stats.node_caches.iter().filter(|_| expect == Expect::ExactCaches) {
        let size = model.sizes.get(&cache.node).copied().or(model.default_size);
        prop_assert_eq!(cache.capacity, size);
        // A cache is counted only while it has a size.
        let held = model.caches.get(&model.me(&cache.node)).map_or(0, |(c, _)| c.len() as u64);
        prop_assert_eq!(cache.held, if size.is_some() { held } else { 0 }, "{}'s cache", &cache.node);
    }
    warm.close().expect("close");
    let _ = answered;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Every `warm_nodes` and `warmest` answer, and the count, are the model's; the file's
    /// invariants (the node counts included) hold after a close.
    #[test]
    fn node_sets_and_forgets_answer_as_the_model(
        ops in proptest::collection::vec(op(), 1..60),
        k in 1usize..4,
        capacity in prop_oneof![Just(12u64), Just(40), Just(1 << 20)],
        threaded in any::<bool>(),
    ) {
        let dir = common::tempdir();
        let path = common::db_path(&dir);
        let window = if threaded { superfluid_warm::DEFAULT_SYNC_WINDOW } else { std::time::Duration::ZERO };
        let open = || {
            Warm::builder().capacity(capacity).nodes_per_prefix(k).sync_window(window).open(&path).expect("open")
        };
        let mut model = Model::new(k, capacity as usize);
        run_ops(ops, open, &mut model)?;
        let check = superfluid_warm::Snapshot::open(&path).expect("snapshot").check().expect("check");
        prop_assert!(check.problems.is_empty(), "{:?}", check.problems);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Node caches of finite size (a default, and sizes set per node as the run goes), with
    /// blocks that keep every node: every answer is the model's LRU caches', each node's count
    /// is its cache's, and `check` (the per-node counts included) is clean.
    #[test]
    fn node_caches_answer_as_the_lru_model(
        ops in proptest::collection::vec(op_with_sizes(), 1..80),
        default in prop_oneof![Just(None), Just(Some(12u64)), Just(Some(30))],
        capacity in prop_oneof![Just(40u64), Just(1 << 20)],
        threaded in any::<bool>(),
    ) {
        let dir = common::tempdir();
        let path = common::db_path(&dir);
        let window = if threaded { superfluid_warm::DEFAULT_SYNC_WINDOW } else { std::time::Duration::ZERO };
        let open = || {
            let mut builder = Warm::builder();
            builder.capacity(capacity).nodes_per_prefix(16).sync_window(window);
            if let Some(d) = default {
                builder.node_cache_blocks(d);
            }
            builder.open(&path).expect("open")
        };
        let mut model = Model::new(16, capacity as usize);
        model.default_size = default;
        run_ops_expecting(ops, open, &mut model, Expect::ExactCaches)?;
        let check = superfluid_warm::Snapshot::open(&path).expect("snapshot").check().expect("check");
        prop_assert!(check.problems.is_empty(), "{:?}", check.problems);
    }

    /// The same with blocks that keep one to three nodes (so a block drops nodes whose cache
    /// still holds it): a node is never answered for more than its cache holds.
    #[test]
    fn a_node_is_never_answered_for_more_than_its_cache_holds(
        ops in proptest::collection::vec(op_with_sizes(), 1..80),
        k in 1usize..4,
        default in prop_oneof![Just(12u64), Just(30)],
        threaded in any::<bool>(),
    ) {
        let dir = common::tempdir();
        let path = common::db_path(&dir);
        let window = if threaded { superfluid_warm::DEFAULT_SYNC_WINDOW } else { std::time::Duration::ZERO };
        let open = || {
            Warm::builder().nodes_per_prefix(k).sync_window(window).node_cache_blocks(default).open(&path).expect("open")
        };
        let mut model = Model::new(k, 1 << 20);
        model.default_size = Some(default);
        run_ops_expecting(ops, open, &mut model, Expect::Cached)?;
        let check = superfluid_warm::Snapshot::open(&path).expect("snapshot").check().expect("check");
        prop_assert!(check.problems.is_empty(), "{:?}", check.problems);
    }
}

/// A conversation moved by the balancer stays warm on the node it left; forgetting the node it
/// moved to brings back the first one, across a reopen.
#[test]
fn a_moved_conversation_stays_warm_on_both_nodes_until_one_is_forgotten() -> Result<(), superfluid_warm::Error> {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let first: Vec<u32> = (0..640).collect();
    let mut second = first.clone();
    second.extend(1000..1320);
    {
        let warm = Warm::open(&path)?;
        warm.ran("m", &first, "a")?;
        warm.ran("m", &second, "b")?;
        let hit = |node: &str, tokens| Hit::new(node, tokens);
        assert_eq!(warm.warm_nodes("m", &second)?, vec![hit("b", 960), hit("a", 640)]);
        warm.forget_node("b")?;
        assert_eq!(warm.warm_nodes("m", &second)?, vec![hit("a", 640)]);
        assert_eq!(warm.warmest("m", &second)?, Some(hit("a", 640)));
        let stats = warm.stats()?;
        assert_eq!(stats.nodes.iter().map(|n| n.forgotten).collect::<Vec<_>>(), vec![false, true]);
        assert_eq!((stats.entries, stats.others, stats.reclaimable), (15, 10, 15), "b's 15 blocks are reclaimable");
        // b's next `ran` is a new incarnation.
        warm.ran("m", &first, "b")?;
        assert_eq!(warm.warm_nodes("m", &second)?, vec![hit("b", 640), hit("a", 640)]);
        assert_eq!(warm.stats()?.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), vec!["a", "b", "b"]);
    }
    let warm = Warm::open(&path)?;
    let hit = |node: &str, tokens| Hit::new(node, tokens);
    assert_eq!(warm.warm_nodes("m", &second)?, vec![hit("b", 640), hit("a", 640)], "the same after a reopen");
    Ok(())
}

/// A crash at every storage operation of a run of `ran`s that move conversations between nodes
/// and forgets, in every way the page cache can leave it: the file recovers to the state after
/// some prefix of the steps, never short of the last acknowledged one (a forget is
/// acknowledged when `forget_node` returns), answering `warm_nodes` exactly as the model does
/// there, with its invariants (node counts included).
#[test]
fn a_crash_at_any_write_keeps_every_acknowledged_ran_and_forget() -> Result<(), superfluid_warm::Error> {
    crash_suite(3, None)
}

/// The same with node caches (a default of 30 blocks, blocks that keep every node, and a node
/// given its own size now and then): what a node's cache lets go stays gone after a crash, and
/// the per-node counts pass `check`.
#[test]
fn a_crash_at_any_write_keeps_every_node_cache_as_acknowledged() -> Result<(), superfluid_warm::Error> {
    crash_suite(16, Some(30))
}

/// One step of a crash suite.
enum Step {
    Ran(Vec<u32>),
    Forget,
    Size(u64),
}

fn crash_suite(k: usize, size: Option<u64>) -> Result<(), superfluid_warm::Error> {
    use common::backend::{Disk, crash_images};
    let disk = Disk::default();
    let mut builder = Warm::builder();
    builder.sync_window(std::time::Duration::ZERO).nodes_per_prefix(k).capacity(60);
    if let Some(blocks) = size {
        builder.node_cache_blocks(blocks);
    }
    let open = builder.clone();
    let warm = builder.open_with_backend(disk.backend())?;
    let start = {
        let mut state = disk.state();
        state.record = true;
        state.durable.clone()
    };
    let mut rng = common::Rng(7);
    let mut prompts: Vec<Vec<u32>> = (0..4).map(|_| (0..128).collect()).collect();
    // Each step, and the node.
    let mut steps: Vec<(Step, &str)> = Vec::new();
    let mut acked = Vec::new();
    for i in 0..36 {
        let node = NODES[rng.below(4) as usize];
        if i % 6 == 5 {
            warm.forget_node(node)?;
            steps.push((Step::Forget, node));
        } else if size.is_some() && i % 12 == 8 {
            let blocks = 5 + rng.below(20);
            warm.set_node_capacity(node, Some(blocks))?;
            steps.push((Step::Size(blocks), node));
        } else {
            let c = rng.below(4) as usize;
            common::next_turn(&mut prompts[c], c, 30 + rng.below(200) as usize);
            warm.ran("m", &prompts[c], node)?;
            steps.push((Step::Ran(prompts[c].clone()), node));
        }
        acked.push(disk.state().ops.len());
    }
    drop(warm);
    let ops = disk.state().ops.clone();
    let model_after = |n: usize| {
        let mut model = Model::new(k, 60);
        model.default_size = size;
        for (step, node) in &steps[..n] {
            match step {
                Step::Ran(p) => model.ran(p, node),
                Step::Forget => model.forget(node),
                Step::Size(blocks) => model.set_size(node, Some(*blocks)),
            }
        }
        model
    };
    let models: Vec<Model> = (0..=steps.len()).map(model_after).collect();
    let dir = common::tempdir();
    let mut images = 0;
    for op in 0..=ops.len() {
        let acknowledged = acked.iter().filter(|&&n| n <= op).count();
        for (which, image) in crash_images(&start, &ops, op).into_iter().enumerate() {
            if which > 0 && op % 2 == 1 {
                continue;
            }
            images += 1;
            let path = dir.path().join(format!("crash-{op}-{which}.redb"));
            std::fs::write(&path, &image).expect("write image");
            let warm = open.open(&path)?;
            let mut answers = Vec::new();
            for p in &prompts {
                for cut in [128, 640, p.len()] {
                    answers.push(warm.warm_nodes("m", &p[..cut.min(p.len())])?);
                }
            }
            let entries = warm.stats()?.entries;
            warm.close()?;
            let matches = (acknowledged..=steps.len()).find(|&n| {
                let want: Vec<Vec<Hit>> = prompts
                    .iter()
                    .flat_map(|p| [128, 640, p.len()].map(|cut| models[n].warm_nodes(&p[..cut.min(p.len())])))
                    .collect();
                want == answers && models[n].blocks.len() as u64 == entries
            });
            assert!(
                matches.is_some(),
                "crash at op {op} ({which}): no state at or after step {acknowledged} answers so"
            );
            let check = superfluid_warm::Snapshot::open(&path)?.check()?;
            assert!(check.problems.is_empty(), "crash at op {op} ({which}): {:?}", check.problems);
            std::fs::remove_file(&path).expect("remove");
        }
    }
    println!("{images} crash images over {} storage operations, {} steps (6 forgets)", ops.len(), steps.len());
    Ok(())
}

/// A node dropped from a shared prefix's blocks (two nodes a block) runs a branch of it: the
/// dropped blocks count as new, not taken from the older branch's clock, so every block still
/// naming the node is counted (`check` is clean) and it answers the older branch still.
#[test]
fn blocks_that_dropped_a_node_are_counted_again_not_taken_from_another_branch() -> Result<(), superfluid_warm::Error> {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let warm = Warm::builder().nodes_per_prefix(2).node_cache_blocks(100).open(&path)?;
    let shared: Vec<u32> = (0..192).collect();
    let mut x = shared.clone();
    x.extend(1000..1192);
    let mut y = shared.clone();
    y.extend(2000..2128);
    warm.ran("m", &x, "a")?;
    warm.ran("m", &shared, "a")?;
    warm.ran("m", &shared, "b")?;
    warm.ran("m", &shared, "c")?;
    warm.ran("m", &y, "a")?;
    assert_eq!(warm.warmest("m", &x)?, Some(Hit::new("a", x.len())), "a still holds the x branch");
    warm.close()?;
    let check = superfluid_warm::Snapshot::open(&path)?.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    Ok(())
}

/// The default size can be removed and set again while the head runs: without it nothing is
/// counted (what a node's cache had lost stays unanswered), and the change is kept in the file;
/// set again, each node starts from what the file ties to it.
#[test]
fn the_default_node_cache_size_is_removed_and_set_again_while_the_head_runs() -> Result<(), superfluid_warm::Error> {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("warm.redb");
    let (first, second, third): (Vec<u32>, Vec<u32>, Vec<u32>) = (
        (0..256).map(|t| 1_000_000 + t).collect(),
        (0..384).map(|t| 2_000_000 + t).collect(),
        (0..192).map(|t| 3_000_000 + t).collect(),
    );
    let tokens = |warm: &Warm, p: &[u32]| warm.warmest("m", p).map(|h| h.map(|h| h.tokens));
    let warm = Warm::builder().node_cache_blocks(8).open(&path)?;
    assert!(
        warm.set_node_cache_default(Some(0)).is_err_and(|e| matches!(e, superfluid_warm::Error::InvalidConfig { .. }))
    );
    warm.ran("m", &first, "n")?;
    warm.ran("m", &second, "n")?;
    assert_eq!(tokens(&warm, &first)?, None, "pushed out of an 8-block cache");
    warm.set_node_cache_default(None)?;
    // Nothing counted, no size; the floor of what n's cache lost stays.
    let uncounted = |warm: &Warm| -> Result<bool, superfluid_warm::Error> {
        Ok(warm.stats()?.node_caches.iter().all(|c| c.held == 0 && c.capacity.is_none()))
    };
    assert!(uncounted(&warm)?, "{:?}", warm.stats()?.node_caches);
    warm.ran("m", &third, "n")?;
    assert_eq!((tokens(&warm, &first)?, tokens(&warm, &second)?, tokens(&warm, &third)?), (None, Some(384), Some(192)));
    warm.close()?;
    // Kept in the file: a plain open counts nothing either.
    let warm = Warm::open(&path)?;
    assert!(uncounted(&warm)?, "{:?}", warm.stats()?.node_caches);
    // Set again: n starts from the 6 + 3 blocks the file ties to it, more than 8, so its oldest
    // clock goes.
    warm.set_node_cache_default(Some(8))?;
    let n: Vec<_> = warm.stats()?.node_caches.into_iter().filter(|c| c.node == "n").collect();
    assert_eq!(n.iter().map(|c| (c.held, c.capacity)).collect::<Vec<_>>(), vec![(3, Some(8))], "{n:?}");
    assert_eq!((tokens(&warm, &second)?, tokens(&warm, &third)?), (None, Some(192)));
    warm.close()?;
    let check = superfluid_warm::Snapshot::open(&path)?.check()?;
    assert_eq!(check.problems, Vec::<String>::new());
    Ok(())
}
