//! `Costs` and `choose`: the one rule that picks an engine.
//!
//! The cost estimates the prefill work that stands between a request and its first token on an
//! engine, in tokens: the uncached prompt tokens of the requests already waiting for their first
//! token there, plus this prompt's tokens the engine does not hold, plus a fixed price for each
//! stream decoding there (it shares the engine's steps with the prefill). Warm tokens in a slower
//! tier are credited partly (they are loaded back, not recomputed). vLLM's router multiplies its
//! prefill estimate by the active requests plus one, which makes a warm but busy engine lose to a
//! cold idle one long before its queue is the slower; Dynamo adds the prefill and decode blocks
//! with weights. Adding the queue's prefill work to the request's own is the time to first token
//! under the first-come prefill order that vLLM's scheduler keeps.

use super::load::Load;
use crate::decided::engines::Medium;

/// The weights of the cost.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Costs {
    /// The share of a warm token kept in CPU memory that is not prefilled again (0 to 1).
    pub cpu_credit: f64,
    /// The same for disk or remote storage.
    pub storage_credit: f64,
    /// Prefill tokens that one decoding stream is worth.
    pub decode_tokens: f64,
    /// The weight of the prefill work queued ahead (1: the time to first token as it stands; under
    /// 1, a conversation stays with its warm engine through a longer queue, which keeps its
    /// next turns warm too).
    pub queue_weight: f64,
    /// Queued work past this many tokens weighs fully, whatever [`Costs::queue_weight`]: a
    /// conversation stays with its warm engine through a short queue, not through a long
    /// prefill that would hold its first token for longer than prefilling it elsewhere takes.
    /// `u64::MAX`: the weight throughout.
    pub queue_knee: u64,
    /// The balance guard: an engine with more than this many requests in flight beyond the
    /// least busy engine's, and more than [`Costs::balance_ratio`] times its count, is not
    /// chosen however warm (a burst that shares a new prefix is not piled onto the first engine
    /// to hold it). `u32::MAX`: no guard.
    pub balance_in_flight: u32,
    /// The balance guard's ratio (see [`Costs::balance_in_flight`]).
    pub balance_ratio: f64,
}

impl Default for Costs {
    /// vLLM's router's tier credits (host 0.8, disk 0.3); a decoding stream worth 64 prefill
    /// tokens (a step of 64 streams costs about what a 4k-token prefill chunk does); queued work
    /// weighed 0.03 against warm tokens, so that a conversation stays with the engine that holds
    /// it (a turn sent elsewhere copies its history into a second cache, and the evictions that
    /// makes cost later turns more than the queue costs this one), throughout (no knee: bounding
    /// the wait moved the conversation trace's slowest warm turns, and their warm tokens with
    /// them); and the balance guard at 8 requests and twice the least busy engine's, which keeps
    /// that weight from piling a burst onto one engine (measured in `docs/bench-report.md`).
    fn default() -> Costs {
        Costs {
            cpu_credit: 0.8,
            storage_credit: 0.3,
            decode_tokens: 64.0,
            queue_weight: 0.03,
            queue_knee: u64::MAX,
            balance_in_flight: 8,
            balance_ratio: 2.0,
        }
    }
}

/// One engine a request could go to.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Candidate<'a> {
    /// The engine (the node the index knows it by).
    pub engine: &'a str,
    /// Prompt tokens it holds, from the start (the index's `Hit::tokens`; 0: none).
    pub warm_tokens: usize,
    /// Of those, how many from the start are in GPU memory (`Hit::gpu_tokens`).
    pub gpu_tokens: usize,
    /// The slowest tier the rest is in (`Hit::tier`).
    pub tier: Medium,
    /// Its load.
    pub load: Load,
}

impl<'a> Candidate<'a> {
    /// An engine that holds nothing of the prompt, with its load.
    pub fn new(engine: &'a str, load: Load) -> Candidate<'a> {
        Candidate { engine, warm_tokens: 0, gpu_tokens: 0, tier: Medium::Gpu, load }
    }

    /// The same engine holding `tokens` of the prompt, `gpu_tokens` of them in GPU memory and
    /// the rest in `tier` (as the index's `Hit` says).
    #[must_use]
    pub fn holding(self, tokens: usize, gpu_tokens: usize, tier: Medium) -> Candidate<'a> {
        Candidate { warm_tokens: tokens, gpu_tokens: gpu_tokens.min(tokens), tier, ..self }
    }
}

