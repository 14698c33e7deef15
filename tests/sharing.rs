//! Several heads sharing one view through a real NATS JetStream server: convergence, exactly
//! once across a head's kill -9, a server restart, bootstrap from a copied file, and a head
//! whose position the stream dropped.

mod common;

use std::path::Path;
use std::time::Duration;
use superfluid_warm::ReadIndex;

use common::Rng;
use common::nats::{NatsServer, published};
use superfluid_warm::{Builder, DumpEntry, SharedWarm, Sharing, Snapshot, Warm};

const MODEL: &str = "m";

fn builder() -> Builder {
    let mut b = Warm::builder();
    b.capacity(3_000).sync_window(Duration::from_millis(10));
    b
}

fn head(dir: &Path, server: &NatsServer, stream: &str, name: &str) -> SharedWarm {
    SharedWarm::open(&builder(), dir.join(format!("{name}.redb")), Sharing::nats(&server.url(), stream, name))
        .expect("a sharing head opens")
}

/// Conversation `c`'s prompt at turn `t` (each turn extends the last).
fn prompt(c: u32, t: u32) -> Vec<u32> {
    (0..(64 * (3 + 2 * t) + 17)).map(|i| if i < 128 { i } else { (c + 1) * 1_000_000 + i }).collect()
}

/// Waits until every head has applied the stream up to `seq`.
fn converge(heads: &[&SharedWarm], seq: u64) {
    for h in heads {
        assert!(h.wait_applied(seq, Duration::from_secs(30)), "a head applied {seq}: {:?}", h.share_stats());
    }
}

/// The stream's last sequence, once every head's events are in it (as the server says).
fn last_seq(server: &NatsServer, stream: &str, heads: &[&SharedWarm]) -> u64 {
    for h in heads {
        published(h);
    }
    server.last_seq(stream)
}

/// Every head answers every query alike.
fn same_answers(heads: &[&SharedWarm], queries: &[Vec<u32>]) -> usize {
    let mut warm_answers = 0;
    for q in queries {
        let first = heads[0].warm_nodes(MODEL, q).expect("warm_nodes");
        let best = heads[0].warmest(MODEL, q).expect("warmest");
        warm_answers += usize::from(best.is_some());
        for h in &heads[1..] {
            assert_eq!(h.warm_nodes(MODEL, q).expect("warm_nodes"), first, "warm_nodes differ");
            assert_eq!(h.warmest(MODEL, q).expect("warmest"), best, "warmest differs");
        }
    }
    warm_answers
}

/// Every entry of a file, in key order (`dump`), and its invariants checked.
fn dump(path: &Path) -> Vec<DumpEntry> {
    let snapshot = Snapshot::open(path).expect("a snapshot");
    let check = snapshot.check().expect("check");
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    let mut out = Vec::new();
    snapshot
        .visit(false, |e| {
            out.push(e);
            true
        })
        .expect("dump");
    out.sort_by_key(|e| e.key);
    out
}

/// Forgets `name` through head `h`, and waits until it is in the stream: a server slow to
/// acknowledge (a loaded machine) makes `forget_node` say so with `Unpublished`, the forget
/// buffered, and [`published`] waits for it.
fn forget(h: &SharedWarm, name: &str) {
    match h.forget_node(name) {
        Err(superfluid_warm::Error::Unpublished { .. }) => published(h),
        done => done.expect("forget"),
    }
}

