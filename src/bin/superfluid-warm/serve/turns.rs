//! The head's cores for tokenizing, taken in turns, shortest remaining render first.
//!
//! Requests arrive together (a conversation trace sends a dozen within 10 ms), and renders that
//! share the cores evenly all finish late: a turn of a conversation with a few hundred new words
//! waits on the new 100k-word prompt that came with it. Between two pieces of its text (every
//! ~1 KiB, `Renderer`'s steps), a render that holds a core gives it up to a waiting render with
//! less text left, and waits for a core again with its own. The start of every render (its
//! template, the pieces it finds kept and its first new piece) runs without a turn, so a short
//! prompt never waits for one.
//!
//! Shortest first alone starves a long prompt while shorter ones keep coming, and its request
//! waits with it (a 100k-word prompt routed on its start waited ~100 ms at the p99 of the
//! conversation trace). So a render whose request has not gone waits at most [`HOLD`] from its
//! arrival; past it, it goes first, oldest first. A text of [`LONG_BYTES`] or more is due at
//! once: its prefill is among an engine's longest, and holding it back only adds to the slowest
//! first tokens (the requests that come to its engine after it wait behind it however late it
//! comes). Once its request has gone ([`Turn::sent`]), what it has left is for the claim, and
//! waits by its length alone.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The longest a render whose request waits on it is kept behind shorter ones: about what a
/// short prompt's render takes, so that the renders that came with a long prompt finish first.
pub(crate) const HOLD: Duration = Duration::from_millis(10);

/// Texts at least this long are not held behind shorter ones (~40k tokens of English, a prefill
/// of a few hundred milliseconds).
pub(crate) const LONG_BYTES: usize = 256 << 10;

/// The cores renders take in turns.
pub(crate) struct Turns {
    /// Renders that may tokenize at once.
    cores: usize,
    /// The longest a render whose request waits on it yields to shorter ones ([`HOLD`]).
    hold: Duration,
    /// Renders of texts this long do not yield ([`LONG_BYTES`]).
    long: usize,
    state: Mutex<State>,
    changed: Condvar,
    /// Numbers renders in arrival order (ties go to the first).
    arrivals: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Renders holding a core.
    running: usize,
    /// Renders waiting for one: (bytes left to tokenize, or 0 past the hold; arrival), least
    /// first.
    waiting: BTreeSet<(usize, u64)>,
}

/// One render's place in the turns; the core it holds is given back when it is dropped.
pub(crate) struct Turn<'a> {
    turns: &'a Turns,
    arrival: u64,
    /// When it stops yielding to shorter renders, while its request waits on it; `None` once
    /// the request has gone.
    due: Option<Instant>,
    holds: bool,
}

impl Turns {
    /// Turns over `cores` cores (at least one), a render whose request waits on it yielding to
    /// shorter ones for at most `hold`, and not at all for a text of `long` bytes or more.
    pub(crate) fn new(cores: usize, hold: Duration, long: usize) -> Turns {
        Turns {
            cores: cores.max(1),
            hold,
            long,
            state: Mutex::default(),
            changed: Condvar::new(),
            arrivals: AtomicU64::new(0),
        }
    }

    /// The place of a render of a text of `bytes` bytes, holding no core yet.
    pub(crate) fn arrive(&self, bytes: usize) -> Turn<'_> {
        let arrival = self.arrivals.fetch_add(1, Relaxed);
        let hold = if bytes >= self.long { Duration::ZERO } else { self.hold };
        Turn { turns: self, arrival, due: Some(Instant::now() + hold), holds: false }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Turn<'_> {
    /// Its request has gone (routed on its start): the rest is tokenized for the claim, and
    /// waits by its length alone.
    pub(crate) fn sent(&mut self) {
        self.due = None;
    }

