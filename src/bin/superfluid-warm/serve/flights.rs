//! `Flights`: an engine's requests in flight, as the head that sends them sees them: those
//! before their first token, with the prefill work they leave, and those decoding.
//!
//! An engine prefills the requests it was sent about in the order they came (vLLM's scheduler
//! serves its waiting queue first come, first served), so the work ahead of a new request is
//! every uncached prompt token not yet answered by a first token, less what the engine has
//! already done of the oldest one. That part is not known, but it can be estimated: the engine
//! has been on the oldest since it was sent or since the previous first token came back,
//! whichever is later, at the rate its earlier long prefills ran. Without it, a prefill of
//! 100k tokens counts whole until its first token, and a new request is sent to an engine that
//! just started a shorter one rather than to one a few milliseconds from done.

use std::collections::VecDeque;
use std::time::Instant;

use superfluid_warm::Load;

/// Prefills at least this long teach the rate: a short one is mostly the engine's fixed cost.
const TEACHING_TOKENS: u64 = 4096;

/// How much each new rate sample counts against the rate so far.
const RATE_WEIGHT: f64 = 0.25;

/// One engine's requests in flight: those not yet at their first token, oldest first, with its
/// prefill rate, and how many are decoding.
#[derive(Debug, Default)]
pub(crate) struct Flights {
    /// Each request's serial number, when it was sent, and its uncached prompt tokens.
    waiting: VecDeque<(u64, Instant, u64)>,
    /// Requests past their first token and not ended.
    decoding: u32,
    /// When the last first token came back.
    last_first: Option<Instant>,
    /// Uncached prompt tokens a second, from the long prefills seen so far.
    rate: Option<f64>,
}

impl Flights {
    /// A request of `uncached` tokens sent at `now`.
    pub(crate) fn sent(&mut self, serial: u64, uncached: u64, now: Instant) {
        self.waiting.push_back((serial, now, uncached));
    }

    /// The request's first token came back at `now` (it decodes from now on), or it ended
    /// before one did (`first` false): its prefill is no longer ahead of anything. A first
    /// token of the oldest request teaches the rate.
    pub(crate) fn done(&mut self, serial: u64, now: Instant, first: bool) {
        let Some(at) = self.waiting.iter().position(|w| w.0 == serial) else { return };
        let Some((_, sent, uncached)) = self.waiting.remove(at) else { return };
        if !first {
            return;
        }
        self.decoding += 1;
        if at == 0 && uncached >= TEACHING_TOKENS {
            let took = now.saturating_duration_since(self.started(sent)).as_secs_f64();
            if took > 0.0 {
                let sample = uncached as f64 / took;
                self.rate = Some(self.rate.map_or(sample, |r| r + RATE_WEIGHT * (sample - r)));
            }
        }
        self.last_first = Some(now);
    }

    /// The request's uncached prompt tokens are `uncached` (its length was estimated when it
    /// was sent); nothing once its first token came.
    pub(crate) fn resize(&mut self, serial: u64, uncached: u64) {
        if let Some(w) = self.waiting.iter_mut().find(|w| w.0 == serial) {
            w.2 = uncached;
        }
    }

    /// A request that was decoding ended.
    pub(crate) fn ended_decoding(&mut self) {
        self.decoding = self.decoding.saturating_sub(1);
    }

    /// The engine's load at `now`: every request listed, the prefill work ahead, the streams
    /// decoding.
    pub(crate) fn load(&self, now: Instant) -> Load {
        let waiting = u32::try_from(self.waiting.len()).unwrap_or(u32::MAX);
        Load::new(waiting.saturating_add(self.decoding), self.ahead(now), self.decoding)
    }

    /// When the engine started on the oldest request, sent at `sent`: then, or at the last
    /// first token if that came later.
    fn started(&self, sent: Instant) -> Instant {
        self.last_first.map_or(sent, |last| last.max(sent))
    }

