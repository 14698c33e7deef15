//! The index against a model of 0.1.7's semantics, eviction order, restarts, sharing.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};
use superfluid_warm::ReadIndex;

use common::{Conversations, Rng, db_path, tempdir};
use harness::baseline::Baseline;
use superfluid_warm::{Error, Hit, Snapshot, Warm};

fn as_hit(answer: Option<(&str, usize)>) -> Option<Hit> {
    answer.map(|(node, tokens)| Hit::new(node, tokens))
}

const NODES: [&str; 4] = ["node-a", "node-b", "node-c", "node-d"];

#[test]
fn thousands_of_random_operations_answer_as_0_1_7_below_capacity() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let mut model = Baseline::in_memory(1 << 20);
    let mut warm = Warm::builder().sync_window(Duration::from_millis(5)).open(&path)?;
    let mut rng = Rng(0x5eed);
    let mut conversations = Conversations::new(40);
    let (mut compared, mut warm_answers, mut reopens) = (0, 0, 0);
    for step in 0..4000 {
        let (m, prompt) = conversations.turn(&mut rng);
        // Ask about a prefix of the prompt, sometimes cut mid-block, sometimes the whole of it.
        let cut = if rng.below(3) == 0 { prompt.len() } else { rng.below(prompt.len() as u64 + 1) as usize };
        let want = as_hit(model.warmest(m, &prompt[..cut]));
        assert_eq!(warm.warmest(m, &prompt[..cut])?, want, "step {step}");
        compared += 1;
        warm_answers += usize::from(want.is_some());
        let node = NODES[rng.below(4) as usize];
        if rng.below(10) < 7 {
            model.ran(m, &prompt, node);
            warm.ran(m, &prompt, node)?;
        }
        match rng.below(200) {
            0 => warm.sync()?,
            1 => {
                warm.close()?;
                warm = Warm::open(&path)?;
                reopens += 1;
            }
            _ => {}
        }
    }
    println!("compared {compared} answers ({warm_answers} warm) across {reopens} reopens");
    assert!(warm_answers > 1000 && reopens > 5, "the run exercised warm answers and reopens");
    assert_eq!(warm.stats()?.entries, model.len() as u64, "one entry per distinct block, as 0.1.7");
    Ok(())
}

#[test]
fn eviction_takes_the_oldest_eighth_and_a_touched_prefix_survives() -> Result<(), Error> {
    let dir = tempdir();
    let warm = Warm::builder().capacity(80).open(db_path(&dir))?;
    let mut model = Baseline::in_memory(80);
    let prompt = |i: u32| -> Vec<u32> { (0..256).map(|t| i * 10_000 + t).collect() };
    for i in 0..20 {
        warm.ran("m", &prompt(i), NODES[(i % 4) as usize])?;
        model.ran("m", &prompt(i), NODES[(i % 4) as usize]);
    }
    assert_eq!(warm.stats()?.entries, 80);
    // Prompt 0 is the oldest; running it again moves it to the newest.
    warm.ran("m", &prompt(0), "node-a")?;
    model.ran("m", &prompt(0), "node-a");
    warm.ran("m", &prompt(20), "node-b")?;
    model.ran("m", &prompt(20), "node-b");
    warm.sync()?; // an eviction is answered from once it is committed
    let stats = warm.stats()?;
    assert_eq!(stats.entries, 72, "84 entries: the 12 with a clock at most the 10th oldest's went");
    for i in 0..=20 {
        let want = as_hit(model.warmest("m", &prompt(i)));
        assert_eq!(warm.warmest("m", &prompt(i))?, want, "prompt {i}");
        let evicted = (1..=3).contains(&i);
        assert_eq!(want.is_none(), evicted, "prompt {i}: only prompts 1 to 3 were the oldest");
    }
    Ok(())
}

#[test]
fn a_restart_keeps_everything_and_the_clock_never_goes_back() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let mut rng = Rng(7);
    let mut conversations = Conversations::new(10);
    let mut asked = Vec::new();
    let clock = {
        let warm = Warm::open(&path)?;
        for i in 0..200 {
            let (m, prompt) = conversations.turn(&mut rng);
            warm.ran(m, &prompt, NODES[i % 4])?;
            asked.push((m, prompt));
        }
        let answers: Vec<_> = asked.iter().map(|(m, p)| warm.warmest(m, p)).collect::<Result<_, _>>()?;
        let clock = warm.stats()?.clock;
        drop(warm); // no sync: dropping the handle commits what is pending
        let again = Warm::open(&path)?;
        for ((m, p), want) in asked.iter().zip(&answers) {
            assert_eq!(&again.warmest(m, p)?, want);
        }
        assert!(answers.iter().all(Option::is_some));
        assert_eq!(again.stats()?.clock, clock);
        again.ran("m1", &[5; 128], "node-z")?;
        assert_eq!(again.stats()?.clock, clock + 1, "the clock goes on from where it was");
        clock
    };
    assert!(clock >= 200);
    Ok(())
}

