//! The `replay` binary: the same answers twice, its passes (back to back, threads, node caches,
//! restarts), heads sharing through NATS, engines that publish their KV events, a report that
//! reads as one, and options checked up front.

#[allow(dead_code)]
#[path = "../../../tests/common/nats.rs"]
mod nats;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use superfluid_warm::Snapshot;

/// Runs the `replay` binary with `args`.
fn replay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_replay")).args(args).output().expect("the binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    text(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect()
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary directory")
}

/// Entries in a closed index file.
fn entries(path: &Path) -> u64 {
    Snapshot::open(path).expect("an index").entries()
}

/// A closed index of a few hundred entries made by `replay --db`.
fn small_index(dir: &tempfile::TempDir, name: &str, capacity: &str) -> PathBuf {
    let path = dir.path().join(name);
    let db = path.to_str().expect("utf-8");
    let out = replay(&["--requests", "200", "--capacity", capacity, "--no-baseline", "--no-back-to-back", "--db", db]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    path
}

#[test]
fn replay_of_the_first_500_trace_requests_gives_the_same_warm_share_twice() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces/mooncake-conversation.jsonl");
    let once = |_: u8| -> serde_json::Value {
        let out = replay(&["--trace", trace, "--requests", "500", "--json", "--no-baseline"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("replay JSON")
    };
    let (a, b) = (once(1), once(2));
    assert_eq!(a["requests"], 500);
    assert!(a["warm_tokens"].as_u64().is_some_and(|w| w > 0), "{a}");
    assert_eq!(a["warm_tokens"], b["warm_tokens"]);
    assert_eq!(a["load"], b["load"]);
    if cfg!(target_os = "linux") {
        assert!(a["bytes_per_request"].as_f64().is_some_and(|b| b > 0.0), "{a}");
    }
    assert!(a["baseline_bytes_per_request"].is_null(), "no baseline, no 0.1.7 saves");
    assert!(a["paced_ratio"].is_null(), "no baseline, no ratio");
    assert!(a["back_to_back"]["ours_ms"].as_f64().is_some_and(|t| t > 0.0), "{a}");
    assert!(a["back_to_back"]["baseline_ms"].is_null(), "no baseline, no 0.1.7 pass");
    // With the 0.1.7 design beside it: paced, index time and the final sync against 0.1.7's
    // total; back to back, a fresh index alone, then 0.1.7 alone.
    let out = replay(&["--trace", trace, "--requests", "200", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let both: serde_json::Value = serde_json::from_slice(&out.stdout).expect("replay JSON");
    let ms = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let want = (ms(&both["index"]["total_ms"]) + ms(&both["final_sync_ms"])) / ms(&both["baseline_0_1_7"]["total_ms"]);
    let got = ms(&both["paced_ratio"]);
    assert!(want > 0.0 && (got - want).abs() < 1e-6 * want, "paced_ratio {got}, by its definition {want}");
    let back = &both["back_to_back"];
    // The answers do not depend on commit timing: back to back, the same tokens routed warm and
    // the same entries left as paced.
    assert_eq!(back["warm_tokens"], both["warm_tokens"], "{back}");
    assert_eq!(back["entries"], both["entries"], "{back}");
    let ours = ms(&back["calls_ms"]) + ms(&back["final_sync_ms"]);
    assert!(ours > 0.0 && (ms(&back["ours_ms"]) - ours).abs() < 1e-6 * ours, "{back}");
    let want = ours / ms(&back["baseline_ms"]);
    assert!(want > 0.0 && (ms(&back["ratio"]) - want).abs() < 1e-6 * want, "{back}");
    for field in ["requests_per_s", "baseline_requests_per_s", "baseline_bytes_per_request"] {
        assert!(back[field].as_f64().is_some_and(|r| r > 0.0), "{field}: {back}");
    }
    if cfg!(target_os = "linux") {
        assert!(back["bytes_per_request"].as_f64().is_some_and(|b| b > 0.0), "{back}");
    }
    let out = replay(&["--trace", trace, "--requests", "50", "--json", "--no-back-to-back"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let only: serde_json::Value = serde_json::from_slice(&out.stdout).expect("replay JSON");
    assert!(only.get("back_to_back").is_none(), "{only}");
    // Three head threads: every request routed once, the same prompt tokens, throughput beside
    // 0.1.7's behind one mutex.
    let out = replay(&["--trace", trace, "--requests", "500", "--json", "--threads", "3"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let threaded: serde_json::Value = serde_json::from_slice(&out.stdout).expect("replay JSON");
    assert_eq!((threaded["requests"].as_u64(), threaded["threads"].as_u64()), (Some(500), Some(3)));
    assert!(threaded.get("back_to_back").is_none(), "threads replay once: {threaded}");
    assert_eq!(threaded["prompt_tokens"], a["prompt_tokens"]);
    let load: u64 = threaded["load"].as_array().map_or(0, |l| l.iter().filter_map(|v| v.as_u64()).sum());
    assert_eq!(Some(load), a["prompt_tokens"].as_u64(), "each request given to one node");
    assert!(threaded["warm_tokens"].as_u64().is_some_and(|w| w > 0), "{threaded}");
    for field in ["requests_per_s", "baseline_requests_per_s"] {
        assert!(threaded[field].as_f64().is_some_and(|r| r > 0.0), "{field}: {threaded}");
    }
    // Node caches, the index not told their size: with room for everything, all that was routed
    // warm is still cached; with little room, less is, and some requests went to a node that had
    // lost the prefix.
    let cached = |blocks: &str, more: &[&str]| -> serde_json::Value {
        let mut args =
            vec!["--trace", trace, "--requests", "500", "--json", "--no-baseline", "--node-cache-blocks", blocks];
        args.extend_from_slice(more);
        let out = replay(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("replay JSON")
    };
    let (roomy, tight) = (cached("1000000000", &["--no-index-cache"]), cached("256", &["--no-index-cache"]));
    assert_eq!(roomy["warm_share_cached"], roomy["warm_share"], "{roomy}");
    assert_eq!(roomy["warm_requests_not_cached"], 0);
    assert_eq!(tight["warm_share"], a["warm_share"], "the routing itself is unchanged");
    assert_eq!(tight["index_told_cache"], false);
    let (w, c) = (tight["warm_share"].as_f64().unwrap_or(0.0), tight["warm_share_cached"].as_f64().unwrap_or(1.0));
    assert!(c < w, "a cache of 256 blocks loses some of the warm prefixes: {tight}");
    assert!(tight["warm_requests_not_cached"].as_u64().is_some_and(|n| n > 0));
    assert!(a["warm_share_cached"].is_null(), "no caches, no figure");
    // Told the size, the index calls warm only what the chosen node still holds; its file
    // records each node's cache, and passes the library's check.
    let dir = tempdir();
    let told_db = dir.path().join("warm.redb");
    let told = cached("256", &["--db", told_db.to_str().expect("utf-8")]);
    assert_eq!(told["index_told_cache"], true);
    assert_eq!(told["warm_share_cached"], told["warm_share"], "{told}");
    assert_eq!(told["warm_requests_not_cached"], 0, "{told}");
    assert!(told["warm_share"].as_f64().is_some_and(|s| s > 0.0), "{told}");
    let snapshot = Snapshot::open(&told_db).expect("the replay's file");
    let stats = snapshot.stats().expect("stats");
    assert_eq!(stats.node_cache_default, Some(256));
    assert_eq!(stats.node_caches.len(), 8, "{stats:?}");
    for cache in &stats.node_caches {
        assert_eq!(cache.capacity, Some(256), "{cache:?}");
        // A prompt longer than the cache leaves nothing of it (its first blocks went first).
        assert!(cache.held <= 256, "{cache:?}");
        assert!(cache.floor > 0, "every node's cache let blocks go: {cache:?}");
    }
    assert!(stats.node_caches.iter().any(|c| c.held > 0), "{stats:?}");
    let check = snapshot.check().expect("checked");
    assert!(check.problems.is_empty(), "{check:?}");
    let both = replay(&["--requests", "10", "--threads", "2", "--node-cache-blocks", "64"]);
    assert_eq!(both.status.code(), Some(2), "node caches are simulated by one-thread replays only");
    assert!(text(&both.stderr).contains("--threads"), "{}", text(&both.stderr));
    let none = replay(&["--requests", "10", "--nodes", "0"]);
    assert_eq!(none.status.code(), Some(2), "a usage error");
    assert!(text(&none.stderr).contains("--nodes"), "{}", text(&none.stderr));
    let default = replay(&["--requests", "300"]);
    assert!(default.status.success(), "{}", text(&default.stderr));
    let mut needles =
        vec!["routed warm", "load per node", "index time/request", "ratio (ours/0.1.7)", "paced ", "back to back"];
    if cfg!(target_os = "linux") {
        needles.push("0.1.7 saving every");
    }
    for needle in needles {
        assert!(text(&default.stdout).contains(needle), "missing {needle:?}: {}", text(&default.stdout));
    }
}

/// `replay --restart-every`: told of each restart, the index never routes warm to a node that
/// lost the prefix; not told, it does. `--no-forget` without restarts is a usage error.
#[test]
fn replay_with_restarts_counts_warm_tokens_sent_to_a_restarted_node() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces/mooncake-conversation.jsonl");
    let once = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["--trace", trace, "--requests", "1500", "--json", "--no-baseline"];
        args.extend_from_slice(extra);
        let out = replay(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("replay JSON")
    };
    let told = once(&["--restart-every", "100"]);
    let not_told = once(&["--restart-every", "100", "--no-forget"]);
    assert_eq!(told["restarts"], 14);
    assert_eq!(told["warm_tokens_to_restarted"], 0, "{told}");
    assert!(told.get("back_to_back").is_none(), "restarts are a paced replay's only: {told}");
    assert!(not_told["warm_tokens_to_restarted"].as_u64().is_some_and(|t| t > 0), "{not_told}");
    let one = once(&["--nodes-per-prefix", "1"]);
    assert!(one["restarts"].is_null() && one["warm_tokens_to_restarted"].is_null());
    let bad = replay(&["--requests", "10", "--no-forget"]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
}

/// `replay --heads 3 --nats URL`: the heads sharing one view route more warm than three that
/// do not, every event reaches every head, and the lag is reported.
#[test]
fn replay_over_heads_sharing_through_nats() {
    let dir = tempdir();
    let server = nats::NatsServer::start(&dir.path().join("js"));
    let url = server.url();
    let out = replay(&["--heads", "3", "--nats", &url, "--requests", "600", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r = &json_lines(&out)[0];
    let share = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert_eq!((r["heads"].as_u64(), r["events"].as_u64(), r["requests"].as_u64()), (Some(3), Some(600), Some(600)));
    assert!(share("warm_share") > share("warm_share_unshared") + 0.05, "{r}");
    assert!(share("lag_p50_ms") > 0.0 && share("lag_p50_ms") <= share("lag_p99_ms"), "{r}");
    assert_eq!(r["lag_samples"].as_u64(), Some(1200), "each event on the two other heads");
    let out = replay(&["--heads", "2", "--nats", &url, "--requests", "300"]);
    assert!(text(&out.stdout).contains("with the heads sharing one view"), "{}", text(&out.stdout));
    assert!(!replay(&["--heads", "2"]).status.success(), "--heads needs --nats");
}

/// `replay --heads 3 --nats URL --engine-events`: heads sharing one view and heads alone, each
/// side over engines of its own that publish their KV events: each side claims about what its
/// engines held, every batch reaches every head once, and the lags and each side's resident
/// memory (its peak, the simulated engines' part, the rest per head) are reported.
#[test]
fn replay_over_heads_and_engines_sharing_through_nats() {
    let dir = tempdir();
    let server = nats::NatsServer::start(&dir.path().join("js"));
    let url = server.url();
    let args = ["--heads", "3", "--nats", &url, "--engine-events", "--engine-cache-blocks", "4096"];
    let out = replay(&[&args[..], &["--requests", "300", "--json"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r = &json_lines(&out)[0];
    assert_eq!((r["heads"].as_u64(), r["requests"].as_u64()), (Some(3), Some(300)));
    for side in ["shared", "unshared"] {
        let s = &r[side];
        let share = |k: &str| s[k].as_f64().unwrap_or_else(|| panic!("{k} in {s}"));
        assert!(share("claimed_share") > 0.0, "{side}: {s}");
        // A head may be a few batches behind its engines when it answers (more so on a busy
        // machine): what it claims then differs from what is held by what it has not applied.
        // Compared where it had applied every batch of the engine it chose, a claim another head
        // made may still outlive an eviction it has not applied yet: within a point.
        let settled = s["settled_requests"].as_u64().unwrap_or_else(|| panic!("settled_requests in {s}"));
        assert!(settled > 0, "{side}: no request found its head caught up: {s}");
        let (claimed, cached) = (share("settled_claimed_share"), share("settled_cached_share"));
        assert!((claimed - cached).abs() < 0.01, "{side}: claimed as held where caught up: {s}");
        assert!(claimed <= share("claimed_share") && cached <= share("cached_share"), "{side}: {s}");
        assert_eq!(s["batches_published"], s["batches_applied_per_head"], "{side}: every batch on every head once");
        assert!(share("engine_lag_p50_s") <= share("engine_lag_p99_s"), "{side}: {s}");
    }
    assert!(r["shared"]["stream_lag_p50_ms"].as_f64().is_some(), "{r}");
    assert!(r["unshared"]["stream_lag_p50_ms"].is_null(), "{r}");
    // Memory, where /proc tells it: a side's peak holds what came before the heads, its
    // engines, and its heads; each head within what a head following 8 engines may hold.
    if std::path::Path::new("/proc/self/status").exists() {
        let mib = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
        assert_eq!(mib(r, "head_cache_mib"), 32.0, "the replay's heads open with listen's page cache: {r}");
        let base = mib(r, "base_rss_mib");
        for side in ["shared", "unshared"] {
            let s = &r[side];
            let (peak, engines, per_head) = (mib(s, "peak_rss_mib"), mib(s, "engines_mib"), mib(s, "per_head_mib"));
            assert!(base > 0.0 && engines > 0.0 && per_head > 0.0, "{side}: {r}");
            assert!((peak - base - engines - 3.0 * per_head).abs() < 0.01, "{side}: the figures add up: {r}");
            assert!(per_head <= 256.0, "{side}: {per_head:.0} MiB a head: {r}");
        }
        assert_eq!(mib(r, "per_head_mib"), mib(&r["shared"], "per_head_mib").max(mib(&r["unshared"], "per_head_mib")));
    }
}

/// `replay --db` on an existing file never changes its capacity (which evicts for good) unless
/// `--resize` says so; refused, it says what it would evict and leaves the file as it was.
#[test]
fn replay_refuses_to_change_an_existing_files_capacity_unless_asked() {
    let dir = tempdir();
    let path = small_index(&dir, "e.redb", "100000");
    let p = path.to_str().expect("utf-8");
    let before = entries(&path);
    assert!(before > 1000, "{before}");
    let bytes = std::fs::read(&path).expect("read");
    let out = replay(&["--requests", "10", "--capacity", "10", "--no-baseline", "--db", p]);
    assert_eq!(out.status.code(), Some(2), "refused: {}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(said.contains("--resize") && said.contains("evicting at least"), "{said}");
    assert_eq!(std::fs::read(&path).expect("read"), bytes, "the file is byte for byte as it was");
    let cache = replay(&["--requests", "10", "--node-cache-blocks", "64", "--no-baseline", "--db", p]);
    assert_eq!(cache.status.code(), Some(2), "{}", text(&cache.stderr));
    // The same capacity, or none, is no change.
    let same = replay(&["--requests", "10", "--capacity", "100000", "--no-baseline", "--no-back-to-back", "--db", p]);
    assert!(same.status.success(), "{}", text(&same.stderr));
    assert!(entries(&path) >= before);
    let asked =
        replay(&["--requests", "10", "--capacity", "500", "--resize", "--no-baseline", "--no-back-to-back", "--db", p]);
    assert!(asked.status.success(), "{}", text(&asked.stderr));
    assert!(entries(&path) <= 500 + 200, "resized when asked");
}

/// Every replay option is checked up front: out of range is a usage error (exit 2) naming the
/// option; a request too long for memory is refused by its line.
#[test]
fn replay_options_and_trace_lines_are_checked_up_front() {
    for (option, value) in [
        ("--threads", "100000"),
        ("--min-share", "2"),
        ("--min-share", "NaN"),
        ("--vocab", "0"),
        ("--window", "0"),
        ("--capacity", "0"),
        ("--nodes", "0"),
        ("--requests", "0"),
        ("--nodes-per-prefix", "1000"),
    ] {
        let out = replay(&["--requests", "5", option, value]);
        assert_eq!(out.status.code(), Some(2), "{option} {value}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains(option), "{option}: {}", text(&out.stderr));
    }
    let dir = tempdir();
    let trace = dir.path().join("huge.jsonl");
    let ok = r#"{"timestamp":0,"input_length":600,"output_length":1,"hash_ids":[1,2]}"#;
    let huge = format!(
        r#"{{"timestamp":1,"input_length":4294967295,"output_length":1,"hash_ids":[{}]}}"#,
        "7,".repeat(9) + "7"
    );
    std::fs::write(&trace, format!("{ok}\n{huge}\n")).expect("write");
    let started = Instant::now();
    let out = replay(&["--trace", trace.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("trace line 2") && text(&out.stderr).contains("4294967295"),
        "{}",
        text(&out.stderr)
    );
    assert!(started.elapsed() < Duration::from_secs(60), "refused, not allocated");
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").expect("write");
    let out = replay(&["--trace", empty.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains("no request"), "{}", text(&out.stderr));
}

/// The replay's report reads as a report: a one-line summary, what was replayed (as many
/// requests as asked, of the built-in workload too), numbers with separators, 0.1.7 explained.
#[test]
fn the_replay_report_says_what_it_found_in_plain_words() {
    let out = replay(&["--requests", "2000", "--no-back-to-back"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report = text(&out.stdout);
    let first = report.lines().next().unwrap_or_default();
    assert!(first.contains("of prompt tokens routed to a node that already held them warm"), "{report}");
    assert!(report.contains("Replayed 2,000 requests"), "{report}");
    assert!(!report.contains("3000") && !report.contains("3,000"), "{report}");
    assert!(report.contains("0.1.7 = superfluid 0.1.7's design"), "{report}");
    assert!(report.contains("--json"), "{report}");
    let big = report.split_whitespace().filter(|w| w.chars().all(|c| c.is_ascii_digit()) && w.len() > 4).count();
    assert_eq!(big, 0, "big numbers have separators: {report}");
    let more = replay(&["--requests", "4000", "--json", "--no-baseline", "--no-back-to-back"]);
    let r: serde_json::Value = serde_json::from_slice(&more.stdout).expect("JSON");
    assert_eq!(r["requests"], 4000, "the built-in workload makes as many requests as asked");
}

/// `replay --engine-events`: engines publish vLLM's events over loopback ZMQ, the index claims
/// what they hold (never warm on what only a restarted engine's old process held, once the
/// restart is seen), and the same events are applied again back to back.
#[test]
fn replay_over_engines_that_publish_their_kv_events() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces/mooncake-conversation.jsonl");
    let args = ["--trace", trace, "--requests", "600", "--json", "--engine-events", "--engine-cache-blocks"];
    let out = replay(&[&args[..], &["4096", "--restart-every", "100"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("replay JSON");
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    assert_eq!(r["requests"], 600);
    assert_eq!(r["restarts"], 5);
    assert!(f("claimed_share") > 0.01 && f("cached_share") > 0.01, "{r}");
    assert!((f("claimed_share") - f("cached_share")).abs() < 0.01, "claims follow the engines: {r}");
    assert_eq!(r["warm_to_restarted_seen"], 0, "{r}");
    assert!(f("block_events") > 1000.0 && f("ingest_events_per_s") > 0.0, "{r}");
    let bad = replay(&["--engine-events", "--threads", "2"]);
    assert!(!bad.status.success(), "--engine-events and --threads do not go together");
}
