//! The replay's routing policy balances load without giving up much warmth.

use harness::replay::{self, Config, Policy};
use harness::trace;
use superfluid_warm::{Error, Warm};

#[test]
fn balanced_keeps_load_within_2x_and_most_of_the_naive_warm_share() -> Result<(), Error> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/mooncake-conversation.jsonl");
    let mut requests = trace::read(std::path::Path::new(path)).expect("the shared trace");
    requests.truncate(2000);
    let dir = tempfile::tempdir().expect("tempdir");
    let share = |policy, name: &str| -> Result<replay::Report, Error> {
        let warm = Warm::open(dir.path().join(name))?;
        let config = Config { policy, baseline: false, ..Config::default() };
        replay::run(&warm, &requests, &config, |_| {})
    };
    let naive = share(Policy::Warmest, "naive.redb")?;
    let balanced = share(Policy::Balanced, "balanced.redb")?;
    println!(
        "naive: warm share {:.3}, imbalance {:.2}; balanced: warm share {:.3}, imbalance {:.2}",
        naive.warm_share(),
        naive.imbalance(),
        balanced.warm_share(),
        balanced.imbalance()
    );
    assert!(naive.imbalance() > 2.0, "the naive rule piles onto one node");
    assert!(balanced.imbalance() <= 2.0, "balanced keeps max/min load within 2");
    assert!(balanced.warm_share() >= 0.8 * naive.warm_share(), "and keeps 80% of the naive warm share");
    Ok(())
}

/// Workloads made to pile onto a few nodes: every request one long shared prefix; two hot
/// prefixes with prompts from 1 to 64 hash ids long; every 50th request a huge one. Whatever the
/// workload and the bound, balanced keeps the most loaded node's total within `max_imbalance`
/// times the least one's plus one prompt (the rule's bound, by construction); without the bound,
/// the window's rule alone lets the huge tail pile past 1.1.
#[test]
fn balanced_keeps_its_load_bound_on_any_workload() -> Result<(), Error> {
    let request = |hash_ids: Vec<u64>| trace::Request {
        timestamp: 0,
        input_length: hash_ids.len() * trace::TOKENS_PER_HASH_ID,
        output_length: 1,
        hash_ids,
    };
    let mut seed = 7u64;
    let mut next = move |below: u64| {
        seed = trace::splitmix64(seed);
        seed % below
    };
    let one_prefix: Vec<trace::Request> = (0..600).map(|i| request(vec![1, 2, 3, 4, 5, 6, 1000 + i])).collect();
    let two_hot: Vec<trace::Request> = (0..600)
        .map(|i| {
            let hot = next(2) * 1_000_000;
            let len = 1 + next(64);
            request((0..len).map(|j| if j < len / 2 { hot + j } else { 10_000 * (i + 1) + j }).collect())
        })
        .collect();
    let huge_tail: Vec<trace::Request> = (0..600)
        .map(|i| {
            let len = if i % 50 == 0 { 96 } else { 2 };
            request((0..len).map(|j| if j < 1 { 5 } else { 20_000 * (i + 1) + j }).collect())
        })
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut runs = 0;
    for (name, requests) in [("one prefix", &one_prefix), ("two hot", &two_hot), ("huge tail", &huge_tail)] {
        let longest = requests.iter().map(|r| r.input_length as u64).max().unwrap_or(0);
        for max_imbalance in [1.02, 1.1, 1.3, f64::INFINITY] {
            runs += 1;
            let warm = Warm::open(dir.path().join(format!("{runs}.redb")))?;
            let config = Config { max_imbalance, baseline: false, ..Config::default() };
            let report = replay::run(&warm, requests, &config, |_| {})?;
            let (max, min) = (report.load.iter().max().copied(), report.load.iter().min().copied());
            let (max, min) = (max.unwrap_or(0) as f64, min.unwrap_or(0) as f64);
            println!(
                "{name}, bound {max_imbalance}: max/min {:.3}, warm share {:.3}",
                report.imbalance(),
                report.warm_share()
            );
            assert!(min > 0.0, "{name}: every node was given work");
            if max_imbalance.is_infinite() {
                // No bound (the window's rule alone): the huge tail piles past 1.1.
                let within = max <= 1.1 * min + longest as f64;
                assert!(!within || name != "huge tail", "the huge tail bites without a bound: {:?}", report.load);
                continue;
            }
            assert!(max <= max_imbalance * min + longest as f64, "{name}, bound {max_imbalance}: {:?}", report.load);
            assert!(report.warm_share() > 0.0, "{name}: something was routed warm");
        }
    }
    Ok(())
}