#[test]
fn a_second_writer_is_refused_with_a_typed_error() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let first = Warm::open(&path)?;
    first.ran("m", &[1; 256], "a")?;
    let second = Warm::open(&path);
    assert!(matches!(second, Err(Error::AlreadyOpen { .. })), "{second:?}");
    let msg = second.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("another head"), "{msg}");
    assert_eq!(first.warmest("m", &[1; 256])?.map(|h| h.tokens), Some(256), "the first is unharmed");
    drop(first);
    assert!(Warm::open(&path).is_ok(), "free again once the first closes");
    Ok(())
}

#[test]
fn readers_share_the_index_while_it_is_written() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let warm = Arc::new(Warm::builder().sync_window(Duration::from_millis(20)).open(&path)?);
    let writers: Vec<_> = (0..2u32)
        .map(|w| {
            let warm = Arc::clone(&warm);
            std::thread::spawn(move || -> Result<(), Error> {
                for i in 0..300u32 {
                    let prompt: Vec<u32> = (0..192).map(|t| (w * 1000 + i) * 1000 + t).collect();
                    warm.ran("m", &prompt, &format!("node-{w}"))?;
                    let hit = warm.warmest("m", &prompt)?;
                    assert_eq!(hit.map(|h| (h.node, h.tokens)), Some((format!("node-{w}"), 192)), "read your writes");
                    // Paced like a head's traffic, so the reader overlaps the writes.
                    std::thread::sleep(Duration::from_millis(2));
                }
                Ok(())
            })
        })
        .collect();
    // A read-only view of the file follows the commits while the writers run.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.last().is_none_or(|&n| n < 1800) && Instant::now() < deadline {
        let snapshot = Snapshot::open(&path)?;
        let stats = snapshot.stats()?;
        assert!(snapshot.check()?.problems.is_empty());
        seen.push(stats.entries);
        std::thread::sleep(Duration::from_millis(15));
    }
    for w in writers {
        w.join().map_err(|_| Error::Poisoned)??;
    }
    println!("snapshot entry counts seen: {seen:?}");
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "commits only add here");
    assert_eq!(seen.last(), Some(&1800), "the reader saw every commit within the window");
    assert!(seen.iter().any(|&n| n > 0 && n < 1800), "and saw the file while it was being written");
    Ok(())
}

#[test]
fn a_file_keeps_its_capacity_unless_one_is_given() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    Warm::builder().capacity(5000).open(&path)?.close()?;
    assert_eq!(Warm::open(&path)?.stats()?.capacity, 5000, "a plain open keeps the file's capacity");
    let warm = Warm::builder().capacity(64).open(&path)?;
    assert_eq!(warm.stats()?.capacity, 64);
    drop(warm);
    assert_eq!(Warm::open(&path)?.stats()?.capacity, 64, "a given capacity is recorded");
    let fresh = dir.path().join("fresh.redb");
    assert_eq!(Warm::open(&fresh)?.stats()?.capacity, superfluid_warm::DEFAULT_CAPACITY);
    Ok(())
}

/// A file opened with a smaller capacity is evicted to it at once, durably: closed without a
/// `ran`, it opens again within the capacity, its oldest prompts gone and its newest answered.
#[test]
fn a_smaller_capacity_evicts_at_open_and_the_eviction_is_committed() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let prompt = |i: u32| -> Vec<u32> { (0..64 * 10).map(|t| i * 100_000 + t).collect() };
    let warm = Warm::builder().capacity(5000).open(&path)?;
    for i in 0..100 {
        warm.ran("m", &prompt(i), "a")?;
    }
    warm.close()?;
    // 1,000 entries; reopened at 500, closed at once.
    Warm::builder().capacity(500).open(&path)?.close()?;
    let warm = Warm::open(&path)?;
    let stats = warm.stats()?;
    assert!(stats.entries <= 500, "{} entries at capacity 500", stats.entries);
    assert_eq!(warm.warmest("m", &prompt(0))?, None, "the oldest prompt was evicted");
    assert_eq!(warm.warmest("m", &prompt(99))?.map(|h| h.tokens), Some(640), "the newest is answered");
    warm.close()?;
    let snapshot = Snapshot::open(&path)?;
    assert_eq!(snapshot.check()?.problems, Vec::<String>::new(), "the file's counts agree after the eviction");
    Ok(())
}