#[test]
fn three_heads_with_interleaved_rans_and_forgets_converge() {
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start(&dir.path().join("js"));
    let names = ["a", "b", "c"];
    let heads: Vec<SharedWarm> = names.iter().map(|n| head(dir.path(), &server, "conv", n)).collect();
    let refs: Vec<&SharedWarm> = heads.iter().collect();
    let mut rng = Rng(7);
    let mut last_node = vec![None; 40];
    let (mut rans, mut forgets) = (0, 0);
    for i in 0..600u32 {
        let c = rng.below(40) as u32;
        let t = (i / 40) % 6;
        let h = &heads[(i % 3) as usize];
        if i % 97 == 96 {
            let gone = format!("node-{}", rng.below(6));
            forget(h, &gone);
            for n in last_node.iter_mut().filter(|n| n.as_deref() == Some(gone.as_str())) {
                *n = None;
            }
            forgets += 1;
        }
        let node = format!("node-{}", rng.below(6));
        let ticket = h.ran(MODEL, &prompt(c, t), &node).expect("ran");
        // A head answers its own `ran` at once, until the stream brings it back: then where the
        // stream put it decides (another head's `ran` of the same prompt may be stored after it,
        // which a loaded machine gives the time to arrive).
        let answer = h.warmest(MODEL, &prompt(c, t)).expect("warmest").map(|hit| hit.node);
        assert!(
            answer.as_deref() == Some(node.as_str()) || h.wait_for(&ticket, Duration::ZERO),
            "its own ran, not yet back from the stream, answered {answer:?} instead of {node}"
        );
        last_node[c as usize] = Some(node);
        rans += 1;
    }
    let seq = last_seq(&server, "conv", &refs);
    assert_eq!(seq, rans + forgets, "every event is in the stream once");
    converge(&refs, seq);
    let queries: Vec<Vec<u32>> = (0..40).flat_map(|c| (0..6).map(move |t| prompt(c, t))).collect();
    let warm = same_answers(&refs, &queries);
    // What one head ran, the others answer (but where the node was forgotten since).
    let mut seen = 0;
    for (c, node) in last_node.iter().enumerate() {
        let Some(node) = node else { continue };
        let hits: Vec<_> = heads.iter().map(|h| h.warm_nodes(MODEL, &prompt(c as u32, 0)).expect("nodes")).collect();
        assert!(hits[0].iter().any(|hit| hit.node == *node), "conversation {c}: {node} is known to every head");
        seen += 1;
    }
    for h in &heads {
        let s = h.share_stats();
        assert_eq!((s.applied, s.buffered, s.dropped, s.pending_own, s.rejected), (seq, 0, 0, 0, 0), "{s:?}");
    }
    println!(
        "3 heads: {rans} rans + {forgets} forgets = {seq} events; {warm} of {} queries warm, the same on every head; {seen} cross-head checks",
        queries.len()
    );
    let paths: Vec<_> = names.iter().map(|n| dir.path().join(format!("{n}.redb"))).collect();
    for h in heads {
        h.close().expect("close");
    }
    let first = dump(&paths[0]);
    assert!(!first.is_empty());
    for p in &paths[1..] {
        assert_eq!(dump(p), first, "the files hold the same entries");
    }
}

/// Starts the `shared-head` helper; returns it and its stdout lines.
fn spawn_head(
    file: &Path,
    server: &NatsServer,
    stream: &str,
    name: &str,
    rans: u32,
    until: Option<u64>,
) -> (std::process::Child, std::io::Lines<std::io::BufReader<std::process::ChildStdout>>) {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(common::example("shared-head"));
    cmd.arg(file).arg(server.url()).arg(stream).arg(name).arg(rans.to_string());
    if let Some(until) = until {
        cmd.arg(until.to_string());
    }
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().expect("shared-head starts");
    let lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    (child, lines)
}

fn line_with(lines: &mut impl Iterator<Item = std::io::Result<String>>, prefix: &str) -> String {
    lines
        .map(|l| l.expect("a line"))
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting with {prefix:?}"))
}

fn number(line: &str, word: &str) -> u64 {
    let mut words = line.split_whitespace();
    words.find(|w| *w == word).and_then(|_| words.next()).and_then(|n| n.parse().ok()).expect("a number")
}

