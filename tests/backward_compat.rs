//! Upgrading from 0.1.7: the fixture written by the real 0.1.7 code gives the same answers after
//! the import; bad files are refused without touching anything.

use std::path::{Path, PathBuf};
use superfluid_warm::ReadIndex;

use redb::ReadableTable;
use serde::Deserialize;
use superfluid_warm::{Error, Hit, Warm};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0001-from-0.1.7-json");

#[derive(Deserialize)]
struct Query {
    model: String,
    tokens: Vec<u32>,
    answer: Option<Answer>,
}

#[derive(Deserialize)]
struct Answer {
    node: String,
    tokens: usize,
}

fn queries() -> Vec<Query> {
    let text = std::fs::read_to_string(Path::new(DIR).join("queries.jsonl")).expect("fixture queries");
    text.lines().map(|l| serde_json::from_str(l).expect("a query line")).collect()
}

fn fixture() -> PathBuf {
    Path::new(DIR).join("warm.json")
}

fn check_all(warm: &Warm, queries: &[Query]) -> Result<usize, Error> {
    let mut warm_answers = 0;
    for (i, q) in queries.iter().enumerate() {
        let want = q.answer.as_ref().map(|a| Hit::new(a.node.clone(), a.tokens));
        warm_answers += usize::from(want.is_some());
        assert_eq!(warm.warmest(&q.model, &q.tokens)?, want, "query {i}");
    }
    Ok(warm_answers)
}

#[test]
fn the_0_1_7_fixture_gives_the_same_400_answers_after_the_upgrade_and_a_restart() -> Result<(), Error> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("warm.redb");
    let before = std::fs::read(fixture()).expect("fixture");
    let queries = queries();
    assert_eq!(queries.len(), 400);
    {
        let warm = Warm::builder().import_json(fixture()).open(&path)?;
        let warm_answers = check_all(&warm, &queries)?;
        assert!(warm_answers > 100, "the fixture has warm answers to check ({warm_answers})");
        assert!(warm.stats()?.legacy_entries > 0);
        warm.close()?;
    }
    let warm = Warm::builder().import_json(fixture()).open(&path)?;
    check_all(&warm, &queries)?;
    let again = warm.import_json(fixture())?;
    assert!(again.already_imported, "the same file is imported once");
    assert_eq!(std::fs::read(fixture()).expect("fixture"), before, "the JSON file is never modified");
    Ok(())
}

#[test]
fn new_turns_after_the_upgrade_extend_old_prefixes_and_old_entries_age_out() -> Result<(), Error> {
    let dir = tempfile::tempdir().expect("tempdir");
    let queries = queries();
    let entries_in_file = {
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(fixture()).expect("fixture")).expect("json");
        json["prefixes"].as_array().map_or(0, Vec::len) as u64
    };
    let warm = Warm::builder().capacity(entries_in_file + 64).open(dir.path().join("w.redb"))?;
    let report = warm.import_json(fixture())?;
    assert_eq!(report.imported, entries_in_file);
    let q = queries.iter().find(|q| q.answer.as_ref().is_some_and(|a| a.tokens >= 256)).expect("a warm query");
    let old = warm.warmest(&q.model, &q.tokens)?.expect("warm before the new turn");
    // The conversation goes on after the upgrade: its next turn lands on the same node.
    let mut next = q.tokens.clone();
    next.extend(7_000_000..7_000_200);
    warm.ran(&q.model, &next, &old.node)?;
    let new = warm.warmest(&q.model, &next)?.expect("warm after the new turn");
    assert_eq!(new.node, old.node);
    assert_eq!(new.tokens, next.len() / 64 * 64, "the whole new turn is warm under the new hash");
    // Fresh traffic pushes every imported entry out; their prefixes go cold, as 0.1.7's would.
    let mut fresh_rans = 0;
    while warm.stats()?.legacy_entries > 0 && fresh_rans < entries_in_file as u32 {
        for _ in 0..32 {
            let tokens: Vec<u32> = (0..256).map(|t| 9_000_000 + fresh_rans * 1000 + t).collect();
            warm.ran("fresh", &tokens, "node-x")?;
            fresh_rans += 1;
        }
        warm.sync()?; // stats count what is written
    }
    let stats = warm.stats()?;
    assert_eq!(stats.legacy_entries, 0, "{stats:?}");
    assert!(stats.entries <= stats.capacity);
    let other =
        queries.iter().find(|o| o.answer.is_some() && o.model != q.model).expect("a warm query of the other model");
    assert_eq!(warm.warmest(&other.model, &other.tokens)?, None);
    Ok(())
}