/// What [`choose`] found for one engine.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Priced {
    /// The prompt tokens the engine holds (all tiers).
    pub warm_tokens: usize,
    /// Of those, the tokens it would not prefill, with the tier credits.
    pub credited: f64,
    /// The cost: prefill tokens ahead of the request's first token.
    pub cost: f64,
}

/// Prices every candidate for a prompt of `prompt_tokens` tokens and picks the cheapest that
/// the balance guard allows (the least busy engine always is); ties go to the fewest requests in
/// flight, then to the candidate at or after `turn` in the list (a caller that passes a counter
/// spreads equal engines round-robin). `None` for no candidate.
pub fn choose(
    prompt_tokens: usize,
    candidates: &[Candidate<'_>],
    costs: &Costs,
    turn: usize,
) -> Option<(usize, Vec<Priced>)> {
    let priced: Vec<Priced> = candidates.iter().map(|c| price(prompt_tokens, c, costs)).collect();
    let n = candidates.len();
    let least = candidates.iter().map(|c| c.load.in_flight).min().unwrap_or(0);
    let allowed = |c: &Candidate<'_>| {
        let over = c.load.in_flight.saturating_sub(least);
        over <= costs.balance_in_flight || f64::from(c.load.in_flight) <= costs.balance_ratio * f64::from(least)
    };
    // From `turn` on, so that the first of equal candidates is a different one each turn.
    let best = (0..n)
        .map(|k| (turn.wrapping_add(k)) % n)
        .filter_map(|i| Some((i, candidates.get(i)?, priced.get(i)?)))
        .filter(|(_, c, _)| allowed(c))
        .min_by(|(_, a, pa), (_, b, pb)| pa.cost.total_cmp(&pb.cost).then(a.load.in_flight.cmp(&b.load.in_flight)))
        .map(|(i, _, _)| i)?;
    Some((best, priced))
}

