//! Short requests reach an engine before the long ones that came with them.
//!
//! Requests come in bursts (a conversation trace sends a dozen within a few milliseconds), and an
//! engine prefills in the order requests reach it (vLLM's scheduler is first come, first
//! served). A long prompt routed on its start is decided in a millisecond or two, before the
//! short turns that came with it have been rendered; sent at once, it takes its engine's prefill
//! for hundreds of milliseconds, and a warm turn decided a few milliseconds later waits all of
//! that for a prefill of its own of a few. So a request whose own prefill is long (at least
//! [`Gather::long_tokens`] uncached tokens) is sent only once the requests that arrived before
//! it, or within [`BURST`] after it, are decided (each is sent as soon as it is, if short), and
//! at most [`Gather::most`] after its arrival: the long prefill's first token comes that much
//! later, and every short one behind it hundreds of milliseconds sooner.
//!
//! A request's load is on its engine from its decision, so the requests decided while it waits
//! are priced with its prefill ahead of them, as they would be after it was sent.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Requests that arrive this soon after a long one are of its burst: it waits for them too.
pub(crate) const BURST: Duration = Duration::from_millis(5);

/// The requests not yet decided, and the rule for the long ones.
pub(crate) struct Gather {
    /// Own prefill (uncached tokens on the chosen engine) from which a request waits.
    long_tokens: usize,
    /// The longest a request waits, from its arrival (zero: none waits).
    most: Duration,
    /// Requests not decided yet: (arrival, number), oldest first.
    pending: Mutex<BTreeSet<(Instant, u64)>>,
    /// Told each time a request is decided.
    decided: tokio::sync::Notify,
    next: AtomicU64,
}

/// A request's place among the undecided, left when it is decided (or dropped).
pub(crate) struct Pending<'a> {
    gather: &'a Gather,
    key: (Instant, u64),
    /// Whether it is still among the undecided.
    listed: bool,
}

impl Gather {
    /// Requests of `long_tokens` own prefill tokens or more wait up to `most` from their arrival.
    pub(crate) fn new(long_tokens: usize, most: Duration) -> Gather {
        Gather {
            long_tokens,
            most,
            pending: Mutex::default(),
            decided: tokio::sync::Notify::new(),
            next: AtomicU64::new(0),
        }
    }

    /// A request that arrived at `at`, not decided yet.
    pub(crate) fn arrive(&self, at: Instant) -> Pending<'_> {
        let key = (at, self.next.fetch_add(1, Relaxed));
        let listed = !self.most.is_zero();
        if listed {
            self.lock().insert(key);
        }
        Pending { gather: self, key, listed }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<(Instant, u64)>> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a request that arrived before `until` is still undecided.
    fn undecided_before(&self, until: Instant) -> bool {
        self.lock().first().is_some_and(|&(at, _)| at <= until)
    }
}

impl Pending<'_> {
    /// The request is decided, with `own_tokens` to prefill on its engine: returns at once for a
    /// short one; a long one returns once the requests of its burst are decided too, or at
    /// most [`Gather::most`] after its arrival. How long it waited.
    pub(crate) async fn decided(mut self, own_tokens: usize) -> Duration {
        self.leave();
        let gather = self.gather;
        if own_tokens < gather.long_tokens || gather.most.is_zero() {
            return Duration::ZERO;
        }
        let started = Instant::now();
        let until = self.key.0 + BURST;
        let deadline = tokio::time::Instant::from_std(self.key.0 + gather.most);
        loop {
            // Registered before the look, so a decision between the two is not missed.
            let told = gather.decided.notified();
            if !gather.undecided_before(until) {
                break;
            }
            if tokio::time::timeout_at(deadline, told).await.is_err() {
                break;
            }
        }
        started.elapsed()
    }

    fn leave(&mut self) {
        if std::mem::take(&mut self.listed) {
            self.gather.lock().remove(&self.key);
            self.gather.decided.notify_waiters();
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a runtime")
    }

    /// A long request waits for the one that arrived with it, and goes once it is decided.
    #[test]
    fn a_long_request_goes_once_its_burst_is_decided() {
        runtime().block_on(async {
            let gather = Gather::new(1000, Duration::from_secs(60));
            let now = Instant::now();
            let long = gather.arrive(now);
            let short = gather.arrive(now + Duration::from_millis(1));
            let waiting = long.decided(5000);
            tokio::pin!(waiting);
            // Not while the short one is undecided.
            assert!(tokio::time::timeout(Duration::from_millis(50), &mut waiting).await.is_err());
            assert_eq!(short.decided(10).await, Duration::ZERO, "a short request never waits");
            let waited = tokio::time::timeout(Duration::from_secs(30), waiting).await.expect("it goes");
            assert!(waited >= Duration::from_millis(50));
        });
    }

    /// Requests that arrive after the burst, or short ones, are not waited for; and no request
    /// waits past the most from its arrival.
    #[test]
    fn only_the_burst_is_waited_for_and_never_past_the_most() {
        runtime().block_on(async {
            let gather = Gather::new(1000, Duration::from_secs(60));
            let now = Instant::now();
            let long = gather.arrive(now);
            let _later = gather.arrive(now + BURST + Duration::from_millis(1));
            let waited = tokio::time::timeout(Duration::from_secs(30), long.decided(5000)).await;
            assert!(waited.is_ok_and(|w| w < Duration::from_secs(30)), "a later request is not of its burst");

            let gather = Gather::new(1000, Duration::from_millis(40));
            let now = Instant::now();
            let long = gather.arrive(now);
            let _undecided = gather.arrive(now);
            let started = Instant::now();
            let waited = tokio::time::timeout(Duration::from_secs(30), long.decided(5000)).await.expect("it goes");
            assert!(waited >= Duration::from_millis(30) && started.elapsed() < Duration::from_secs(30));
        });
    }

    /// Off (no most), nothing is listed and nothing waits.
    #[test]
    fn off_nothing_waits() {
        runtime().block_on(async {
            let gather = Gather::new(0, Duration::ZERO);
            let now = Instant::now();
            let long = gather.arrive(now);
            let _other = gather.arrive(now);
            assert_eq!(long.decided(1 << 20).await, Duration::ZERO);
            assert!(gather.lock().is_empty());
        });
    }
}
