//! How much of a prompt a hybrid-attention engine reuses from its KV cache groups: vLLM 0.33's
//! rule (`HybridKVCacheCoordinator.find_longest_cache_hit`, vllm/v1/core/kv_cache_coordinator.py,
//! with each kind's `find_longest_cache_hit` in single_type_kv_cache_manager.py), over what each
//! group holds of the prompt's blocks.
//!
//! Groups of one spec are looked up together: a block counts only if every one of them holds it.
//! Full attention goes first and takes the longest run of held blocks from the prompt's start; each
//! other spec then accepts that length or shortens it, and the specs are asked again until the
//! length stops shrinking (once is enough for one full spec and one other). The lookup is capped
//! at the prompt's length less one token (the engine computes the last token again). This is the
//! case where every group has the same block size (the alignment is then a block); vLLM's
//! finer-grained hits across block sizes are not modelled: [`reuse`] answers `None` for them.

/// What a spec needs held of a prompt for the engine to reuse its first `n` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Need {
    /// Every block before `n` (full attention).
    All,
    /// The `cdiv(window - 1, block_size)` blocks before `n` (sliding window); or, with no such
    /// run anywhere, a run from the first block.
    Window {
        /// The window, in tokens.
        window: usize,
    },
    /// The blocks from the start of the chunk the lookup ends in (chunked local attention; the
    /// chunk is the model's, not in the events: [`crate::Builder::attention_chunk`]).
    Chunk {
        /// The attention chunk, in tokens.
        chunk: usize,
    },
    /// The block just before `n` (a Mamba-like state).
    State,
}

/// A spec: what its groups need, and their block size in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spec {
    pub need: Need,
    pub block_size: usize,
}

/// The tokens of a prompt of `tokens` tokens that the engine reuses, by vLLM's rule, where
/// `held(s, i)` says whether every group of `specs[s]` holds block `i` of the prompt (blocks of
/// that spec's size, from the first). `None` for specs this rule does not model: none, block
/// sizes that differ, a block size or a window of 0.
pub(crate) fn reuse(specs: &[Spec], tokens: usize, mut held: impl FnMut(usize, usize) -> bool) -> Option<usize> {
    let block_size = specs.first()?.block_size;
    let modelled = |s: &Spec| {
        s.block_size == block_size
            && match s.need {
                Need::Window { window } => window > 0,
                Need::Chunk { chunk } => chunk > 0,
                Need::All | Need::State => true,
            }
    };
    if block_size == 0 || !specs.iter().all(modelled) {
        return None;
    }
    // Full attention first (vLLM sorts its specs so); a stable sort keeps the others in order.
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by_key(|&s| specs.get(s).is_none_or(|spec| spec.need != Need::All));
    let simple = specs.len() == 2 && specs.get(order.first().copied()?).is_some_and(|s| s.need == Need::All);
    let max_blocks = tokens.saturating_sub(1) / block_size;
    // Full attention's hit, looked up once: a shorter length only trims it.
    let mut full_hit: Vec<Option<usize>> = vec![None; specs.len()];
    let mut hit = max_blocks;
    loop {
        let mut current = hit;
        for &s in &order {
            let spec = specs.get(s)?;
            let found = match (spec.need, full_hit.get(s).copied().flatten()) {
                (Need::All, Some(blocks)) => blocks,
                (Need::All, None) => {
                    let blocks = (0..current).take_while(|&i| held(s, i)).count();
                    if let Some(slot) = full_hit.get_mut(s) {
                        *slot = Some(blocks);
                    }
                    blocks
                }
                (Need::Window { window }, _) => {
                    window_hit(window.saturating_sub(1).div_ceil(block_size), current, |i| held(s, i))
                }
                (Need::Chunk { chunk }, _) => {
                    let start = current * block_size / chunk * chunk / block_size;
                    start + (start..current).take_while(|&i| held(s, i)).count()
                }
                (Need::State, _) => (0..current).rev().find(|&i| held(s, i)).map_or(0, |i| i + 1),
            };
            current = current.min(found);
        }
        if current >= hit {
            break;
        }
        hit = current;
        if simple {
            break;
        }
    }
    Some(hit * block_size)
}