/// One candidate's price.
fn price(prompt_tokens: usize, c: &Candidate<'_>, costs: &Costs) -> Priced {
    let credit = match c.tier {
        Medium::Gpu => 1.0,
        Medium::Cpu => costs.cpu_credit,
        Medium::Storage | Medium::Other => costs.storage_credit,
    };
    let (warm_tokens, slow) = (c.warm_tokens, c.warm_tokens.saturating_sub(c.gpu_tokens));
    let credited = c.gpu_tokens.min(warm_tokens) as f64 + slow as f64 * credit;
    let own = (prompt_tokens as f64 - credited).max(0.0);
    let queued = c.load.prefill_tokens as f64 + costs.decode_tokens * f64::from(c.load.decoding);
    let knee = costs.queue_knee as f64;
    let cost = costs.queue_weight * queued.min(knee) + (queued - knee).max(0.0) + own;
    Priced { warm_tokens, credited, cost }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmth_wins_until_the_queue_ahead_costs_more_than_the_prefill_it_saves() {
        // The time to first token as it stands: queued work weighed as the prompt's own, no guard.
        let costs = Costs { queue_weight: 1.0, balance_in_flight: u32::MAX, ..Costs::default() };
        let idle = Load::default();
        // Warm and idle against cold and idle: the warm engine.
        let c = [Candidate::new("a", idle).holding(4096, 4096, Medium::Gpu), Candidate::new("b", idle)];
        let (i, priced) = choose(5000, &c, &costs, 1).expect("two candidates");
        assert_eq!(i, 0);
        assert_eq!(priced.first().map(|p| p.cost), Some(904.0));
        // Warm with 3,000 tokens queued: still cheaper (3,904 < 5,000).
        let c =
            [Candidate::new("a", Load::new(2, 3000, 0)).holding(4096, 4096, Medium::Gpu), Candidate::new("b", idle)];
        assert_eq!(choose(5000, &c, &costs, 0).map(|c| c.0), Some(0));
        // Warm with 4,500 queued: the cold idle engine is first to the first token.
        let c =
            [Candidate::new("a", Load::new(2, 4500, 0)).holding(4096, 4096, Medium::Gpu), Candidate::new("b", idle)];
        assert_eq!(choose(5000, &c, &costs, 0).map(|c| c.0), Some(1));
        // Decoding streams count: 20 of them (1,280 tokens) tip it the other way too.
        let c = [Candidate::new("a", Load::new(20, 0, 20)).holding(4096, 4096, Medium::Gpu), Candidate::new("b", idle)];
        assert_eq!(choose(5000, &c, &costs, 0).map(|c| c.0), Some(0));
        let c = [Candidate::new("a", Load::new(70, 0, 70)).holding(4096, 4096, Medium::Gpu), Candidate::new("b", idle)];
        assert_eq!(choose(5000, &c, &costs, 0).map(|c| c.0), Some(1));
    }

    #[test]
    fn the_balance_guard_keeps_a_warm_engine_from_taking_more_than_its_share() {
        let costs = Costs::default();
        assert_eq!((costs.queue_weight, costs.balance_in_flight, costs.balance_ratio), (0.03, 8, 2.0));
        let warm = |in_flight| {
            Candidate::new("a", Load::new(in_flight, 100 * u64::from(in_flight), 0)).holding(4096, 4096, Medium::Gpu)
        };
        let cold = |in_flight| Candidate::new("b", Load::new(in_flight, 0, 0));
        // Within the guard, warmth wins through a queue.
        assert_eq!(choose(5000, &[warm(9), cold(1)], &costs, 0).map(|c| c.0), Some(0));
        // 9 more in flight than the least busy engine, and more than twice its count: not chosen.
        assert_eq!(choose(5000, &[warm(10), cold(1)], &costs, 0).map(|c| c.0), Some(1));
        // 9 more, but not twice as many: allowed.
        assert_eq!(choose(5000, &[warm(19), cold(10)], &costs, 0).map(|c| c.0), Some(0));
        // No guard: the warm engine however busy.
        let unguarded = Costs { balance_in_flight: u32::MAX, ..Costs::default() };
        assert_eq!(choose(5000, &[warm(40), cold(0)], &unguarded, 0).map(|c| c.0), Some(0));
    }

    #[test]
    fn queued_work_past_the_knee_weighs_fully() {
        let costs = Costs { queue_knee: 10_000, balance_in_flight: u32::MAX, ..Costs::default() };
        let warm = |queued| Candidate::new("a", Load::new(1, queued, 0)).holding(4096, 4096, Medium::Gpu);
        let cold = Candidate::new("b", Load::default());
        // Within the knee, weighed 0.03: 9,000 queued cost 270, and the warm engine wins.
        let (i, priced) = choose(5000, &[warm(9000), cold.clone()], &costs, 0).expect("two candidates");
        assert_eq!((i, priced.first().map(|p| p.cost)), (0, Some(0.03 * 9000.0 + 904.0)));
        // 15,000 queued: 300 for the first 10,000, then 5,000 in full; the cold engine (5,000) wins.
        let (i, priced) = choose(5000, &[warm(15_000), cold.clone()], &costs, 0).expect("two candidates");
        assert_eq!((i, priced.first().map(|p| p.cost)), (1, Some(300.0 + 5000.0 + 904.0)));
        // Without the knee, the same queue keeps the request warm.
        assert_eq!(choose(5000, &[warm(15_000), cold], &Costs::default(), 0).map(|c| c.0), Some(0));
    }

    #[test]
    fn slower_tiers_are_credited_partly_and_ties_go_round_robin() {
        let costs = Costs::default();
        let c = [Candidate::new("a", Load::default()).holding(1024, 512, Medium::Cpu)];
        let (_, priced) = choose(2048, &c, &costs, 0).expect("one candidate");
        assert_eq!(priced.first().map(|p| (p.warm_tokens, p.credited)), Some((1024, 512.0 + 0.8 * 512.0)));
        // Equal engines: the turn picks, so a counter spreads them.
        let idle = Load::default();
        let c = [Candidate::new("a", idle), Candidate::new("b", idle), Candidate::new("c", idle)];
        let picks: Vec<usize> = (0..6).filter_map(|t| choose(100, &c, &costs, t).map(|c| c.0)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        // Equal cost: fewer in flight first.
        let c = [Candidate::new("a", Load::new(3, 0, 0)), Candidate::new("b", Load::new(1, 0, 0))];
        assert_eq!(choose(100, &c, &costs, 0).map(|c| c.0), Some(1));
        assert_eq!(choose(100, &[], &costs, 0).map(|c| c.0), None);
    }
}
