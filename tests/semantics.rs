//! The behaviour of 0.1.7, kept: the seed's own test, ported, and the edges of the API.

use superfluid_warm::ReadIndex;
use superfluid_warm::{Error, Hit, Namespace, Warm};

fn hit(node: &str, tokens: usize) -> Option<Hit> {
    Some(Hit::new(node, tokens))
}

#[test]
fn the_longest_prefix_a_node_ran_wins_and_is_kept_across_a_restart() -> Result<(), Error> {
    let dir = tempfile::tempdir().map_err(|e| Error::Io { path: "tmp".into(), source: e.into() })?;
    let path = dir.path().join("warm.redb");
    let turn1: Vec<u32> = (0..300).collect();
    let mut turn2 = turn1.clone();
    turn2.extend(1000..1200);
    let warm = Warm::open(&path)?;
    warm.ran("m", &turn1, "a")?;
    warm.ran("m", &turn2[..400], "b")?;
    assert_eq!(warm.warmest("m", &turn2)?, hit("b", 384), "b ran more of it");
    assert_eq!(warm.warmest("m", &turn1)?, hit("b", 256), "b ran the same first blocks last");
    assert_eq!(warm.warmest("other", &turn2)?, None, "another model's prefix is its own");
    assert_eq!(warm.warmest("m", &(5000..5300).collect::<Vec<u32>>())?, None);
    assert_eq!(warm.warmest("m", &turn1[..100])?, None, "one block is too short to matter");
    warm.sync()?;
    drop(warm);
    let again = Warm::open(&path)?;
    assert_eq!(again.warmest("m", &turn2)?, hit("b", 384));
    Ok(())
}

#[test]
fn empty_and_short_prompts_are_none_and_bad_names_are_typed_errors() -> Result<(), Error> {
    let dir = tempfile::tempdir().map_err(|e| Error::Io { path: "tmp".into(), source: e.into() })?;
    let warm = Warm::open(dir.path().join("w.redb"))?;
    assert_eq!(warm.warmest("m", &[])?, None);
    warm.ran("m", &[], "a")?;
    warm.ran("m", &[1; 127], "a")?;
    assert_eq!(warm.stats()?.entries, 1, "only whole blocks are kept");
    assert!(matches!(warm.warmest("", &[1; 200]), Err(Error::InvalidName { what: "model", len: 0, .. })));
    assert!(matches!(warm.ran("m", &[1; 200], ""), Err(Error::InvalidName { what: "node", .. })));
    let long = "n".repeat(superfluid_warm::MAX_NODE_BYTES + 1);
    assert!(matches!(warm.ran("m", &[1; 200], &long), Err(Error::InvalidName { what: "node", .. })));
    let model = "m".repeat(superfluid_warm::MAX_MODEL_BYTES + 1);
    assert!(matches!(warm.ran(&model, &[1; 200], "a"), Err(Error::InvalidName { what: "model", .. })));
    // A NUL byte would cut a name short in a C string, a log line or a label.
    assert!(matches!(warm.ran("m", &[1; 200], "no\0de"), Err(Error::NulInName { what: "node", at: 2 })));
    assert!(matches!(warm.ran("m\0", &[1; 200], "a"), Err(Error::NulInName { what: "model", at: 1 })));
    assert!(matches!(warm.set_node_capacity("\0", Some(8)), Err(Error::NulInName { what: "node", at: 0 })));
    assert!(matches!(warm.forget_node("a\0"), Err(Error::NulInName { .. })));
    assert_eq!(warm.stats()?.entries, 1, "a refused ran wrote nothing");
    assert_eq!(warm.stats()?.nodes.len(), 1, "no node was made of a refused name");
    Ok(())
}

#[test]
fn tenants_never_share_a_prefix() -> Result<(), Error> {
    let dir = tempfile::tempdir().map_err(|e| Error::Io { path: "tmp".into(), source: e.into() })?;
    let warm = Warm::open(dir.path().join("w.redb"))?;
    let tokens: Vec<u32> = (0..512).collect();
    let a = Namespace::with_tenant("m", b"tenant-a")?;
    let b = Namespace::with_tenant("m", b"tenant-b")?;
    warm.ran_prefix(&warm.prefix(&a, &tokens), "node-a")?;
    assert_eq!(warm.warmest_prefix(&warm.prefix(&a, &tokens))?, hit("node-a", 512));
    assert_eq!(warm.warmest_prefix(&warm.prefix(&b, &tokens))?, None);
    assert_eq!(warm.warmest("m", &tokens)?, None, "the shared namespace is not a tenant's");
    Ok(())
}

/// With the default group commit and no `sync` between requests, every answer over the whole
/// shared conversation trace is 0.1.7's, evictions included: eviction is decided as each `ran`
/// returns, whatever the commit thread has written yet. Then the same file, reopened, answers
/// as the model still.
#[test]
fn back_to_back_over_the_whole_trace_every_answer_is_0_1_7s() -> Result<(), Error> {
    use harness::{baseline::Baseline, trace};
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/mooncake-conversation.jsonl");
    let requests = trace::read(std::path::Path::new(path)).expect("the shared trace");
    let dir = tempfile::tempdir().map_err(|e| Error::Io { path: "tmp".into(), source: e.into() })?;
    let capacity = 1 << 16;
    let warm = Warm::builder().capacity(capacity).open(dir.path().join("warm.redb"))?;
    let mut model = Baseline::in_memory(capacity as usize);
    let (mut warm_answers, mut last) = (0, None);
    for (i, request) in requests.iter().enumerate() {
        let tokens = request.tokens();
        let want = model.warmest("m", &tokens).map(|(node, tokens)| Hit::new(node, tokens));
        let got = warm.warmest("m", &tokens)?;
        assert_eq!(got, want, "request {i} of {}", requests.len());
        // The naive rule: the warm node, else round robin over 8.
        let node = want.as_ref().map_or_else(|| format!("node-{}", i % 8), |h| h.node.clone());
        warm_answers += usize::from(want.is_some());
        model.ran("m", &tokens, &node);
        warm.ran("m", &tokens, &node)?;
        last = Some(tokens);
    }
    let entries = warm.stats()?.entries;
    println!(
        "{} requests, {warm_answers} warm answers, all equal; {entries} entries, 0.1.7 holds {}",
        requests.len(),
        model.len()
    );
    assert_eq!(entries, model.len() as u64, "the file holds what 0.1.7 holds");
    assert!(warm_answers > requests.len() / 4);
    warm.close()?;
    let warm = Warm::open(dir.path().join("warm.redb"))?;
    for tokens in requests.iter().rev().take(200).map(|r| r.tokens()).chain(last) {
        let want = model.warmest("m", &tokens).map(|(node, tokens)| Hit::new(node, tokens));
        assert_eq!(warm.warmest("m", &tokens)?, want, "after a reopen");
    }
    Ok(())
}