#[test]
fn malformed_or_missing_json_is_a_typed_error_and_changes_nothing() -> Result<(), Error> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.redb");
    let warm = Warm::open(&path)?;
    let tokens: Vec<u32> = (0..256).collect();
    warm.ran("m", &tokens, "a")?;
    for (name, body) in [
        ("truncated.json", &br#"{"prefixes":[[1,"a",2],"#[..]),
        ("float.json", br#"{"prefixes":[[1.5,"a",2]]}"#),
        ("empty-node.json", br#"{"prefixes":[[1,"",2]]}"#),
        ("other.json", br#"{"entries":[]}"#),
    ] {
        let bad = dir.path().join(name);
        std::fs::write(&bad, body).expect("write");
        let err = warm.import_json(&bad).expect_err(name);
        assert!(matches!(err, Error::LegacyJson { .. }), "{name}: {err}");
        assert!(err.to_string().contains("left as it is"), "{err}");
        assert_eq!(std::fs::read(&bad).expect("read"), body, "{name} untouched");
    }
    let missing = warm.import_json(dir.path().join("absent.json")).expect_err("missing");
    assert!(matches!(missing, Error::Io { .. }), "{missing}");
    assert_eq!(warm.stats()?.entries, 4);
    assert_eq!(warm.warmest("m", &tokens)?, Some(Hit::new("a", 256)));
    drop(warm);
    let bad = dir.path().join("truncated.json");
    let err = Warm::builder().import_json(&bad).open(&path).expect_err("bad import on open");
    assert!(matches!(err, Error::LegacyJson { .. }));
    assert_eq!(Warm::open(&path)?.stats()?.entries, 4, "a refused open touched nothing");
    Ok(())
}

const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");

/// Rewrites the schema version of a closed index (the first byte of the bincode meta record is
/// the schema as a varint).
fn set_schema(path: &Path, from: u8, schema: u8) {
    let db = redb::Database::create(path).expect("open with redb");
    let txn = db.begin_write().expect("write");
    {
        let mut table = txn.open_table(META).expect("meta table");
        let mut bytes = table.get("meta").expect("read").expect("a meta record").value().to_vec();
        assert_eq!(bytes[0], from, "the schema byte");
        bytes[0] = schema;
        table.insert("meta", bytes.as_slice()).expect("write");
    }
    txn.commit().expect("commit");
}

#[test]
fn a_newer_or_unknown_format_is_refused_with_a_typed_error() -> Result<(), Error> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.redb");
    let warm = Warm::open(&path)?;
    warm.ran("m", &[3; 256], "a")?;
    warm.close()?;
    set_schema(&path, 8, 9);
    let err = Warm::open(&path).expect_err("a newer schema");
    assert!(matches!(err, Error::NewerSchema { found: 9, supported: 8 }), "{err}");
    assert!(err.to_string().contains("upgrade superfluid-warm"), "{err}");
    let err = superfluid_warm::Snapshot::open(&path).expect_err("readers refuse it too");
    assert!(matches!(err, Error::NewerSchema { .. }), "{err}");
    // Schema 2 names the 0.2.0 chain: a schema 2 record naming another is not a file we wrote.
    set_schema(&path, 9, 2);
    let err = Warm::open(&path).expect_err("schema 2 with the v3 chain");
    assert!(matches!(err, Error::UnknownFormat { .. }), "{err}");
    set_schema(&path, 2, 8);
    assert_eq!(Warm::open(&path)?.warmest("m", &[3; 256])?.map(|h| h.tokens), Some(256), "refusing changed nothing");

    // A redb file of another program, and a file that is not redb at all.
    let foreign = dir.path().join("foreign.redb");
    {
        let db = redb::Database::create(&foreign).expect("create");
        let txn = db.begin_write().expect("write");
        txn.open_table(redb::TableDefinition::<u64, u64>::new("other")).expect("table").insert(1, 2).expect("insert");
        txn.commit().expect("commit");
    }
    assert!(matches!(Warm::open(&foreign), Err(Error::UnknownFormat { .. })));
    let text = dir.path().join("text.redb");
    std::fs::write(&text, "this is not a database, it is a text file of some length ".repeat(100)).expect("write");
    let err = Warm::open(&text).expect_err("not redb");
    assert!(matches!(err, Error::UnknownFormat { .. } | Error::Corrupted { .. }), "{err}");
    Ok(())
}

/// Schema 1 (pre-release builds) cannot be upgraded: refused with its own error, file untouched.
#[test]
fn a_pre_release_schema_1_file_is_refused_and_left_as_it_is() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/0002-segment-keys-and-generations/warm-v1.redb");
    let path = dir.path().join("warm-v1.redb");
    std::fs::copy(&fixture, &path).expect("copy the fixture");
    let before = v1_prefixes(&path);
    assert!(before.len() > 100, "the fixture holds entries");
    let err = Warm::open(&path).expect_err("schema 1");
    assert!(matches!(err, Error::RetiredSchema { found: 1 }), "{err}");
    assert!(err.to_string().contains("start a new index"), "{err}");
    let err = superfluid_warm::Snapshot::open(&path).expect_err("readers refuse it too");
    assert!(matches!(err, Error::RetiredSchema { found: 1 }), "{err}");
    assert!(v1_prefixes(&path) == before, "a refused file keeps its entries");
}

/// A schema 1 prefix entry: key → (node, namespace, depth, clock).
type V1Entry = ([u8; 16], (u32, u32, u32, u64));

/// The schema 1 prefix table, read with redb directly.
fn v1_prefixes(path: &Path) -> Vec<V1Entry> {
    use redb::{ReadableDatabase, ReadableTable};
    const V1: redb::TableDefinition<[u8; 16], (u32, u32, u32, u64)> = redb::TableDefinition::new("prefixes/v1");
    let db = redb::ReadOnlyDatabase::open(path).expect("open read-only");
    let txn = db.begin_read().expect("read");
    let table = txn.open_table(V1).expect("the v1 table");
    table.iter().expect("iter").map(|e| e.map(|(k, v)| (k.value(), v.value())).expect("entry")).collect()
}

/// The prompts `migrations/0003-tree-chain/warm-v2.redb` was written with (see its NOTE.md):
/// (tenant?, tokens, node), in order.
fn v2_fixture_prompts() -> Vec<(bool, Vec<u32>, String)> {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake-conversation.jsonl");
    let requests = harness::trace::read(&trace).expect("the trace");
    requests
        .iter()
        .take(40)
        .enumerate()
        .map(|(i, r)| {
            let mut tokens = r.tokens();
            tokens.truncate(64 * 20);
            if i % 4 == 1 {
                tokens.iter_mut().for_each(|t| *t %= 151_936);
            }
            (i % 5 == 2, tokens, format!("node-{}", i % 3))
        })
        .collect()
}

/// A schema 2 (0.2.0) file is upgraded to schema 4 and keeps its keys: they were made by the
/// 0.2.0 chain, which this build still computes for it. Every prompt answers as the 0.1.7
/// semantics say, a new `ran` is answered, and the file keeps its chain across a reopen.
#[test]
fn a_schema_2_file_keeps_its_chain_and_every_answer() -> Result<(), Error> {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/0003-tree-chain/warm-v2.redb");
    let path = dir.path().join("warm-v2.redb");
    std::fs::copy(&fixture, &path).expect("copy the fixture");
    let prompts = v2_fixture_prompts();
    let mut model = harness::baseline::Baseline::in_memory(1 << 16);
    let name = |tenant: bool| if tenant { "fixture-model/tenant-a" } else { "fixture-model" };
    for (tenant, tokens, node) in &prompts {
        model.ran(name(*tenant), tokens, node);
    }
    let shared = superfluid_warm::Namespace::new("fixture-model")?;
    let tenant_a = superfluid_warm::Namespace::with_tenant("fixture-model", b"tenant-a")?;
    let answers = |warm: &Warm, model: &harness::baseline::Baseline| -> Result<usize, Error> {
        let mut hits = 0;
        for (tenant, tokens, _) in &prompts {
            let prefix = warm.prefix(if *tenant { &tenant_a } else { &shared }, tokens);
            let want = model.warmest(name(*tenant), tokens).map(|(node, tokens)| Hit::new(node, tokens));
            assert_eq!(warm.warmest_prefix(&prefix)?, want, "tenant {tenant}");
            hits += usize::from(want.is_some());
        }
        Ok(hits)
    };
    {
        let warm = Warm::open(&path)?;
        assert_eq!(warm.stats()?.upgraded_from, Some(2));
        assert_eq!(answers(&warm, &model)?, prompts.len(), "every prompt of the fixture answers");
        // A new turn extends the first conversation on another node.
        let mut next = prompts[0].1.clone();
        next.extend((0..128u32).map(|t| t * 7 + 3));
        warm.ran_prefix(&warm.prefix(&shared, &next), "node-new")?;
        model.ran(name(false), &next, "node-new");
        assert_eq!(warm.warmest("fixture-model", &next)?, Some(Hit::new("node-new", next.len())));
        // A prefix made outside this index, in the new files' scheme, is refused, not missed.
        let foreign = superfluid_warm::Prefix::new(&shared, &next);
        assert!(matches!(warm.warmest_prefix(&foreign), Err(Error::ForeignPrefix { .. })));
        assert!(matches!(warm.ran_prefix(&foreign, "node-x"), Err(Error::ForeignPrefix { .. })));
        warm.close()?;
    }
    let snapshot = superfluid_warm::Snapshot::open(&path)?;
    let stats = snapshot.stats()?;
    // Upgraded to the newest schema in place, keeping its own chain.
    assert_eq!((stats.schema, stats.hash_scheme.as_str()), (8, "blake3-keyed-chain-seg16/v2"));
    drop(snapshot);
    let warm = Warm::open(&path)?;
    assert_eq!(answers(&warm, &model)?, prompts.len());
    Ok(())
}

/// An import into an open index, then `ran`s past capacity with the default group commit and no
/// `sync`: 0.1.7, loading the same file and making the same `ran`s, evicts the imported entries
/// and the new ones in the same order, and every answer (the fixture's queries, the new prompts)
/// is the same at every step.
/// An import past the capacity evicts the oldest eighth (0.1.7's rule) until it fits, says how
/// many it evicted, and that is durable.
#[test]
fn an_import_past_the_capacity_evicts_and_reports_it() -> Result<(), Error> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("warm.redb");
    let warm = Warm::builder().capacity(100).open(&path)?;
    let report = warm.import_json(fixture())?;
    assert_eq!(report.imported, 240);
    assert!(report.evicted >= 140, "{report:?}");
    assert_eq!(warm.stats()?.entries, 240 - report.evicted);
    drop(warm);
    let warm = Warm::open(&path)?;
    assert!(warm.stats()?.entries <= 100, "the eviction was committed: {:?}", warm.stats()?.entries);
    Ok(())
}