    /// The uncached prompt tokens still to prefill at `now`: all of them, less the estimated
    /// progress on the oldest.
    fn ahead(&self, now: Instant) -> u64 {
        let tokens: u64 = self.waiting.iter().map(|w| w.2).sum();
        let (Some(rate), Some(&(_, sent, uncached))) = (self.rate, self.waiting.front()) else { return tokens };
        let done = (rate * now.saturating_duration_since(self.started(sent)).as_secs_f64()) as u64;
        tokens.saturating_sub(done.min(uncached))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_oldest_prefill_counts_less_as_the_engine_works_through_it_at_its_learned_rate() {
        let t0 = Instant::now();
        let us = |n: u64| t0 + Duration::from_micros(n);
        let mut p = Flights::default();
        // No rate yet: every token counts until its first token.
        p.sent(1, 10_000, t0);
        p.sent(2, 2_000, us(10_000));
        assert_eq!(p.ahead(us(50_000)), 12_000);
        // Request 1's first token after 125 ms: 80,000 tokens a second.
        p.done(1, us(125_000), true);
        assert_eq!(p.ahead(us(125_000)), 2_000);
        // Request 2 started at request 1's first token: 15.625 ms in, 1,250 done.
        assert_eq!(p.ahead(us(140_625)), 750);
        // Past its estimated end it counts nothing, until its first token says so.
        assert_eq!(p.ahead(us(500_000)), 0);
        p.sent(3, 50_000, us(500_000));
        assert_eq!(p.ahead(us(500_000)), 50_000, "the oldest is done as far as the head can tell");
        // Short prefills teach nothing; an ended request is only taken off.
        p.done(2, us(520_000), true);
        p.done(3, us(600_000), false);
        assert_eq!(p.ahead(us(600_000)), 0);
        p.sent(4, 20_000, us(750_000));
        // 125 ms at 80,000 a second.
        assert_eq!(p.ahead(us(875_000)), 10_000);
        // Request 4 took 500 ms: 40,000 a second, weighed in at a quarter: 70,000 a second.
        p.done(4, us(1_250_000), true);
        p.sent(5, 90_000, us(1_250_000));
        assert_eq!(p.ahead(us(1_375_000)), 81_250);
    }

    #[test]
    fn a_request_sent_on_an_estimate_counts_its_true_length_once_known() {
        let t0 = Instant::now();
        let mut p = Flights::default();
        p.sent(1, 9_000, t0);
        p.sent(2, 500, t0);
        p.resize(1, 9_870);
        assert_eq!(p.load(t0), Load::new(2, 10_370, 0));
        // Past its first token it is no longer ahead of anything, and stays so.
        p.done(1, t0, true);
        p.resize(1, 20_000);
        p.resize(7, 1_000);
        assert_eq!(p.load(t0), Load::new(2, 500, 1));
    }

    #[test]
    fn an_unknown_or_repeated_request_changes_nothing() {
        let t0 = Instant::now();
        let mut p = Flights::default();
        p.sent(1, 8_000, t0);
        p.done(7, t0, true);
        p.done(1, t0 + Duration::from_millis(125), true);
        p.done(1, t0 + Duration::from_millis(200), true);
        assert_eq!(p.ahead(t0), 0);
        assert_eq!(p.rate, Some(64_000.0));
    }

    #[test]
    fn the_load_counts_each_request_once_before_and_after_its_first_token() {
        let t0 = Instant::now();
        let mut p = Flights::default();
        p.sent(1, 3_000, t0);
        p.sent(2, 1_000, t0);
        assert_eq!(p.load(t0), Load::new(2, 4_000, 0));
        p.done(1, t0, true);
        assert_eq!(p.load(t0), Load::new(2, 1_000, 1));
        p.done(2, t0, false);
        p.ended_decoding();
        assert_eq!(p.load(t0), Load::new(0, 0, 0));
        p.ended_decoding();
        assert_eq!(p.load(t0), Load::default());
    }
}