#[test]
fn a_head_killed_mid_stream_resumes_after_what_it_made_durable() {
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start(&dir.path().join("js"));
    let a = head(dir.path(), &server, "kill", "a");
    let b = head(dir.path(), &server, "kill", "b");
    let c_file = dir.path().join("c.redb");
    let mut rounds = Vec::new();
    for round in 0..3u32 {
        let (mut child, mut lines) = spawn_head(&c_file, &server, "kill", "c", 5_000, None);
        let start = number(&line_with(&mut lines, "start"), "start");
        // The others write while c does; c is killed mid-run.
        for i in 0..150u32 {
            let h = if i % 2 == 0 { &a } else { &b };
            h.ran(MODEL, &prompt(i % 31 + 100 * round, i % 5), &format!("node-{}", i % 4)).expect("ran");
        }
        let ran = line_with(&mut lines, &format!("ran {}", 200 + 150 * round));
        child.kill().expect("kill -9");
        child.wait().expect("reaped");
        rounds.push((start, ran));
    }
    let seq = last_seq(&server, "kill", &[&a, &b]);
    // c again: it resumes from its file's position and applies the rest, once.
    let (mut child, mut lines) = spawn_head(&c_file, &server, "kill", "c", 0, Some(seq));
    let start = number(&line_with(&mut lines, "start"), "start");
    let done = line_with(&mut lines, "applied");
    assert!(child.wait().expect("c exits").success());
    assert_eq!(number(&done, "applied"), seq);
    assert_eq!(number(&done, "events"), seq - start, "applied after its position exactly once each: {done}");
    converge(&[&a, &b], seq);
    println!(
        "kill -9: 3 rounds killed at {:?}; the stream holds {seq} events; restarted at position {start}, applied {} \
         (skipped {} redelivered)",
        rounds,
        seq - start,
        number(&done, "skipped")
    );
    let (a_file, b_file) = (dir.path().join("a.redb"), dir.path().join("b.redb"));
    a.close().expect("close");
    b.close().expect("close");
    let first = dump(&a_file);
    assert_eq!(dump(&b_file), first);
    assert_eq!(
        dump(&c_file),
        first,
        "the killed head's file holds what the others hold: nothing twice, nothing skipped"
    );
}

#[test]
fn heads_converge_after_the_server_restarts_and_buffer_meanwhile() {
    let dir = tempfile::tempdir().expect("dir");
    let mut server = NatsServer::start(&dir.path().join("js"));
    let a = head(dir.path(), &server, "restart", "a");
    let b = head(dir.path(), &server, "restart", "b");
    for i in 0..100u32 {
        [&a, &b][(i % 2) as usize].ran(MODEL, &prompt(i % 17, i % 4), &format!("node-{}", i % 3)).expect("ran");
    }
    published(&a);
    server.stop();
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..100u32 {
        let h = [&a, &b][(i % 2) as usize];
        h.ran(MODEL, &prompt(i % 17 + 50, i % 4), "node-9").expect("a ran never waits on the network");
        assert_eq!(
            h.warmest(MODEL, &prompt(i % 17 + 50, i % 4)).expect("warmest").map(|h| h.node),
            Some("node-9".into())
        );
    }
    let during = (a.share_stats(), b.share_stats());
    assert!(!during.0.connected && during.0.buffered > 0, "{:?}", during.0);
    assert!(matches!(a.sync(), Err(superfluid_warm::Error::Unpublished { .. })) || during.0.buffered == 0);
    server.restart();
    let seq = last_seq(&server, "restart", &[&a, &b]);
    assert_eq!(seq, 200, "every event once, the retried ones too");
    converge(&[&a, &b], seq);
    // The connection state is looked at every 50 ms.
    let started = std::time::Instant::now();
    while !a.share_stats().connected && started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let after = a.share_stats();
    assert!(after.connected && after.dropped == 0 && after.buffered == 0, "{after:?}");
    println!(
        "server restart: {} + {} events buffered while it was down, then {seq} in the stream",
        during.0.buffered, during.1.buffered
    );
    let (a_file, b_file) = (dir.path().join("a.redb"), dir.path().join("b.redb"));
    a.close().expect("close");
    b.close().expect("close");
    assert_eq!(dump(&a_file), dump(&b_file));
}