/// A sliding window's hit within the first `max` blocks: the rightmost run of `needed` held
/// blocks ends it; with none, the run of held blocks from the first.
fn window_hit(needed: usize, max: usize, mut held: impl FnMut(usize) -> bool) -> usize {
    let mut run = 0;
    for i in (0..max).rev() {
        if held(i) {
            run += 1;
            if run >= needed {
                return i + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    fn spec(need: Need) -> Spec {
        Spec { need, block_size: 16 }
    }

    /// Held blocks of each spec as sets of block indices.
    fn reuse_of(specs: &[Spec], tokens: usize, held: &[&[usize]]) -> Option<usize> {
        reuse(specs, tokens, |s, i| held.get(s).is_some_and(|h| h.contains(&i)))
    }

    #[test]
    fn full_attention_alone_is_the_run_from_the_start_short_of_the_last_token() {
        let full = [spec(Need::All)];
        assert_eq!(reuse_of(&full, 16 * 10, &[&[0, 1, 2, 3, 5]]), Some(64));
        let all: Vec<usize> = (0..10).collect();
        // A prompt of exactly 10 blocks reuses 9: its last token is computed again.
        assert_eq!(reuse_of(&full, 16 * 10, &[&all]), Some(16 * 9));
        assert_eq!(reuse_of(&full, 16 * 10 + 1, &[&all]), Some(16 * 10));
    }

    /// The observed engine's case (hybrid-events.md): full attention holds 11 blocks, the
    /// sliding group (window 64: 4 blocks of 16 needed) only blocks 3-6 and 9-10 around the
    /// earlier prompt's end: the rightmost run of 4 held ends at block 6, so 7 blocks.
    #[test]
    fn a_sliding_window_takes_the_rightmost_run_it_holds_whole() {
        let specs = [spec(Need::All), spec(Need::Window { window: 64 })];
        let full: Vec<usize> = (0..11).collect();
        assert_eq!(reuse_of(&specs, 16 * 20, &[&full, &[3, 4, 5, 6, 9, 10]]), Some(16 * 7));
        // With no run of 4 anywhere, the run from block 0 counts.
        assert_eq!(reuse_of(&specs, 16 * 20, &[&full, &[0, 1, 5, 9, 10]]), Some(32));
        assert_eq!(reuse_of(&specs, 16 * 20, &[&full, &[]]), Some(0));
        // Window 65 needs cdiv(64, 16) = 4 blocks too; window 66 needs 5.
        let wider = [spec(Need::All), spec(Need::Window { window: 66 })];
        assert_eq!(reuse_of(&wider, 16 * 20, &[&full, &[3, 4, 5, 6, 9, 10]]), Some(0));
    }

    #[test]
    fn mamba_takes_its_last_held_state_and_chunks_their_own_start() {
        let full: Vec<usize> = (0..11).collect();
        let mamba = [spec(Need::All), spec(Need::State)];
        assert_eq!(reuse_of(&mamba, 16 * 20, &[&full, &[2, 7, 15]]), Some(16 * 8), "15 is past the full hit");
        // Chunks of 64 tokens (4 blocks): full attention's 11 blocks end in the chunk that
        // starts at block 8, whose blocks are needed from there.
        let chunked = [spec(Need::All), spec(Need::Chunk { chunk: 64 })];
        assert_eq!(reuse_of(&chunked, 16 * 20, &[&full, &[8, 9, 10]]), Some(16 * 11));
        assert_eq!(reuse_of(&chunked, 16 * 20, &[&full, &[8, 10]]), Some(16 * 9));
        // A length on a chunk's start needs none of it.
        let twelve: Vec<usize> = (0..12).collect();
        assert_eq!(reuse_of(&chunked, 16 * 20, &[&twelve, &[]]), Some(16 * 12));
    }

    /// Three specs are asked again until the length stops shrinking: a window's hit can make
    /// the state's shorter, and the state's the window's.
    #[test]
    fn several_specs_settle_on_a_length_every_one_accepts() {
        let specs = [spec(Need::All), spec(Need::Window { window: 32 }), spec(Need::State)];
        let full: Vec<usize> = (0..20).collect();
        // Window: 2 blocks. It holds 14-15 and 6-7; the state is held at 7 and 3.
        let got = reuse_of(&specs, 16 * 30, &[&full, &[6, 7, 14, 15], &[3, 7]]);
        // 20 → window 16 → state 8 → window 8 → state 8: 8 blocks.
        assert_eq!(got, Some(16 * 8));
        let got = reuse_of(&specs, 16 * 30, &[&full, &[2, 3, 14, 15], &[7]]);
        // 20 → window 16 → state 8 → window 4 → state 0 (not 7: past 4) → 0.
        assert_eq!(got, Some(0));
    }

    #[test]
    fn layouts_it_does_not_model_are_refused() {
        assert_eq!(reuse_of(&[], 100, &[]), None);
        let mixed = [spec(Need::All), Spec { need: Need::State, block_size: 32 }];
        assert_eq!(reuse_of(&mixed, 100, &[&[0], &[0]]), None);
        assert_eq!(reuse_of(&[spec(Need::Window { window: 0 })], 100, &[&[0]]), None);
    }
}
