//! The binary on real files: live dump beside a writing process, crashed and corrupt files,
//! JSON output. (The `replay` binary's tests are the harness's: `benches/harness/tests`.)

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use superfluid_warm::ReadIndex;

use common::{bin, db_path, tempdir, torture_writer};

fn run(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("the binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Starts a writer process and waits until it has made `n` syncs durable.
fn writer(path: &Path, n: u64) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(torture_writer())
        .args(["--db", path.to_str().expect("utf-8 path"), "--capacity", "2048"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("writer starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    let mut seen = 0;
    while seen < n {
        line.clear();
        assert!(lines.read_line(&mut line).expect("read") > 0, "writer ended early");
        seen += 1;
    }
    (child, lines)
}

fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    text(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect()
}

#[test]
fn dump_reads_the_file_while_another_process_writes_it_then_reports_the_crash() {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    let (mut child, _lines) = writer(&path, 20);
    let mut counts = Vec::new();
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until || counts.len() < 5 {
        let out = run(&["dump", p, "--json"]);
        assert!(out.status.success(), "dump while writing: {}", text(&out.stderr));
        let rows = json_lines(&out);
        assert!(!rows.is_empty());
        let clocks: Vec<u64> = rows.iter().map(|r| r["clock"].as_u64().expect("clock")).collect();
        assert!(clocks.windows(2).all(|w| w[0] >= w[1]), "newest first");
        assert!(rows.iter().all(|r| r["node"].as_str().is_some_and(|n| n.starts_with("node-"))));
        assert!(rows.iter().all(|r| r["model"] == "torture" && r["tokens"].as_u64().is_some_and(|t| t % 64 == 0)));
        counts.push(clocks[0]);
        let limited = run(&["dump", p, "--json", "--node", "node-1", "--limit", "3"]);
        let limited = json_lines(&limited);
        assert!(limited.len() <= 3 && limited.iter().all(|r| r["node"] == "node-1"));
    }
    assert!(counts.windows(2).any(|w| w[1] > w[0]), "the dumps followed the writer's commits: {counts:?}");
    let stats = run(&["stats", p, "--json"]);
    assert!(stats.status.success(), "{}", text(&stats.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).expect("stats JSON");
    assert!(stats["entries"].as_u64().is_some_and(|e| e > 0 && e <= 2048), "{stats}");
    assert!(stats["writer_pid"].as_u64().is_some());

    child.kill().expect("SIGKILL the writer");
    child.wait().expect("reaped");
    let out = run(&["dump", p]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a crashed file is a problem found (as `check` exits), not an empty listing"
    );
    assert!(text(&out.stderr).contains("crashed"), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("panicked"));
    assert!(text(&out.stderr).contains("check --repair"), "says what to run: {}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("Builder"), "speaks the CLI's words: {}", text(&out.stderr));
    let check = run(&["check", p, "--json"]);
    let verdict: serde_json::Value = serde_json::from_slice(&check.stdout).expect("check JSON");
    assert_eq!(verdict["crashed_writer"], true, "{verdict}");
    assert_eq!(verdict["integrity"], true, "{verdict}");
    assert_eq!(check.status.code(), Some(2), "a crashed head's file needs recovery before it is read: {verdict}");
    assert_eq!(verdict["healthy"], false, "{verdict}");
    assert!(verdict["problems"][0].as_str().is_some_and(|p| p.contains("needs recovery")), "{verdict}");
    assert_eq!(
        verdict["invariant_problems"].as_array().map(Vec::len),
        Some(0),
        "a crash loses no consistency: the last commit is consistent: {verdict}"
    );
    let repaired = run(&["check", p, "--repair"]);
    assert!(repaired.status.success(), "{}{}", text(&repaired.stdout), text(&repaired.stderr));
    assert!(text(&repaired.stdout).contains("redb integrity: ok"));
    assert!(
        text(&repaired.stderr).contains("recovered"),
        "a writing command says it recovered: {}",
        text(&repaired.stderr)
    );
    let out = run(&["dump", p, "--limit", "5"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("5 entries shown"), "{}", text(&out.stdout));
}

#[test]
fn corrupt_and_foreign_files_get_a_clear_error_never_a_panic() {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    let (mut child, _lines) = writer(&path, 30);
    child.kill().expect("kill");
    child.wait().expect("reaped");
    assert!(run(&["check", p, "--repair"]).status.success());
    let healthy = run(&["check", p]);
    assert_eq!(healthy.status.code(), Some(0), "{}", text(&healthy.stdout));

    // Flip one byte inside the data pages (past redb's header region). The repair closed the file
    // cleanly, so it has a seal: each flipped copy gets that seal and the file's time too, so
    // only the seal's digest tells them apart.
    let mut bytes = std::fs::read(&path).expect("read");
    let seal = std::fs::read(superfluid_warm::IndexFile::new(&path).seal_path()).expect("the repaired file is sealed");
    let modified = std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime");
    let len = bytes.len();
    let mut flipped_detected = 0;
    // Forty-eight places spread over the file: how much of it is live pages depends on how far the
    // writer got before the kill (often about a fifth), so a few fixed places can all land in free
    // pages (sixteen did in about one run in thirty).
    let places = 48;
    for (i, at) in (1..=places).map(|k| k * len / (places + 1)).enumerate() {
        let mut copy = bytes.clone();
        copy[at] ^= 0x10;
        let bad = dir.path().join(format!("bad-{i}.redb"));
        std::fs::write(&bad, &copy).expect("write");
        std::fs::File::options().write(true).open(&bad).and_then(|f| f.set_modified(modified)).expect("time");
        std::fs::write(superfluid_warm::IndexFile::new(&bad).seal_path(), &seal).expect("seal");
        let b = bad.to_str().expect("utf-8");
        let mut flagged = false;
        for args in [vec!["check", b], vec!["dump", b], vec!["stats", b, "--json"]] {
            let out = run(&args);
            assert_ne!(out.status.code(), Some(101), "{args:?} panicked: {}", text(&out.stderr));
            assert!(!text(&out.stderr).contains("panicked"), "{args:?}: {}", text(&out.stderr));
            if args[0] == "check" {
                flagged = out.status.code() == Some(2);
                flipped_detected += usize::from(flagged);
                if flagged {
                    let json = run(&["check", b, "--json"]);
                    let verdict: serde_json::Value = serde_json::from_slice(&json.stdout).expect("check JSON");
                    assert_eq!(verdict["healthy"], false, "{verdict}");
                    assert!(
                        verdict["problems"].as_array().is_some_and(|p| !p.is_empty()),
                        "each problem listed: {verdict}"
                    );
                }
            } else if flagged {
                assert!(!out.status.success(), "{args:?} showed a file check found corrupted");
            }
        }
    }
    println!("check flagged {flipped_detected} of {places} flipped files");
    // A byte in an unused page can flip harmlessly; most land in a tree page and must be caught.
    assert!(flipped_detected >= 1);

    let foreign = dir.path().join("foreign.redb");
    bytes.truncate(0);
    bytes.extend_from_slice(b"{\"prefixes\": []}");
    std::fs::write(&foreign, &bytes).expect("write");
    let out = run(&["dump", foreign.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("not an index"), "{}", text(&out.stderr));
    let missing = run(&["stats", dir.path().join("absent.redb").to_str().expect("utf-8")]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(!dir.path().join("absent.redb").exists(), "a read-only command never creates a file");
}

#[test]
fn import_from_the_command_line_then_dump_shows_the_old_entries() {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    let old = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0001-from-0.1.7-json/warm.json");
    let out = run(&["import", old, p]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("imported "), "{}", text(&out.stdout));
    let again = run(&["import", old, p]);
    assert!(text(&again.stdout).contains("imported before"));
    let rows = json_lines(&run(&["dump", p, "--json"]));
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(old).expect("fixture")).expect("json");
    assert_eq!(rows.len(), json["prefixes"].as_array().map_or(0, Vec::len));
    assert!(rows.iter().all(|r| r["legacy"] == true && r["tokens"].is_null()));
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").expect("write");
    let out = run(&["import", bad.to_str().expect("utf-8"), p]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("cannot import"), "{}", text(&out.stderr));
    assert_eq!(json_lines(&run(&["dump", p, "--json"])).len(), rows.len(), "the file it had is kept whole");
    // Into a path that did not exist, a failed import leaves nothing behind.
    let fresh = dir.path().join("fresh.redb");
    let out = run(&["import", bad.to_str().expect("utf-8"), fresh.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!fresh.exists(), "no new file");
    assert!(!superfluid_warm::IndexFile::new(&fresh).seal_path().exists(), "no side file");
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("list").count(),
        3,
        "warm.redb, its seal and bad.json, nothing new"
    );
}

/// `compact` shrinks a churned file and leaves its entries as they were; it refuses a file a
/// head has open, and a file that is not an index.
#[test]
fn compact_gives_space_back_and_keeps_every_entry() {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    {
        // Churned, and not compacted by its close.
        let warm = superfluid_warm::Warm::builder().capacity(4000).compact_on_close(false).open(&path).expect("open");
        for request in harness::trace::synthetic(600, 24, 7) {
            warm.ran("m", &request.tokens(), &format!("node-{}", request.timestamp % 5)).expect("ran");
        }
        warm.close().expect("close");
    }
    let dump = |p: &str| -> Vec<serde_json::Value> {
        let mut rows = json_lines(&run(&["dump", p, "--json"]));
        rows.sort_by_key(|r| r.to_string());
        rows
    };
    let before = dump(p);
    assert!(before.len() > 1000, "{} entries", before.len());
    let out = run(&["compact", p]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    let sizes: Vec<u64> = said.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    assert_eq!(sizes.len(), 2, "{said}");
    assert!(sizes[1] < sizes[0], "the churned file shrank: {said}");
    assert_eq!(std::fs::metadata(&path).expect("file").len(), sizes[1]);
    assert!(dump(p) == before, "compaction changed the entries");
    assert!(run(&["check", p]).status.success());
    // Verified and closed cleanly by the compaction: sealed, so the next open is the fast one.
    let warm = superfluid_warm::Warm::open(&path).expect("open");
    assert_eq!(warm.stats().expect("stats").open_check, superfluid_warm::OpenCheck::Seal);
    warm.close().expect("close");

    let (mut child, _lines) = writer(&path, 3);
    let busy = run(&["compact", p]);
    assert!(!busy.status.success(), "a file a head has open is refused");
    assert!(text(&busy.stderr).contains("open"), "{}", text(&busy.stderr));
    child.kill().expect("kill");
    child.wait().expect("reaped");
    let text_file = dir.path().join("notes.redb");
    std::fs::write(&text_file, "not an index ".repeat(500)).expect("write");
    let foreign = run(&["compact", text_file.to_str().expect("utf-8")]);
    assert!(!foreign.status.success());
    assert_eq!(std::fs::read(&text_file).expect("read"), "not an index ".repeat(500).as_bytes(), "left as it is");
}

/// `forget` on a closed file: the node's prefixes are no longer answered, durably; a missing
/// file is an error and is not created.
#[test]
fn forget_drops_a_node_from_every_answer_and_never_creates_a_file() -> Result<(), superfluid_warm::Error> {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let prompt: Vec<u32> = (0..640).collect();
    {
        let warm = superfluid_warm::Warm::open(&path)?;
        warm.ran("m", &prompt[..320], "a")?;
        warm.ran("m", &prompt, "b")?;
        warm.close()?;
    }
    let out = run(&["forget", path.to_str().expect("utf-8 path"), "b"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("node b of"), "{}", String::from_utf8_lossy(&out.stdout));
    let warm = superfluid_warm::Warm::open(&path)?;
    let hit = warm.warmest("m", &prompt)?;
    assert_eq!(hit, Some(superfluid_warm::Hit::new("a", 320)), "b forgotten, a still warm");
    drop(warm);
    let missing = dir.path().join("missing.redb");
    let out = run(&["forget", missing.to_str().expect("utf-8 path"), "a"]);
    assert!(!out.status.success());
    assert!(!missing.exists(), "a typo must not create an index");
    Ok(())
}

/// `dump` lists every node of a block and marks a forgotten one; `stats` counts the other nodes
/// and what is reclaimable.
#[test]
fn dump_and_stats_show_every_node_of_a_block_and_what_forgetting_left() -> Result<(), superfluid_warm::Error> {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let first: Vec<u32> = (0..320).collect();
    let mut moved = first.clone();
    moved.extend(5000..5128);
    {
        let warm = superfluid_warm::Warm::open(&path)?;
        warm.ran("m", &first, "a")?;
        warm.ran("m", &moved, "b")?;
        warm.forget_node("a")?;
        warm.close()?;
    }
    let p = path.to_str().expect("utf-8 path");
    let out = run(&["dump", p, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> =
        text(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("a dump line")).collect();
    assert_eq!(rows.len(), 7, "7 blocks");
    let with_a: Vec<&serde_json::Value> =
        rows.iter().filter(|r| r["others"].as_array().is_some_and(|o| !o.is_empty())).collect();
    assert_eq!(with_a.len(), 5, "a ran the first 5 blocks before b");
    for r in &with_a {
        assert_eq!(r["node"], "b");
        assert_eq!(r["others"][0]["node"], "a");
        assert_eq!(r["others"][0]["forgotten"], true);
    }
    let out = run(&["dump", p]);
    assert!(text(&out.stdout).contains("a (forgotten)@"), "{}", text(&out.stdout));
    let out = run(&["stats", p, "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats JSON");
    assert_eq!((stats["entries"].as_u64(), stats["others"].as_u64()), (Some(7), Some(5)));
    assert_eq!((stats["reclaimable"].as_u64(), stats["forgotten_nodes"].as_u64()), (Some(5), Some(1)));
    let out = run(&["check", p]);
    assert!(out.status.success(), "{}", text(&out.stdout));
    Ok(())
}

/// A closed index of a few thousand entries: 200 turns of 40 conversations over 8 nodes.
fn small_index(dir: &tempfile::TempDir, name: &str) -> std::path::PathBuf {
    let path = dir.path().join(name);
    let warm = superfluid_warm::Warm::open(&path).expect("open");
    let mut conversations = common::Conversations::new(40);
    let mut rng = common::Rng(7);
    for i in 0..200 {
        let (model, prompt) = conversations.turn(&mut rng);
        warm.ran(model, &prompt, &format!("node-{}", i % 8)).expect("ran");
    }
    warm.close().expect("close");
    path
}

/// A side file that says a head wrote the index, beside no index or an empty one: the index was
/// lost, and nothing silently starts a new one there.
#[test]
fn a_lost_index_beside_its_seal_is_refused_never_replaced() {
    let dir = tempdir();
    let path = small_index(&dir, "lost.redb");
    let p = path.to_str().expect("utf-8");
    std::fs::File::create(&path).expect("truncate to 0 bytes");
    let repair = run(&["check", "--repair", p]);
    assert!(!repair.status.success() && text(&repair.stderr).contains("was lost"), "{}", text(&repair.stderr));
    assert_eq!(std::fs::metadata(&path).expect("still there").len(), 0, "nothing created in its place");
    std::fs::remove_file(&path).expect("remove");
    let out = run(&["import", concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0001-from-0.1.7-json/warm.json"), p]);
    assert!(text(&out.stderr).contains("was lost"), "{}", text(&out.stderr));
    assert!(!path.exists(), "a missing index stays missing");
    assert!(superfluid_warm::IndexFile::new(&path).seal_path().exists(), "its side file is kept");
    let lib = superfluid_warm::Warm::open(&path);
    assert!(matches!(lib, Err(superfluid_warm::Error::FileLost { .. })), "{lib:?}");
}

/// `check --repair` of a path with no file says so, and creates nothing.
#[test]
fn check_repair_of_a_missing_file_creates_nothing() {
    let dir = tempdir();
    let missing = dir.path().join("missing.redb");
    let out = run(&["check", "--repair", missing.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("no index file here"), "{}", text(&out.stderr));
    assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 0, "nothing created");
}

/// A failed import removes only what it created: a symlink that was there stays, dangling or
/// looping; a bad file onto an index leaves it byte for byte; clocks that leave no room are
/// refused.
#[cfg(unix)]
#[test]
fn a_failed_import_removes_only_what_it_created() {
    let dir = tempdir();
    let good = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0001-from-0.1.7-json/warm.json");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").expect("write");
    let b = bad.to_str().expect("utf-8");
    let dangling = dir.path().join("dangling.redb");
    std::os::unix::fs::symlink(dir.path().join("target.redb"), &dangling).expect("symlink");
    let out = run(&["import", b, dangling.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(std::fs::symlink_metadata(&dangling).is_ok(), "the dangling symlink is still there");
    assert!(!superfluid_warm::IndexFile::new(&dangling).seal_path().exists(), "and no side file beside it");
    // A chain of dangling links: the links stay, whatever the import.
    let chain = dir.path().join("chain.redb");
    std::os::unix::fs::symlink(&dangling, &chain).expect("symlink to a symlink");
    let out = run(&["import", b, chain.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        std::fs::symlink_metadata(&chain).is_ok() && std::fs::symlink_metadata(&dangling).is_ok(),
        "both links kept"
    );
    let looping = dir.path().join("loop.redb");
    std::os::unix::fs::symlink(&looping, &looping).expect("symlink loop");
    for old in [b, good] {
        let out = run(&["import", old, looping.to_str().expect("utf-8")]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        assert!(std::fs::symlink_metadata(&looping).is_ok(), "the looping symlink is still there");
    }
    // Through a dangling symlink a good import creates its target; a failing one leaves none.
    let out = run(&["import", good, dangling.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(dir.path().join("target.redb").is_file());

    let index = small_index(&dir, "kept.redb");
    let (bytes, seal) = (
        std::fs::read(&index).expect("read"),
        std::fs::read(superfluid_warm::IndexFile::new(&index).seal_path()).expect("seal"),
    );
    let wraps = dir.path().join("wraps.json");
    std::fs::write(&wraps, r#"{"prefixes":[[1,"n",18446744073709551615],[2,"n",3]]}"#).expect("write");
    for old in [b, wraps.to_str().expect("utf-8")] {
        let out = run(&["import", old, index.to_str().expect("utf-8")]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
        assert!(text(&out.stderr).contains("cannot import"), "{}", text(&out.stderr));
        assert_eq!(std::fs::read(&index).expect("read"), bytes, "the index is byte for byte as it was");
        assert_eq!(
            std::fs::read(superfluid_warm::IndexFile::new(&index).seal_path()).expect("seal"),
            seal,
            "and its seal"
        );
    }
    let err = superfluid_warm::LegacyJson::read(&wraps).expect_err("a clock with no room after it");
    assert!(err.to_string().contains("clock 18446744073709551615"), "{err}");
}

/// Commands that fail on a path that is not an index leave no side file, and name the user's
/// path; `compact` of a missing file speaks as the other commands do.
#[test]
fn failed_commands_leave_no_files_and_name_the_users_path() {
    let dir = tempdir();
    let notes = dir.path().join("text.redb");
    std::fs::write(&notes, "plain text, not an index").expect("write");
    let n = notes.to_str().expect("utf-8");
    let good = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0001-from-0.1.7-json/warm.json");
    for args in [vec!["compact", n], vec!["import", good, n], vec!["compact", dir.path().to_str().expect("utf-8")]] {
        let out = run(&args);
        assert!(!out.status.success(), "{args:?}");
        assert!(!text(&out.stderr).contains("panicked"), "{args:?}: {}", text(&out.stderr));
    }
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["text.redb".to_string()], "no side file left behind");
    let missing = run(&["compact", dir.path().join("missing.redb").to_str().expect("utf-8")]);
    assert!(text(&missing.stderr).contains("no index file here"), "{}", text(&missing.stderr));
    let nowhere = dir.path().join("no/such/dir/x.redb");
    let out = run(&["import", good, nowhere.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("x.redb: its folder does not exist"), "{}", text(&out.stderr));
    if cfg!(unix) {
        let out = run(&["compact", "/dev/null"]);
        assert!(text(&out.stderr).contains("not a regular file"), "{}", text(&out.stderr));
    }
}

/// `forget` of a node the file does not name changes nothing, not even the schema; one that
/// upgrades says so.
#[test]
fn forget_of_an_unknown_node_never_upgrades_the_file() {
    let dir = tempdir();
    let path = dir.path().join("v2.redb");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0003-tree-chain/warm-v2.redb"), &path)
        .expect("copy the schema 2 fixture");
    let p = path.to_str().expect("utf-8");
    let bytes = std::fs::read(&path).expect("read");
    let out = run(&["forget", p, "node-x"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("not known"), "{}", text(&out.stdout));
    assert_eq!(std::fs::read(&path).expect("read"), bytes, "unchanged, still schema 2");
    let out = run(&["forget", p, "node-1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("forgotten"), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("upgraded") && text(&out.stderr).contains("from schema 2"),
        "{}",
        text(&out.stderr)
    );
}

/// A file a crashed head left: the commands that write recover it and say so.
#[test]
fn writing_commands_recover_a_crashed_heads_file_and_say_so() {
    let dir = tempdir();
    for command in ["compact", "forget"] {
        let path = dir.path().join(format!("{command}.redb"));
        let p = path.to_str().expect("utf-8");
        let (mut child, _lines) = writer(&path, 5);
        child.kill().expect("kill");
        child.wait().expect("reaped");
        let out = if command == "forget" { run(&["forget", p, "node-1"]) } else { run(&["compact", p]) };
        assert!(out.status.success(), "{command}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains("recovered"), "{command}: {}", text(&out.stderr));
        assert_eq!(run(&["check", p]).status.code(), Some(0), "{command} left it healthy");
    }
}

/// The side file of a running head deleted: readers still see a live head (not a crash), and
/// `check` says what went wrong.
#[test]
fn a_deleted_side_file_of_a_running_head_is_detected() -> Result<(), superfluid_warm::Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    let warm = superfluid_warm::Warm::builder().sync_window(Duration::ZERO).open(&path)?;
    warm.ran("m", &(0..640).collect::<Vec<u32>>(), "a")?;
    std::fs::remove_file(superfluid_warm::IndexFile::new(&path).seal_path()).expect("delete the side file");
    let stats = run(&["stats", p, "--json"]);
    assert!(stats.status.success(), "a live head, not a crash: {}", text(&stats.stderr));
    let s: serde_json::Value = serde_json::from_slice(&stats.stdout).expect("stats JSON");
    assert_eq!(s["side_file_missing"], true, "{s}");
    assert_eq!(s["entries"], 10);
    assert!(run(&["dump", p]).status.success());
    let check = run(&["check", p]);
    assert_eq!(check.status.code(), Some(2), "{}", text(&check.stdout));
    assert!(text(&check.stdout).contains("side file"), "{}", text(&check.stdout));
    warm.close()?;
    assert_eq!(run(&["check", p]).status.code(), Some(0), "closed cleanly: sealed again");
    Ok(())
}

/// `dump` as a pipeline's first command: a reader that stops early ends it quietly; `--limit 0`
/// shows nothing; the table streams, with its columns in line; an unknown node is an error with
/// the file's nodes named.
#[test]
fn dump_behaves_in_a_pipeline_and_its_table_lines_up() -> Result<(), superfluid_warm::Error> {
    let dir = tempdir();
    let path = small_index(&dir, "many.redb");
    let p = path.to_str().expect("utf-8");
    for args in [vec!["dump", p], vec!["dump", p, "--json"], vec!["stats", p]] {
        let mut child =
            Command::new(bin()).args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("runs");
        let mut first = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut first).expect("a line");
        // The reader goes away (`| head -1`).
        let out = child.wait_with_output().expect("ends");
        assert!(!first.is_empty());
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out.stderr));
        assert!(out.stderr.is_empty(), "{args:?} quiet: {}", text(&out.stderr));
    }
    let none = run(&["dump", p, "--limit", "0"]);
    assert!(text(&none.stdout).ends_with("0 entries shown\n"), "{}", text(&none.stdout));
    assert_eq!(text(&none.stdout).lines().count(), 2, "the header and the count: {}", text(&none.stdout));
    let one = run(&["dump", p, "--limit", "1"]);
    assert!(text(&one.stdout).ends_with("1 entry shown\n"), "{}", text(&one.stdout));
    let unknown = run(&["dump", p, "--node", "nobody"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(text(&unknown.stderr).contains("node-0"), "names the file's nodes: {}", text(&unknown.stderr));
    // A forgotten node's mark fits its column.
    let forgotten = dir.path().join("forgotten.redb");
    {
        let warm = superfluid_warm::Warm::open(&forgotten)?;
        warm.ran("m", &(0..320).collect::<Vec<u32>>(), "node-3")?;
        warm.forget_node("node-3")?;
        warm.ran("m", &(1000..1320).collect::<Vec<u32>>(), "b")?;
        warm.close()?;
    }
    let table = run(&["dump", forgotten.to_str().expect("utf-8")]);
    let table = text(&table.stdout);
    let lines: Vec<&str> = table.lines().collect();
    let clock_end = |l: &str| l.find("clock").map(|i| i + 5);
    let header_end = clock_end(lines[0]).expect("a clock column");
    for row in &lines[1..lines.len() - 1] {
        let digits_end = row[..header_end].trim_end().len();
        assert_eq!(digits_end, header_end, "columns in line:\n{}", lines.join("\n"));
    }
    Ok(())
}

/// `ask` answers `warm_nodes` from a file's last commit, the same as the head that wrote it: on
/// a closed file, and on one a head has open (its committed changes), engine streams included.
#[test]
fn ask_answers_from_the_last_commit_of_a_closed_or_live_file() -> Result<(), superfluid_warm::Error> {
    use harness::engine_sim::SimEngine;
    use superfluid_warm::{ReadIndex, Warm};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ask.redb");
    let prompts: Vec<Vec<u32>> = (0..6u32).map(|c| (0..64 * (3 + c)).map(|t| c * 100_000 + t).collect()).collect();
    let file = dir.path().join("prompts.jsonl");
    let lines: Vec<String> = prompts.iter().map(|p| serde_json::to_string(p).expect("json")).collect();
    std::fs::write(&file, lines.join("\n") + "\n[1, 2, 3]\n").expect("prompts");
    let warm = Warm::open(&path)?;
    for (i, p) in prompts.iter().enumerate().take(4) {
        warm.ran("m", p, &format!("node-{}", i % 2))?;
    }
    // gpu-0's engine holds the last two prompts.
    let mut engine = SimEngine::new(16, 1 << 16, "m", None)?;
    for p in &prompts[4..] {
        warm.engine_batch("gpu-0", &engine.run(p))?;
    }
    warm.sync()?;
    let want: Vec<Vec<superfluid_warm::Hit>> =
        prompts.iter().map(|p| warm.warm_nodes("m", p)).collect::<Result<_, _>>()?;
    assert_eq!(want[5].first().map(|h| h.node.as_str()), Some("gpu-0"), "{want:?}");
    let ask = |what: &str| -> Vec<serde_json::Value> {
        let out = run(&[
            "ask",
            path.to_str().expect("utf-8"),
            "--model",
            "m",
            "--prompts",
            file.to_str().expect("utf-8"),
            "--json",
        ]);
        assert!(out.status.success(), "{what}: {}", text(&out.stderr));
        json_lines(&out)
    };
    let check = |lines: &[serde_json::Value], what: &str| {
        assert_eq!(lines.len(), 7, "{what}");
        for (line, want) in lines.iter().zip(&want) {
            let got: Vec<(String, u64)> = line["warm_nodes"]
                .as_array()
                .expect("warm nodes")
                .iter()
                .map(|h| (h["node"].as_str().unwrap_or_default().to_string(), h["tokens"].as_u64().unwrap_or(0)))
                .collect();
            let want: Vec<(String, u64)> = want.iter().map(|h| (h.node.clone(), h.tokens as u64)).collect();
            assert_eq!(got, want, "{what}: line {}", line["line"]);
        }
        assert_eq!(lines[6]["warm_nodes"], serde_json::json!([]), "a prompt under two blocks");
    };
    check(&ask("live"), "live");
    // gpu-1's engine alone holds a prompt of model `e`: a model is known by its engine blocks too.
    let mut other = SimEngine::new(16, 1 << 16, "e", None)?;
    warm.engine_batch("gpu-1", &other.run(&prompts[0]))?;
    warm.close()?;
    check(&ask("closed"), "closed");
    // A prompt warm nowhere of a model the file holds is not a typo; one of a model it never
    // held is told so, naming the models it has.
    let asked = |model: &str| {
        let p = path.to_str().expect("utf-8");
        let out = run(&["ask", p, "--model", model, "--prompts", file.to_str().expect("utf-8")]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stderr)
    };
    assert_eq!(asked("m"), "", "a known model");
    assert_eq!(asked("e"), "", "a model only an engine holds");
    let typo = asked("mm");
    assert!(typo.contains("holds no block of model `mm`") && typo.contains("its models: e, m"), "{typo}");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "[1, -2]\n").expect("bad prompts");
    let out = run(&["ask", path.to_str().expect("utf-8"), "--model", "m", "--prompts", bad.to_str().expect("utf-8")]);
    assert!(!out.status.success() && text(&out.stderr).contains("line 1"), "{}", text(&out.stderr));
    Ok(())
}

/// Readers (`stats`, `check`, `ask`) racing a `listen` that creates a new file: while the head
/// has not finished making it, they say it is being created and to retry, never that it is not
/// an index (which told operators to start another file); `check` does not call it a problem.
#[test]
fn readers_racing_a_new_file_are_told_it_is_being_created() {
    let dir = tempdir();
    let path = dir.path().join("new.redb");
    let p = path.to_str().expect("utf-8").to_string();
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(&prompts, "[1, 2, 3]\n").expect("prompts");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
    let (mut being_created, mut read) = (0, 0);
    for round in 0..12 {
        for f in [path.clone(), dir.path().join("new.redb.seal"), dir.path().join("new.redb.listen.json")] {
            let _ = std::fs::remove_file(f);
        }
        let mut listen = common::Reaped(
            Command::new(bin())
                .args(["listen", &p, "--engine", &format!("gpu-0=tcp://127.0.0.1:{port}"), "--model", "m"])
                .args(["--status-every", "0"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn listen"),
        );
        let status = dir.path().join("new.redb.listen.json");
        let started = Instant::now();
        let mut rounds = 0;
        // Until the head has made the file and listens (and a few reads after).
        while rounds < 3 || !status.exists() {
            assert!(started.elapsed() < Duration::from_secs(60), "listen did not start");
            let reads = [
                ("stats", vec!["stats", &p, "--json"]),
                ("check", vec!["check", &p]),
                ("ask", vec!["ask", &p, "--model", "m", "--prompts", prompts.to_str().expect("utf-8")]),
            ];
            for (what, args) in &reads {
                let out = run(args);
                let err = text(&out.stderr);
                assert!(
                    !err.contains("not an index this build can open") && !err.contains("start a new index"),
                    "round {round}: {what} racing a new file: {err}"
                );
                if err.contains("being created") {
                    being_created += 1;
                    assert!(err.contains("retry"), "{what}: says to retry: {err}");
                    assert_eq!(out.status.code(), Some(1), "{what}: not a problem found: {err}");
                } else if out.status.success() {
                    read += 1;
                }
            }
            if status.exists() {
                rounds += 1;
            }
        }
        let term = Command::new("kill").arg("-TERM").arg(listen.0.id().to_string()).status().expect("kill");
        assert!(term.success());
        assert!(listen.0.wait().expect("listen ends").success());
    }
    println!("{being_created} reads found the file being created, {read} read it");
    assert!(read > 0, "the readers read the file once made");
}

/// `stats` and a live `dump` read a sharing head's file as any other, with its stream position.
#[test]
fn stats_and_a_live_dump_of_a_sharing_heads_file() {
    let dir = tempdir();
    let server = common::nats::NatsServer::start(&dir.path().join("js"));
    let url = server.url();
    let path = dir.path().join("shared.redb");
    let mut builder = superfluid_warm::Warm::builder();
    builder.sync_window(Duration::from_millis(5));
    let head = superfluid_warm::SharedWarm::open(&builder, &path, superfluid_warm::Sharing::nats(&url, "cli", "a"))
        .expect("a sharing head");
    for i in 0..40u32 {
        let tokens: Vec<u32> = (0..64 * (2 + i % 5)).map(|t| t + 1_000 * i).collect();
        head.ran("m", &tokens, &format!("node-{}", i % 3)).expect("ran");
    }
    common::nats::published(&head);
    assert!(head.wait_applied(40, Duration::from_secs(30)));
    common::nats::published(&head);
    let live = run(&["dump", path.to_str().expect("utf-8"), "--json"]);
    assert!(live.status.success(), "{}", text(&live.stderr));
    assert!(!json_lines(&live).is_empty(), "a live dump of a sharing head's file");
    head.close().expect("close");
    let stats = run(&["stats", path.to_str().expect("utf-8"), "--json"]);
    assert!(stats.status.success(), "{}", text(&stats.stderr));
    let s = &json_lines(&stats)[0];
    assert_eq!(s["stream_position"].as_u64(), Some(40), "{s}");
    assert!(text(&run(&["stats", path.to_str().expect("utf-8")]).stdout).contains("up to sequence 40"));
}

/// A capacity smaller than one prompt: 0.1.7's rule lets the `ran` overshoot, and `stats` says
/// why; `check --help` states its exit codes.
#[test]
fn stats_says_why_a_file_is_over_its_capacity() {
    let dir = tempdir();
    let small = dir.path().join("small.redb");
    {
        let warm = superfluid_warm::Warm::builder().capacity(100).open(&small).expect("open");
        warm.ran("m", &(0..50 * 64).collect::<Vec<u32>>(), "a").expect("ran");
        // The eviction this `ran` brings takes the first one's 50 blocks; its own 200 stay.
        warm.ran("m", &(100_000..100_000 + 200 * 64).collect::<Vec<u32>>(), "b").expect("ran");
        warm.close().expect("close");
    }
    let stats = text(&run(&["stats", small.to_str().expect("utf-8")]).stdout);
    assert!(stats.contains("% used) (over: 0.1.7's rule"), "{stats}");
    let help = run(&["check", "--help"]);
    assert!(text(&help.stdout).contains("1: the file could not be checked"), "{}", text(&help.stdout));
}