#[test]
fn after_an_import_evictions_keep_0_1_7s_order_between_old_and_new_entries() -> Result<(), Error> {
    use harness::baseline::Baseline;
    let dir = tempfile::tempdir().expect("tempdir");
    let capacity = 320;
    let warm = Warm::builder().capacity(capacity).open(dir.path().join("warm.redb"))?;
    let report = warm.import_json(fixture())?;
    assert_eq!(report.imported, 240);
    let copy = dir.path().join("warm.json");
    std::fs::copy(fixture(), &copy).expect("copy the fixture");
    let mut model = Baseline::kept_in(copy, capacity as usize);
    let queries = queries();
    let answer = |model: &Baseline, m: &str, tokens: &[u32]| {
        model.warmest(m, tokens).map(|(node, tokens)| Hit::new(node, tokens))
    };
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    let (mut compared, mut legacy_warm_at_end) = (0, 0);
    for i in 0..240u32 {
        // Twelve conversations of growing turns, 2 to 14 blocks, in tokens the fixture's
        // prompts never used (0.1.7 would share its keys with them; the index keys them anew).
        let conv = i % 12;
        let len = 64 * (2 + (i / 12) % 13) + i % 64;
        let tokens: Vec<u32> = (0..len).map(|t| 7_000_000 + conv * 100_000 + t).collect();
        let node = format!("node-{}", i % 5);
        model.ran("qwen-2.5-7b", &tokens, &node);
        warm.ran("qwen-2.5-7b", &tokens, &node)?;
        prompts.push(tokens);
        if i % 20 == 19 {
            for q in &queries {
                assert_eq!(warm.warmest(&q.model, &q.tokens)?, answer(&model, &q.model, &q.tokens), "after ran {i}");
                compared += 1;
            }
            for p in prompts.iter().rev().take(24) {
                assert_eq!(warm.warmest("qwen-2.5-7b", p)?, answer(&model, "qwen-2.5-7b", p), "after ran {i}");
                compared += 1;
            }
        }
    }
    for q in &queries {
        legacy_warm_at_end += usize::from(answer(&model, &q.model, &q.tokens).is_some());
    }
    let stats = warm.stats()?;
    println!(
        "{compared} answers compared; {} entries ({} imported) as 0.1.7 holds {}; {legacy_warm_at_end} fixture queries still warm",
        stats.entries,
        stats.legacy_entries,
        model.len()
    );
    assert_eq!(stats.entries, model.len() as u64);
    assert!(stats.legacy_entries < 240, "some imported entries were evicted");
    assert!(legacy_warm_at_end > 0, "and some are still answered");
    Ok(())
}

