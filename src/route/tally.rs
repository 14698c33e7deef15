//! `RouteTally`: what a routing head counts per engine: requests, failures, retries, ejections,
//! and the warm tokens it predicted against the `cached_tokens` the engine delivered.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::keys::{BLOCK_TOKENS, MIN_BLOCKS};
use crate::telemetry;

/// Tokens a prediction may be off by before it counts as a miss, and is logged: one of the
/// index's blocks (the engine counts in its own, smaller blocks, and never its prompt's last
/// token). A delivery shorter than the index's shortest answer (two blocks, 128 tokens) with
/// nothing predicted is no miss: the index does not answer prefixes that short.
pub const PREDICTION_SLACK: u64 = 64;

/// The shortest prefix the index answers, in tokens.
const SHORTEST: u64 = (MIN_BLOCKS * BLOCK_TOKENS) as u64;

/// One engine's figures, as a routing head counted them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RouteStats {
    /// The engine.
    pub engine: String,
    /// Requests sent to it (a retry counts again, on the engine it went to).
    pub requests: u64,
    /// Of those, whose prompt was not rendered into tokens, so routed on load alone.
    pub unrendered: u64,
    /// Requests it failed before the client had a byte (refused, reset, a 5xx).
    pub failures: u64,
    /// Times it was taken out of the choice after failing in a row.
    pub ejections: u64,
    /// Answers that told the engine's `cached_tokens`.
    pub answered: u64,
    /// Warm tokens the head predicted for those answers.
    pub predicted_tokens: u64,
    /// `cached_tokens` the engine reported for them.
    pub delivered_tokens: u64,
    /// Answers whose prediction was off by more than [`PREDICTION_SLACK`] tokens.
    pub mispredicted: u64,
    /// Of those, predicted above what was delivered (a stale index).
    pub over_predicted: u64,
}

/// One engine's counters.
#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    unrendered: AtomicU64,
    failures: AtomicU64,
    ejections: AtomicU64,
    answered: AtomicU64,
    predicted: AtomicU64,
    delivered: AtomicU64,
    mispredicted: AtomicU64,
    over: AtomicU64,
}

/// A routing head's figures per engine, recorded as metrics too.
pub struct RouteTally {
    engines: Vec<(String, Counters)>,
}

impl std::fmt::Debug for RouteTally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteTally").field("engines", &self.engines.len()).finish_non_exhaustive()
    }
}

impl RouteTally {
    /// Figures for these engines (by their index in the list), all 0.
    pub fn new<S: AsRef<str>>(engines: &[S]) -> RouteTally {
        let engines: Vec<(String, Counters)> =
            engines.iter().map(|e| (e.as_ref().to_string(), Counters::default())).collect();
        for (name, _) in &engines {
            telemetry::route_engine(name);
        }
        RouteTally { engines }
    }

    fn get(&self, engine: usize) -> Option<&(String, Counters)> {
        self.engines.get(engine)
    }

    /// A request sent to `engine`; `rendered`: its prompt was in tokens.
    pub fn sent(&self, engine: usize, rendered: bool) {
        if let Some((name, c)) = self.get(engine) {
            c.requests.fetch_add(1, Relaxed);
            if !rendered {
                c.unrendered.fetch_add(1, Relaxed);
            }
            telemetry::route_sent(name);
        }
    }

    /// `engine` failed a request before the client had a byte (`why`: what it did).
    pub fn failed(&self, engine: usize, why: &str) {
        if let Some((name, c)) = self.get(engine) {
            c.failures.fetch_add(1, Relaxed);
            telemetry::route_failed(name, why);
        }
    }

    /// `engine` was taken out of the choice (`back`: and came back).
    pub fn ejected(&self, engine: usize, back: bool) {
        if let Some((name, c)) = self.get(engine) {
            if !back {
                c.ejections.fetch_add(1, Relaxed);
            }
            telemetry::route_ejected(name, back);
        }
    }

    /// `engine` answered a request for which the head had predicted `predicted` warm tokens
    /// with `delivered` cached tokens, out of `prompt` prompt tokens.
    pub fn delivered(&self, engine: usize, predicted: u64, delivered: u64, prompt: u64) {
        if let Some((name, c)) = self.get(engine) {
            c.answered.fetch_add(1, Relaxed);
            c.predicted.fetch_add(predicted, Relaxed);
            c.delivered.fetch_add(delivered, Relaxed);
            let off = predicted.abs_diff(delivered) > PREDICTION_SLACK && !(predicted == 0 && delivered < SHORTEST);
            if off {
                c.mispredicted.fetch_add(1, Relaxed);
                if predicted > delivered {
                    c.over.fetch_add(1, Relaxed);
                }
            }
            telemetry::route_delivered(name, predicted, delivered, prompt, off);
        }
    }

    /// Each engine's figures, in the order given to [`RouteTally::new`].
    pub fn stats(&self) -> Vec<RouteStats> {
        self.engines
            .iter()
            .map(|(engine, c)| RouteStats {
                engine: engine.clone(),
                requests: c.requests.load(Relaxed),
                unrendered: c.unrendered.load(Relaxed),
                failures: c.failures.load(Relaxed),
                ejections: c.ejections.load(Relaxed),
                answered: c.answered.load(Relaxed),
                predicted_tokens: c.predicted.load(Relaxed),
                delivered_tokens: c.delivered.load(Relaxed),
                mispredicted: c.mispredicted.load(Relaxed),
                over_predicted: c.over.load(Relaxed),
            })
            .collect()
    }
}

/// How long a decision's parts took, for the metrics: rendering the prompt into tokens, and
/// the rest (the index's answer and the choice).
pub fn record_decision(tokenize: Option<Duration>, decide: Duration) {
    telemetry::route_decision(tokenize, decide);
}

/// How long a long prompt, once routed, waited to be sent for the requests that came with it
/// to be decided (so that its engine prefills their shorter prompts first).
pub fn record_gathered(waited: Duration) {
    telemetry::route_gathered(waited);
}

/// A request the head routed on load alone, and why (`"unrendered"`, `"late"`: the index's
/// answer missed its deadline, `"no_events"`: the engines' event streams are down, `"error"`).
pub fn record_load_only(why: &'static str) {
    telemetry::route_load_only(why);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predictions_off_by_more_than_a_block_are_counted_and_which_way() {
        let tally = RouteTally::new(&["a", "b"]);
        tally.sent(0, true);
        tally.sent(0, false);
        tally.delivered(0, 640, 640, 700);
        tally.delivered(0, 640, 592, 700);
        tally.delivered(0, 640, 512, 700);
        tally.delivered(0, 0, 128, 700);
        // Under the index's shortest answer: nothing to predict.
        tally.delivered(0, 0, 96, 700);
        tally.failed(1, "refused");
        tally.ejected(1, false);
        tally.ejected(1, true);
        tally.sent(7, true);
        let stats = tally.stats();
        let a = stats.first().expect("a");
        assert_eq!((a.requests, a.unrendered, a.answered), (2, 1, 5));
        assert_eq!((a.predicted_tokens, a.delivered_tokens), (1920, 1968));
        assert_eq!((a.mispredicted, a.over_predicted), (2, 1));
        let b = stats.get(1).expect("b");
        assert_eq!((b.requests, b.failures, b.ejections), (0, 1, 1));
    }
}