/// Every `ran` that returned is answered, by any thread, while the commit thread keeps writing,
/// committing and swapping its snapshot underneath (a 1 ms window makes that constant).
#[test]
fn every_returned_ran_is_answered_while_commits_swap_the_snapshot() -> Result<(), Error> {
    let dir = tempdir();
    let warm = Warm::builder().sync_window(std::time::Duration::from_millis(1)).open(db_path(&dir))?;
    let missed = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3u32)
            .map(|th| {
                let warm = &warm;
                s.spawn(move || -> Result<u32, Error> {
                    let mut missed = 0;
                    let tokens = |i: u32| -> Vec<u32> {
                        (0..64 * (2 + i % 9)).map(|t| th * 10_000_000 + i * 1000 + t).collect()
                    };
                    let node = |i: u32| NODES[((i + th) % 4) as usize];
                    for i in 0..1500u32 {
                        warm.ran("m", &tokens(i), node(i))?;
                        // This ran (in the overlay) and older ones (committed since, or not).
                        for back in [0, 1, 7, 50, 400] {
                            let Some(j) = i.checked_sub(back) else { continue };
                            let got = warm.warmest("m", &tokens(j))?;
                            if got.as_ref().map(|h| (h.node.as_str(), h.tokens)) != Some((node(j), tokens(j).len())) {
                                missed += 1;
                            }
                        }
                    }
                    Ok(missed)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread")).sum::<Result<u32, Error>>()
    })?;
    assert_eq!(missed, 0, "a ran that returned was not answered (or answered with another node)");
    warm.sync()?;
    let stats = warm.stats()?;
    assert!(!stats.pending);
    Ok(())
}

/// Group commit merges the `ran`s of a batch (each key written once, in key order): the file it
/// leaves holds exactly the entries that committing every `ran` on its own leaves.
#[test]
fn a_merged_batch_leaves_the_same_entries_as_one_ran_at_a_time() -> Result<(), Error> {
    let dir = tempdir();
    let (one, merged) = (dir.path().join("one.redb"), dir.path().join("merged.redb"));
    let mut rng = Rng(5);
    let mut conversations = Conversations::new(15);
    let turns: Vec<_> = (0..800).map(|i| (conversations.turn(&mut rng), NODES[i % 4])).collect();
    {
        let a = Warm::builder().sync_window(Duration::ZERO).open(&one)?;
        let b = Warm::builder().sync_window(Duration::from_secs(30)).open(&merged)?;
        for ((m, p), node) in &turns {
            a.ran(m, p, node)?;
            b.ran(m, p, node)?;
        }
        a.close()?;
        b.close()?;
    }
    type Row = ([u8; 16], String, u64, Option<usize>);
    let entries = |path: &std::path::Path| -> Result<Vec<Row>, Error> {
        let snapshot = Snapshot::open(path)?;
        assert!(snapshot.check()?.problems.is_empty(), "{:?}", snapshot.check()?.problems);
        let mut out = Vec::new();
        snapshot.visit(false, |e| {
            out.push((e.key, e.node, e.clock, e.tokens));
            true
        })?;
        out.sort();
        Ok(out)
    };
    let (a, b) = (entries(&one)?, entries(&merged)?);
    assert!(a.len() > 1500, "{} entries", a.len());
    assert!(a == b, "the merged file differs ({} vs {} entries)", a.len(), b.len());
    Ok(())
}

/// A churned file's free pages, in bytes, and its length: read from a copy, since opening the
/// file itself would change it (and so void its seal).
fn free_pages(path: &std::path::Path) -> (u64, u64) {
    let dir = tempdir();
    let copy = dir.path().join("copy.redb");
    std::fs::copy(path, &copy).expect("copy");
    let len = std::fs::metadata(&copy).expect("len").len();
    let db = redb::Builder::new().open(&copy).expect("open the copy");
    let txn = db.begin_write().expect("write");
    let stats = txn.stats().expect("stats");
    txn.abort().expect("abort");
    (len - stats.allocated_pages() * stats.page_size() as u64, len)
}

/// A churned file (redb reuses freed pages but never shrinks the file) comes out of a clean
/// close compacted, with the same answers, and the next open trusts its seal. While a reader
/// holds the file, the close leaves it and the reader reads on; nor when told not to.
#[test]
fn a_clean_close_compacts_a_churned_file_unless_a_reader_holds_it() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let prompt = |c: u32| -> Vec<u32> { (0..64 * 24).map(|t| c * 10_000 + t).collect() };
    type Answers = Vec<(Vec<u32>, Option<Hit>)>;
    let churn = |warm: &Warm, from: u32| -> Result<Answers, Error> {
        for c in from..from + 2000 {
            warm.ran("m", &prompt(c), NODES[c as usize % 4])?;
        }
        warm.sync()?;
        (from + 1800..from + 2000).map(|c| Ok((prompt(c), warm.warmest("m", &prompt(c))?))).collect()
    };
    let reopen_and_compare = |answers: &[(Vec<u32>, Option<Hit>)]| -> Result<(), Error> {
        let warm = Warm::open(&path)?;
        assert_eq!(warm.stats()?.open_check, superfluid_warm::OpenCheck::Seal);
        for (prompt, want) in answers {
            assert_eq!(&warm.warmest("m", prompt)?, want);
        }
        assert!(answers.iter().all(|(_, hit)| hit.as_ref().is_some_and(|h| h.tokens == 64 * 24)));
        Ok(())
    };
    let open = |compact: bool| {
        Warm::builder().capacity(8192).sync_window(Duration::from_millis(1)).compact_on_close(compact).open(&path)
    };
    // 48,000 blocks through a capacity of 8,192, one commit every few milliseconds.
    let warm = open(true)?;
    let answers = churn(&warm, 0)?;
    let (churned_free, churned_len) = free_pages(&path);
    warm.close()?;
    let (free, len) = free_pages(&path);
    println!("churned: {churned_free} of {churned_len} bytes free; closed: {free} of {len}");
    assert!(churned_free * 4 >= churned_len, "the workload leaves a sparse file");
    assert!(free * 4 < len || free < 256 << 10, "compacted: {free} of {len} bytes free");
    reopen_and_compare(&answers)?;

    // Told not to: left sparse.
    let warm = open(false)?;
    let answers = churn(&warm, 10_000)?;
    warm.close()?;
    let (free, len) = free_pages(&path);
    println!("compact_on_close(false): {free} of {len} bytes free");
    assert!(free * 4 >= len && free >= 256 << 10, "{free} of {len} bytes free");
    reopen_and_compare(&answers)?;

    // With a reader holding a transaction through the close: left sparse, read on.
    let warm = open(true)?;
    let answers = churn(&warm, 20_000)?;
    let reader = Snapshot::open(&path)?;
    let read_before = reader.stats()?.entries;
    warm.close()?;
    let (free, len) = free_pages(&path);
    println!("under a reader: {free} of {len} bytes free");
    assert!(free * 4 >= len && free >= 256 << 10, "{free} of {len} bytes free");
    assert_eq!(reader.stats()?.entries, read_before, "the reader reads on");
    assert!(reader.check()?.problems.is_empty());
    drop(reader);
    reopen_and_compare(&answers)
}