    /// Before the render's next piece, with `left` bytes of text still to tokenize: keeps its
    /// core unless a render with less left waits; otherwise waits until it is the waiting render
    /// with the least left and a core is free. Past the hold from its arrival, while its request
    /// waits on it, it counts as having none left.
    pub(crate) fn next_piece(&mut self, left: usize) {
        let (turns, due) = (self.turns, self.due);
        let key = if due.is_some_and(|due| Instant::now() >= due) { 0 } else { left };
        let mut state = turns.lock();
        if self.holds {
            if state.waiting.first().is_none_or(|&(least, _)| least >= key) {
                return;
            }
            state.running = state.running.saturating_sub(1);
            self.holds = false;
            turns.changed.notify_all();
        }
        let mut me = (key, self.arrival);
        state.waiting.insert(me);
        while state.running >= turns.cores || state.waiting.first() != Some(&me) {
            state = match due.map(|due| due.saturating_duration_since(Instant::now())) {
                // Due: first among the waiting, after those due before it.
                Some(Duration::ZERO) if me.0 != 0 => {
                    state.waiting.remove(&me);
                    me.0 = 0;
                    state.waiting.insert(me);
                    continue;
                }
                Some(wait) if me.0 != 0 => {
                    turns.changed.wait_timeout(state, wait).unwrap_or_else(PoisonError::into_inner).0
                }
                _ => turns.changed.wait(state).unwrap_or_else(PoisonError::into_inner),
            };
        }
        state.waiting.remove(&me);
        state.running += 1;
        self.holds = true;
        // The next waiting render may find a core free too.
        turns.changed.notify_all();
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if self.holds {
            let mut state = self.turns.lock();
            state.running = state.running.saturating_sub(1);
            self.turns.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;
    use std::time::{Duration, Instant};

    use super::{Turn, Turns};

    /// A hold no test outlasts: shortest first alone.
    const FOREVER: Duration = Duration::from_secs(3600);

    /// Waits (at most 30 s, however busy the machine) until `n` renders wait for a core.
    fn until_waiting(turns: &Turns, n: usize) {
        let start = Instant::now();
        while turns.lock().waiting.len() < n {
            assert!(start.elapsed() < Duration::from_secs(30), "{n} renders never waited");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// One core, held by a long render: a shorter render that asks for it at a piece gets it
    /// first, then the long one continues; a render with more left waits for both.
    #[test]
    fn a_render_with_less_left_takes_the_core_at_the_next_piece() {
        let turns = Turns::new(1, FOREVER, usize::MAX);
        let (order, done) = channel();
        let mut long = turns.arrive(10);
        long.next_piece(100_000);
        std::thread::scope(|scope| {
            let waiter = |left: usize, name: &'static str| {
                let (turns, order) = (&turns, order.clone());
                scope.spawn(move || {
                    let mut turn = turns.arrive(10);
                    turn.next_piece(left);
                    let _ = order.send(name);
                    turn.next_piece(left / 2);
                })
            };
            waiter(200_000, "larger");
            waiter(1_000, "smaller");
            // Both wait while the long render holds the only core and takes no piece.
            until_waiting(&turns, 2);
            assert!(done.try_recv().is_err(), "no render ran while the core was held");
            // At its next piece the long render (99,000 left) gives way to the smaller one only.
            let order = order.clone();
            scope.spawn(move || {
                long.next_piece(99_000);
                let _ = order.send("long");
            });
        });
        drop(order);
        let seen: Vec<&str> = done.iter().collect();
        assert_eq!(seen, ["smaller", "long", "larger"]);
        // Every core given back.
        assert_eq!(turns.lock().running, 0);
        assert!(turns.lock().waiting.is_empty());
    }

    /// Two cores: two renders hold them at once, a third waits for the first to finish.
    #[test]
    fn renders_hold_at_most_the_cores() {
        let turns = Turns::new(2, FOREVER, usize::MAX);
        let (mut a, mut b) = (turns.arrive(10), turns.arrive(10));
        a.next_piece(10);
        b.next_piece(10);
        assert_eq!(turns.lock().running, 2);
        std::thread::scope(|scope| {
            let c = scope.spawn(|| {
                let mut c = turns.arrive(10);
                c.next_piece(5);
                turns.lock().running
            });
            until_waiting(&turns, 1);
            assert_eq!(turns.lock().running, 2, "the third waits");
            drop(a);
            assert_eq!(c.join().ok(), Some(2), "it ran once a core was free");
        });
        drop(b);
        assert_eq!(turns.lock().running, 0);
    }

    /// One core, held by a render: `long` asks for it, then (after `between`) `short` does,
    /// then the holder lets it go. The order the two got it in (each keeps it until it has said
    /// so).
    fn after_a_holder<'t>(
        turns: &'t Turns,
        long: impl FnOnce(&'t Turns) -> Turn<'t> + Send,
        between: impl FnOnce(),
        short: impl FnOnce(&'t Turns) -> Turn<'t> + Send,
    ) -> Vec<&'static str> {
        let (order, done) = channel();
        let mut holder = turns.arrive(10);
        holder.next_piece(10);
        std::thread::scope(|scope| {
            let o = order.clone();
            scope.spawn(move || {
                let held = long(turns);
                let _ = o.send("long");
                drop(held);
            });
            until_waiting(turns, 1);
            between();
            let o = order.clone();
            scope.spawn(move || {
                let held = short(turns);
                let _ = o.send("short");
                drop(held);
            });
            until_waiting(turns, 2);
            drop(holder);
        });
        drop(order);
        assert_eq!(turns.lock().running, 0);
        done.iter().collect()
    }

    /// A render whose request has gone, with a thousand bytes left, at its next piece.
    fn short(turns: &Turns) -> Turn<'_> {
        let mut short = turns.arrive(10);
        short.sent();
        short.next_piece(1_000);
        short
    }

    /// One core, held: a long render whose request waits on it yields to a shorter one that
    /// came later only until its hold is over; a long render whose request has gone (its rest
    /// tokenized for the claim) yields to it however long it waited.
    #[test]
    fn a_render_whose_request_waits_goes_first_once_held_past_the_hold() {
        for (request_gone, expected) in [(false, ["long", "short"]), (true, ["short", "long"])] {
            let turns = Turns::new(1, Duration::from_millis(1), usize::MAX);
            let long = |turns| {
                let mut long = Turns::arrive(turns, 10);
                if request_gone {
                    long.sent();
                }
                long.next_piece(100_000);
                long
            };
            // Past its hold, and seen to be (it waits as having nothing left).
            let due = || {
                let start = Instant::now();
                while !request_gone && turns.lock().waiting.first().is_none_or(|&(left, _)| left != 0) {
                    assert!(start.elapsed() < Duration::from_secs(30), "the long render never came due");
                    std::thread::sleep(Duration::from_millis(1));
                }
            };
            assert_eq!(after_a_holder(&turns, long, due, short), expected, "request gone: {request_gone}");
        }
    }

    /// One core, held: a render of a long text whose request waits on it goes before a shorter
    /// one from its arrival, however long the hold; a render of a text under the length yields.
    #[test]
    fn a_long_text_is_not_held_behind_shorter_ones() {
        for (bytes, expected) in [(1 << 20, ["long", "short"]), ((1 << 20) - 1, ["short", "long"])] {
            let turns = Turns::new(1, FOREVER, 1 << 20);
            let long = |turns| {
                let mut long = Turns::arrive(turns, bytes);
                long.next_piece(bytes - 1000);
                long
            };
            assert_eq!(after_a_holder(&turns, long, || {}, short), expected, "{bytes} bytes");
        }
    }
}