#[test]
fn a_new_head_starts_from_a_copied_file_or_the_whole_stream_but_not_from_a_dropped_position() {
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start(&dir.path().join("js"));
    let a = head(dir.path(), &server, "boot", "a");
    let b = head(dir.path(), &server, "boot", "b");
    for i in 0..120u32 {
        [&a, &b][(i % 2) as usize].ran(MODEL, &prompt(i % 23, i % 5), &format!("node-{}", i % 4)).expect("ran");
    }
    let seq = last_seq(&server, "boot", &[&a, &b]);
    converge(&[&a, &b], seq);
    published(&a);
    // d starts from a copy of a's file (a head stopped for the copy), e from nothing.
    let a_file = dir.path().join("a.redb");
    a.close().expect("close");
    std::fs::copy(&a_file, dir.path().join("d.redb")).expect("copy");
    let d = head(dir.path(), &server, "boot", "d");
    assert_eq!(d.share_stats().durable, seq, "the copy carries its position");
    let e = head(dir.path(), &server, "boot", "e");
    for i in 0..60u32 {
        b.ran(MODEL, &prompt(i % 23 + 30, i % 5), "node-7").expect("ran");
    }
    let seq2 = last_seq(&server, "boot", &[&b, &d, &e]);
    converge(&[&b, &d, &e], seq2);
    assert_eq!(d.share_stats().applied_events, seq2 - seq, "d applied only what came after its copy");
    assert_eq!(e.share_stats().applied_events, seq2, "e applied the whole stream");
    let queries: Vec<Vec<u32>> = (0..53).flat_map(|c| (0..5).map(move |t| prompt(c, t))).collect();
    let warm = same_answers(&[&b, &d, &e], &queries);
    println!(
        "bootstrap: copy at {seq} + {} events, and the whole {seq2} from nothing; {warm} warm answers alike",
        seq2 - seq
    );
    let files: Vec<_> = ["b", "d", "e"].iter().map(|n| dir.path().join(format!("{n}.redb"))).collect();
    for h in [b, d, e] {
        h.close().expect("close");
    }
    let first = dump(&files[0]);
    for f in &files[1..] {
        assert_eq!(dump(f), first);
    }

    // A stream that keeps little: a new head's position (nothing) is long gone.
    let small = |name: &str| {
        SharedWarm::open(
            &builder(),
            dir.path().join(format!("{name}.redb")),
            Sharing::nats(&server.url(), "small", name).max_bytes(64 * 1024),
        )
        .expect("open")
    };
    let f = small("f");
    for i in 0..200u32 {
        f.ran(MODEL, &prompt(i, 40), "node-1").expect("ran");
    }
    published(&f);
    let g = small("g");
    let started = std::time::Instant::now();
    while g.share_stats().halted.is_none() && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let halted = g.share_stats().halted.expect("g refuses to start past a gap");
    assert!(halted.contains("copy of another head's file"), "{halted}");
    assert_eq!(g.share_stats().applied_events, 0);
}

#[test]
fn a_partition_between_one_head_and_the_server_heals_into_one_view() {
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start(&dir.path().join("js"));
    let proxy = common::nats::Proxy::to(&server);
    let a = head(dir.path(), &server, "part", "a");
    let c = SharedWarm::open(&builder(), dir.path().join("c.redb"), Sharing::nats(&proxy.url(), "part", "c"))
        .expect("c opens through the proxy");
    for i in 0..60u32 {
        [&a, &c][(i % 2) as usize].ran(MODEL, &prompt(i % 13, i % 4), &format!("node-{}", i % 3)).expect("ran");
    }
    let before = last_seq(&server, "part", &[&a, &c]);
    converge(&[&a, &c], before);
    proxy.cut();
    // Both sides go on routing; c buffers, a's events wait in the stream for c.
    for i in 0..80u32 {
        let h = [&a, &c][(i % 2) as usize];
        h.ran(MODEL, &prompt(i % 13 + 20, i % 4), &format!("node-{}", 3 + i % 3)).expect("ran");
    }
    std::thread::sleep(Duration::from_millis(500));
    let cut = (a.share_stats(), c.share_stats());
    assert!(cut.1.buffered > 0 && !cut.1.connected, "{:?}", cut.1);
    assert_eq!(cut.1.applied, before, "c applies nothing while cut off");
    proxy.heal();
    let seq = last_seq(&server, "part", &[&a, &c]);
    assert_eq!(seq, 140);
    converge(&[&a, &c], seq);
    let queries: Vec<Vec<u32>> = (0..33).flat_map(|c| (0..4).map(move |t| prompt(c, t))).collect();
    let warm = same_answers(&[&a, &c], &queries);
    println!(
        "partition: c buffered {} events while cut off at {before}; healed, both at {seq}, {warm} warm answers alike",
        cut.1.buffered
    );
    let (a_file, c_file) = (dir.path().join("a.redb"), dir.path().join("c.redb"));
    a.close().expect("close");
    c.close().expect("close");
    assert_eq!(dump(&a_file), dump(&c_file));
}