/// A node's cache counts the blocks it ran, never 0.1.7's entries: not where an imported entry
/// names the node, nor where a later import moved the entry to another node and kept the node
/// among its others. A size set after the imports is seeded from what the file ties to the node.
#[test]
fn imported_entries_never_count_in_a_node_cache_even_among_others() -> Result<(), Error> {
    let dir = tempfile::tempdir().expect("tempdir");
    let (first, second) = (dir.path().join("a.json"), dir.path().join("b.json"));
    std::fs::write(&first, r#"{"prefixes":[[1,"x",5],[2,"x",6]]}"#).expect("write");
    std::fs::write(&second, r#"{"prefixes":[[1,"y",9]]}"#).expect("write");
    let warm = Warm::open(dir.path().join("warm.redb"))?;
    warm.import_json(&first)?;
    warm.import_json(&second)?;
    let prompt: Vec<u32> = (0..256).collect();
    warm.ran("m", &prompt, "x")?;
    warm.set_node_capacity("x", Some(100))?;
    let held = |warm: &Warm| -> Result<Option<u64>, Error> {
        Ok(warm.stats()?.node_caches.iter().find(|c| c.node == "x").map(|c| c.held))
    };
    assert_eq!(held(&warm)?, Some(4), "the 4 blocks x ran, not the 2 imported entries nor the one among others");
    assert!(warm.stats()?.others > 0, "the second import kept x among the block's others");
    warm.close()?;
    let snapshot = superfluid_warm::Snapshot::open(dir.path().join("warm.redb"))?;
    assert_eq!(snapshot.check()?.problems, Vec::<String>::new());
    let warm = Warm::open(dir.path().join("warm.redb"))?;
    assert_eq!(held(&warm)?, Some(4));
    Ok(())
}

/// One tie rule for `warmest` and `warm_nodes`: where a node found by 0.1.7's imported entries
/// ties in length with a node of the new chain, the new chain's comes first in both, whichever
/// clock is newer (0.1.7's clocks come with its file, and may be past the index's).
#[test]
fn an_imported_entry_loses_a_tie_to_the_new_chain_in_warm_nodes_as_in_warmest() -> Result<(), Error> {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("warm.json");
    let prompt: Vec<u32> = (0..256).collect();
    let mut old = harness::baseline::Baseline::kept_in(json.clone(), 1 << 16);
    for i in 0..20u32 {
        old.ran("m", &[i + 1000; 256], "elsewhere");
    }
    old.ran("m", &prompt, "legacy-node");
    assert!(old.save() > 0, "0.1.7's file written");
    let warm = Warm::open(dir.path().join("w.redb"))?;
    warm.ran("m", &prompt, "new-node")?;
    warm.import_json(&json)?;
    let nodes: Vec<String> = warm.warm_nodes("m", &prompt)?.into_iter().map(|h| h.node).collect();
    assert_eq!(nodes, ["new-node", "legacy-node"], "both hold the whole prompt; the new chain first");
    assert_eq!(warm.warmest("m", &prompt)?, Some(Hit::new("new-node", 256)));
    Ok(())
}
