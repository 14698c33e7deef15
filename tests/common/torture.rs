//! The torture writer's workload, shared by the writer (`tests/helpers/torture_writer.rs`) and
//! the tests that check what survived it.

use superfluid_warm::tools::trace;

/// Requests the writer cycles through.
pub const CYCLE: usize = 5000;

/// The writer's prompts for `seed`, in the order it runs them: the first 24 blocks of each
/// request of `trace::synthetic(CYCLE, 16, seed)`.
pub fn prompts(seed: u64) -> Vec<Vec<u32>> {
    trace::synthetic(CYCLE, 16, seed)
        .iter()
        .map(|r| {
            let mut tokens = r.tokens();
            tokens.truncate(64 * 24);
            tokens
        })
        .collect()
}