#[test]
fn with_no_server_a_head_routes_locally_buffers_a_bounded_number_and_counts_what_it_dropped() {
    let dir = tempfile::tempdir().expect("dir");
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
    let sharing = Sharing::nats(&format!("nats://127.0.0.1:{port}"), "none", "a")
        .buffer_events(10)
        .publish_timeout(Duration::from_millis(200));
    let h = SharedWarm::open(&builder(), dir.path().join("a.redb"), sharing).expect("opens without a server");
    let started = std::time::Instant::now();
    for i in 0..30u32 {
        h.ran(MODEL, &prompt(i, 2), "node-1").expect("a ran never waits on the network");
    }
    // Blocked, each would wait out the 200 ms publish timeout: 6 s for the 30.
    assert!(started.elapsed() < Duration::from_secs(5), "nothing blocked: {:?}", started.elapsed());
    let s = h.share_stats();
    assert_eq!((s.buffered, s.dropped, s.published, s.connected), (10, 20, 0, false), "{s:?}");
    assert_eq!(
        h.warmest(MODEL, &prompt(29, 2)).expect("warmest").map(|h| h.node),
        Some("node-1".into()),
        "buffered: answered"
    );
    // Dropped: only the two blocks every prompt here shares are still answered.
    assert_eq!(h.warmest(MODEL, &prompt(0, 2)).expect("warmest").map(|h| h.tokens), Some(128), "dropped: not answered");
    match h.sync() {
        Err(superfluid_warm::Error::Unpublished { events: 10, .. }) => {}
        other => panic!("sync without a server: {other:?}"),
    }
}

/// The publisher's dedup: every event carries a `Nats-Msg-Id`, and the stream stores a publish
/// of the same id again (a retry after a lost acknowledgement) once; no head applies it twice.
#[test]
fn a_publish_retried_under_the_same_message_id_is_stored_once() {
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start(&dir.path().join("js"));
    let a = head(dir.path(), &server, "dedup", "a");
    let b = head(dir.path(), &server, "dedup", "b");
    for i in 0..5u32 {
        a.ran(MODEL, &prompt(i, 1), "node-1").expect("ran");
    }
    let seq = last_seq(&server, "dedup", &[&a, &b]);
    assert_eq!(seq, 5);
    converge(&[&a, &b], seq);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let (ids, retried) = runtime.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.expect("a client"));
        let stream = js.get_stream("dedup").await.expect("the stream");
        let mut ids = Vec::new();
        for s in 1..=seq {
            let m = stream.get_raw_message(s).await.expect("a message");
            ids.push(m.headers.get("Nats-Msg-Id").map(|v| v.to_string()).expect("a message id"));
            if s == 3 {
                // The same message again, as a publisher retrying after a timeout would.
                let again = js.publish_with_headers(m.subject.clone(), m.headers.clone(), m.payload.clone()).await;
                let ack = again.expect("published").await.expect("acknowledged");
                assert!(ack.duplicate && ack.sequence == 3, "{ack:?}");
            }
        }
        let info = js.get_stream("dedup").await.expect("the stream").info().await.expect("info").state.clone();
        (ids, info.last_sequence)
    });
    let mut distinct = ids.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 5, "one id an event: {ids:?}");
    assert_eq!(retried, 5, "the retry was not stored");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!((a.share_stats().applied_events, b.share_stats().applied_events), (5, 5));
    println!("dedup: 5 events, ids {ids:?}; a retried publish of the third was acknowledged as a duplicate");
}

/// A node's cache size set on one head reaches every head through the stream, applied in
/// stream order: every head then keeps for that node only what its cache holds, alike.
#[test]
fn a_node_cache_size_set_on_one_head_is_kept_by_every_head() {
    let dir = tempfile::tempdir().expect("dir");
    let server = NatsServer::start(&dir.path().join("js"));
    let (a, b) = (head(dir.path(), &server, "sized", "a"), head(dir.path(), &server, "sized", "b"));
    let bad = a.set_node_capacity("n", Some(0)).expect_err("a cache of 0 blocks");
    assert!(matches!(bad, superfluid_warm::Error::InvalidConfig { .. }), "{bad}");
    let ticket = a.set_node_capacity("n", Some(8)).expect("the size is in the stream");
    assert!(a.wait_for(&ticket, Duration::from_secs(30)) && b.wait_for(&ticket, Duration::from_secs(30)));
    // The last event of the stream, made durable with its position as a `ran` is (else it would
    // never be acknowledged).
    for h in [&a, &b] {
        let s = h.share_stats();
        assert_eq!((s.applied, s.durable), (1, 1), "{s:?}");
    }
    // Two prompts of 4 and then 6 blocks of their own: the second pushes the first out of an
    // 8-block cache.
    let first: Vec<u32> = (0..256).map(|t| 5_000_000 + t).collect();
    let second: Vec<u32> = (0..384).map(|t| 6_000_000 + t).collect();
    a.ran(MODEL, &first, "n").expect("ran");
    let seq = last_seq(&server, "sized", &[&a, &b]);
    converge(&[&a, &b], seq);
    assert_eq!(b.warmest(MODEL, &first).expect("warmest").map(|h| h.tokens), Some(256));
    b.ran(MODEL, &second, "n").expect("ran");
    let seq = last_seq(&server, "sized", &[&a, &b]);
    converge(&[&a, &b], seq);
    for h in [&a, &b] {
        assert_eq!(h.warmest(MODEL, &first).expect("warmest"), None, "gone from n's 8-block cache");
        assert_eq!(h.warmest(MODEL, &second).expect("warmest").map(|h| h.tokens), Some(384));
        let (stats, share) = h.stats().expect("stats");
        let n = stats.node_caches.iter().find(|c| c.node == "n").expect("n's cache is kept");
        assert_eq!((n.capacity, n.held), (Some(8), 6), "{:?}", stats.node_caches);
        assert_eq!(share.rejected, 0, "{share:?}");
    }
}

