//! What an offloading connector loads on top of a hybrid engine's GPU hit: vLLM 0.33's
//! `OffloadingConnectorScheduler._lookup_complete_chunks`
//! (vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py 849-1054), over the
//! chunks its CPU memory holds in each group.
//!
//! The connector keeps a prompt's whole chunks (`blocks_per_chunk` engine blocks, 1 by default),
//! each under the hash of its last block, per group. The scheduler asks it from the GPU hit on:
//! a full-attention group needs every chunk from there; a sliding window, chunked local
//! attention or a Mamba state needs its last `window` chunks before the hit's end (or a run from
//! the GPU hit's own end, the GPU holding what comes before), scanned from the right. Full
//! attention goes first, then the others by window, widest first, and these are asked again
//! while one shortens the hit. Anything less than one chunk past the GPU hit loads nothing.

/// What a group needs of the connector's chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Every chunk from the GPU hit on (full attention).
    All,
    /// A run of `chunks` chunks ending at the hit's end (`window_size_in_chunks`); `tokens`: a
    /// sliding window's own size, whose first run may need one chunk more when the hit's end is
    /// not on a chunk's.
    Window { chunks: usize, tokens: Option<usize> },
}

impl Reach {
    fn window(self) -> Option<usize> {
        match self {
            Reach::All => None,
            Reach::Window { chunks, .. } => Some(chunks),
        }
    }
}

/// One offloaded group: what it needs, and whether it is a Mamba state (the hit then ends on a
/// chunk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Offloaded {
    pub reach: Reach,
    pub mamba: bool,
}