/// `close` and drop let go of the file before they return: a close and reopen in one process,
/// a thousand times, while other threads keep the CPU busy and start child processes (a child
/// shares this process's open files until it execs, and with them the locks of a file just
/// closed), never finds the file still open.
#[test]
fn close_then_reopen_a_thousand_times_under_load_never_finds_the_file_open() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy: Vec<_> = (0..3)
        .map(|i| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut spawned = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if i == 0 {
                        // Forks and execs, as the crash tests' writers and the CLI tests do.
                        let _ = std::process::Command::new("true").status();
                        spawned += 1;
                    } else {
                        std::hint::black_box((0..10_000u64).fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(b)));
                    }
                }
                spawned
            })
        })
        .collect();
    let prompt: Vec<u32> = (0..256).collect();
    let mut outcome = Ok(());
    for round in 0..1000u32 {
        let opened = Warm::builder().sync_window(Duration::from_millis(if round % 2 == 0 { 0 } else { 5 })).open(&path);
        let warm = match opened {
            Ok(warm) => warm,
            Err(e) => {
                outcome = Err((round, e));
                break;
            }
        };
        if round % 10 == 0
            && let Err(e) = warm.ran("m", &prompt, "a")
        {
            outcome = Err((round, e));
            break;
        }
        if round % 3 == 0 {
            drop(warm);
        } else if let Err(e) = warm.close() {
            outcome = Err((round, e));
        }
        if outcome.is_err() {
            break;
        }
        // A reader between, as `recover_and_check` does.
        if round % 7 == 0 {
            drop(Snapshot::open(&path)?);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let spawned: u64 = busy.into_iter().map(|t| t.join().unwrap_or(0)).sum();
    println!("1000 closes and reopens beside {spawned} child processes");
    if let Err((round, e)) = outcome {
        panic!("round {round}: {e:?}");
    }
    assert!(spawned > 0);
    assert_eq!(Warm::open(&path)?.warmest("m", &prompt)?.map(|h| h.tokens), Some(256));
    Ok(())
}
