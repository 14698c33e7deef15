//! The replay's routing policy balances load without giving up much warmth.

use superfluid_warm::tools::replay::{self, Config, Policy};
use superfluid_warm::tools::trace;
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
