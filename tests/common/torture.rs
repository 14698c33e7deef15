//! The torture writer's workload, shared by the writer (`tests/helpers/torture_writer.rs`) and
//! the tests that check what survived it.

use harness::trace;

/// Requests the writer cycles through.
pub const CYCLE: usize = 5000;

/// Tokens of each prompt the writer runs (24 blocks).
pub const PROMPT_TOKENS: usize = 64 * 24;

/// The writer's prompts for `seed`, in the order it runs them: the first 24 blocks of each
/// request of `trace::synthetic(CYCLE, 16, seed)`.
pub fn prompts(seed: u64) -> Vec<Vec<u32>> {
    trace::synthetic(CYCLE, 16, seed)
        .iter()
        .map(|r| {
            // Only the prefix is made: the whole prompts are ~30,000 tokens each.
            let short = trace::Request { input_length: r.input_length.min(PROMPT_TOKENS), ..r.clone() };
            short.tokens()
        })
        .collect()
}

/// Ran `i`'s prompt when the writer runs `--distinct`: `prompt` with every token past the first
/// two blocks made unique to `i`, so that each ran writes 22 new blocks (churn and eviction).
pub fn distinct(prompt: &[u32], i: usize) -> Vec<u32> {
    prompt.iter().enumerate().map(|(t, &tok)| if t < 128 { tok } else { tok ^ ((i as u32 + 1) << 20) }).collect()
}
