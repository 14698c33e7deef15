//! A sharing head in a process of its own, for the kill -9 test of `tests/sharing.rs`.
//!
//! `shared-head FILE URL STREAM HEAD RANS [UNTIL]`: opens FILE sharing STREAM as HEAD, prints
//! `start POSITION`, makes RANS `ran`s (printing `ran I` after each), syncs, then waits until it
//! has applied the stream up to UNTIL (if given), prints `applied SEQ events N skipped K` and
//! closes. Killed at any moment, it must lose nothing it made durable.

use std::io::Write;
use std::time::Duration;

use superfluid_warm::{SharedWarm, Sharing, Warm};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [file, url, stream, head, rans, rest @ ..] = args.as_slice() else {
        return Err("usage: shared-head FILE URL STREAM HEAD RANS [UNTIL]".into());
    };
    let rans: u32 = rans.parse()?;
    let until: Option<u64> = rest.first().map(|s| s.parse()).transpose()?;
    let mut builder = Warm::builder();
    builder.capacity(3_000).sync_window(Duration::from_millis(10));
    let warm = SharedWarm::open(&builder, file, Sharing::nats(url, stream, head))?;
    let mut out = std::io::stdout();
    writeln!(out, "start {}", warm.share_stats().durable)?;
    for i in 0..rans {
        let c = i % 29;
        let tokens: Vec<u32> = (0..(64 * (3 + i % 7) + 5)).map(|t| (c + 100) * 1_000_000 + t).collect();
        warm.ran("m", &tokens, &format!("node-{}", i % 5))?;
        writeln!(out, "ran {i}")?;
        out.flush()?;
        std::thread::sleep(Duration::from_micros(300));
    }
    warm.sync()?;
    if let Some(until) = until
        && !warm.wait_applied(until, Duration::from_secs(60))
    {
        return Err(format!("did not apply up to {until}: {:?}", warm.share_stats()).into());
    }
    let s = warm.share_stats();
    writeln!(out, "applied {} events {} skipped {}", s.applied, s.applied_events, s.skipped)?;
    out.flush()?;
    warm.close()?;
    Ok(())
}
