//! A head that writes until it is killed, for the crash and CLI tests (built by `cargo test` as
//! an example; not part of the package): `torture-writer --db PATH [--seed N] [--capacity N]
//! [--rans N] [--distinct]` runs `ran`s of the shared torture workload, and after every third one `sync`s and
//! prints `durable I CLOCK`: ran `I` (0-based) and every one before it are durable. With
//! `--rans N` it then syncs, prints `closing I CLOCK`, closes and prints `closed`. With
//! `--distinct`, ran `i` runs `torture::distinct(prompt, i)`.

use std::io::Write;
use std::time::Duration;

use harness::replay::node_name;
use superfluid_warm::Warm;

#[path = "../common/torture.rs"]
mod torture;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let db = arg(&args, "--db").ok_or("--db PATH is required")?;
    let seed: u64 = arg(&args, "--seed").map_or(Ok(1), |s| s.parse())?;
    let capacity: u64 = arg(&args, "--capacity").map_or(Ok(4096), |s| s.parse())?;
    let rans: u64 = arg(&args, "--rans").map_or(Ok(0), |s| s.parse())?;
    let distinct = args.iter().any(|a| a == "--distinct");
    let warm = Warm::builder().capacity(capacity).sync_window(Duration::from_millis(2)).open(db)?;
    let prompts = torture::prompts(seed);
    let mut out = std::io::stdout().lock();
    let mut i = 0u64;
    while rans == 0 || i < rans {
        let prompt = &prompts[(i % torture::CYCLE as u64) as usize];
        if distinct {
            warm.ran("torture", &torture::distinct(prompt, i as usize), &node_name(i as usize % 5))?;
        } else {
            warm.ran("torture", prompt, &node_name(i as usize % 5))?;
        }
        if i.is_multiple_of(3) {
            warm.sync()?;
            writeln!(out, "durable {i} {}", warm.stats()?.clock)?;
            out.flush()?;
        }
        i += 1;
    }
    // Everything durable, then the close (which may compact the file): `closing I CLOCK`, and
    // `closed` once it returned.
    warm.sync()?;
    writeln!(out, "closing {} {}", i.saturating_sub(1), warm.stats()?.clock)?;
    out.flush()?;
    warm.close()?;
    writeln!(out, "closed")?;
    Ok(())
}