/// The tokens the connector loads past a GPU hit of `gpu` tokens for a prompt of `prompt`
/// tokens, in chunks of `chunk` tokens, where `held(g, c)` says whether group `groups[g]` holds
/// chunk `c` of the prompt in CPU memory. 0 when it loads nothing.
pub(crate) fn loaded(
    groups: &[Offloaded],
    chunk: usize,
    prompt: usize,
    gpu: usize,
    mut held: impl FnMut(usize, usize) -> bool,
) -> usize {
    if chunk == 0 || groups.is_empty() {
        return 0;
    }
    let mut max_hit = prompt;
    if groups.iter().any(|g| g.reach != Reach::All) {
        max_hit = max_hit.saturating_sub(1);
        if groups.iter().any(|g| g.mamba) {
            max_hit = max_hit / chunk * chunk;
        }
    }
    // Full attention first, in the engine's order; then the others, widest window first.
    let full: Vec<usize> =
        (0..groups.len()).filter(|&g| groups.get(g).is_some_and(|x| x.reach == Reach::All)).collect();
    let mut windows: Vec<usize> = (0..groups.len()).filter(|g| !full.contains(g)).collect();
    windows.sort_by_key(|&g| std::cmp::Reverse(groups.get(g).and_then(|x| x.reach.window()).unwrap_or(0)));
    let keys = prompt / chunk;
    let start = gpu / chunk;
    let mut hit = 0;
    let mut lookup: Vec<usize> = full.iter().chain(&windows).copied().collect();
    while !lookup.is_empty() {
        let mut looked_window = false;
        for g in std::mem::take(&mut lookup) {
            let Some(group) = groups.get(g) else { return 0 };
            max_hit = max_hit.min(keys * chunk);
            if max_hit < gpu + chunk {
                return 0;
            }
            let chunks = max_hit.div_ceil(chunk).min(keys);
            let n = match group.reach {
                Reach::All => (start..chunks).take_while(|&c| held(g, c)).count(),
                Reach::Window { chunks: needed, tokens } => {
                    let end = max_hit.min(chunks * chunk);
                    // The first run, ending at the hit's end, may need one chunk more.
                    let first = match tokens {
                        Some(w) => needed.max((w.saturating_sub(1) + (chunk - end % chunk) % chunk).div_ceil(chunk)),
                        None => needed,
                    };
                    let (mut need, mut run, mut found) = (first, 0, None);
                    for c in (start..chunks).rev() {
                        if held(g, c) {
                            run += 1;
                        } else {
                            run = 0;
                            need = needed;
                        }
                        if run == need {
                            found = Some(c - start + need);
                            break;
                        }
                    }
                    found.unwrap_or(run)
                }
            };
            if n == 0 {
                return 0;
            }
            max_hit = max_hit.min(chunk * (start + n));
            if max_hit < gpu + chunk {
                return 0;
            }
            let new = max_hit - gpu;
            if new < hit && looked_window && lookup.is_empty() {
                lookup.clone_from(&windows);
            }
            looked_window |= group.reach != Reach::All;
            hit = new;
        }
    }
    hit
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: Offloaded = Offloaded { reach: Reach::All, mamba: false };
    const MAMBA: Offloaded = Offloaded { reach: Reach::Window { chunks: 1, tokens: None }, mamba: true };

    fn sliding(window: usize, chunk: usize) -> Offloaded {
        Offloaded { reach: Reach::Window { chunks: window.div_ceil(chunk), tokens: Some(window) }, mamba: false }
    }

    fn loaded_of(groups: &[Offloaded], prompt: usize, gpu: usize, held: &[&[usize]]) -> usize {
        loaded(groups, 16, prompt, gpu, |g, c| held.get(g).is_some_and(|h| h.contains(&c)))
    }

    #[test]
    fn full_attention_loads_the_chunks_right_after_the_gpu_hit() {
        let all: Vec<usize> = (0..20).collect();
        // 20 chunks held, a prompt of 20 chunks and 5 tokens: everything past the GPU's 4.
        assert_eq!(loaded_of(&[FULL], 16 * 20 + 5, 64, &[&all]), 16 * 16);
        // A gap right after the GPU hit: nothing, whatever follows.
        let gap: Vec<usize> = (5..20).collect();
        assert_eq!(loaded_of(&[FULL], 16 * 20 + 5, 64, &[&gap]), 0);
        // Full attention alone has no len-1 cap: the last whole chunk counts.
        assert_eq!(loaded_of(&[FULL], 16 * 20, 0, &[&all]), 16 * 20);
    }

    #[test]
    fn a_sliding_window_needs_its_last_chunks_before_the_hits_end() {
        let specs = [FULL, sliding(128, 16)];
        let all: Vec<usize> = (0..30).collect();
        // The window holds chunks 10-17 only: its rightmost run of 8 ends at chunk 17, so the
        // hit ends at 18 chunks.
        let window: Vec<usize> = (10..18).collect();
        assert_eq!(loaded_of(&specs, 16 * 30, 0, &[&all, &window]), 16 * 18);
        // No run of 8: the run from the GPU hit's end counts (chunks 0-2).
        assert_eq!(loaded_of(&specs, 16 * 30, 0, &[&all, &[0, 1, 2, 20, 21]]), 16 * 3);
        // From a GPU hit of 4 chunks, a run of 7 up to the end is not enough, nor from chunk 4.
        let seven: Vec<usize> = (23..30).collect();
        assert_eq!(loaded_of(&specs, 16 * 30, 64, &[&all, &seven]), 0);
        // The full group's gap at chunk 12 caps the hit at 12 chunks; the window is asked there.
        let gap: Vec<usize> = (0..30).filter(|&c| c != 12).collect();
        let early: Vec<usize> = (4..12).collect();
        assert_eq!(loaded_of(&specs, 16 * 30, 64, &[&gap, &early]), 16 * 12 - 64);
    }

    #[test]
    fn mamba_ends_on_a_chunk_and_less_than_a_chunk_past_the_gpu_loads_nothing() {
        let specs = [MAMBA, FULL];
        let all: Vec<usize> = (0..20).collect();
        // The state is held after chunks 7 and 12: the hit ends at 13 chunks.
        assert_eq!(loaded_of(&specs, 16 * 20 + 3, 32, &[&[7, 12], &all]), 16 * 13 - 32);
        // The GPU already holds 13 chunks less 8 tokens: under a chunk more, nothing.
        assert_eq!(loaded_of(&specs, 16 * 20 + 3, 16 * 13 - 8, &[&[12], &all]), 0);
    }
}