/// A head's own events not yet back from the stream are read as the newest memtable: they are
/// answered over the file, a forget of its own hides both the file's incarnation of the node
/// and its own earlier events, and a `ran` after the forget answers again; `warm_nodes` lists a
/// node once, where it goes deepest.
#[test]
fn own_events_not_yet_back_are_the_newest_layer_of_every_answer() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("a.redb");
    // The file holds node-a on turn 2 of conversation 1 and node-c on its turn 0.
    let warm = builder().open(&file).expect("open");
    warm.ran(MODEL, &prompt(1, 2), "node-a").expect("ran");
    warm.ran(MODEL, &prompt(1, 0), "node-c").expect("ran");
    warm.close().expect("close");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
    let sharing =
        Sharing::nats(&format!("nats://127.0.0.1:{port}"), "none", "h").publish_timeout(Duration::from_millis(100));
    let h = SharedWarm::open(&builder(), &file, sharing).expect("opens without a server");
    let names = |hits: Vec<superfluid_warm::Hit>| hits.into_iter().map(|h| (h.node, h.tokens)).collect::<Vec<_>>();
    let long = 64 * 7;
    assert_eq!(h.warmest(MODEL, &prompt(1, 2)).expect("warmest").map(|h| h.node), Some("node-a".into()));
    // Own: node-b on turn 1 (shorter than node-a's in the file), node-a again on turn 0.
    h.ran(MODEL, &prompt(1, 1), "node-b").expect("ran");
    assert_eq!(
        names(h.warm_nodes(MODEL, &prompt(1, 2)).expect("warm_nodes")),
        vec![("node-a".into(), long), ("node-b".into(), 64 * 5), ("node-c".into(), 64 * 3)]
    );
    h.ran(MODEL, &prompt(1, 0), "node-a").expect("ran");
    assert_eq!(
        names(h.warm_nodes(MODEL, &prompt(1, 2)).expect("warm_nodes"))[0],
        ("node-a".into(), long),
        "node-a once, where it goes deepest (the file's turn 2, not its own turn 0)"
    );
    // Own forget of node-a: the file's node-a and the own turn-0 event are both hidden.
    assert!(h.forget_node("node-a").is_err(), "no server: not published");
    assert_eq!(
        names(h.warm_nodes(MODEL, &prompt(1, 2)).expect("warm_nodes")),
        vec![("node-b".into(), 64 * 5), ("node-c".into(), 64 * 3)]
    );
    assert_eq!(h.warmest(MODEL, &prompt(1, 2)).expect("warmest").map(|h| h.node), Some("node-b".into()));
    // A ran of node-a after its forget answers: a new incarnation.
    h.ran(MODEL, &prompt(1, 0), "node-a").expect("ran");
    assert_eq!(h.warmest(MODEL, &prompt(1, 0)).expect("warmest").map(|h| h.node), Some("node-a".into()));
    assert_eq!(
        names(h.warm_nodes(MODEL, &prompt(1, 2)).expect("warm_nodes")),
        vec![("node-b".into(), 64 * 5), ("node-a".into(), 64 * 3), ("node-c".into(), 64 * 3)]
    );
}
