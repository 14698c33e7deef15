//! What rendering a request into tokens costs the head (issue 42's decision overhead, its
//! tokenization part): `Renderer::chat` (the chat template, then the tokenizer) on chats of
//! about 1,000 and 8,000 tokens, against the `tokenizers` crate encoding the same rendered text
//! alone (the anchor: "no slower than `tokenizers` itself"), in the same run. `cargo bench
//! --bench render` prints each one's p50 and p99 per call over 5 runs, and the ratio.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Instant;

use superfluid_warm::Renderer;

/// Calls a run; runs.
const CALLS: usize = 200;
const RUNS: usize = 5;

fn model(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/render").join(name)
}

/// A chat of about `words` words over a few turns (the fixtures' own vocabulary, Unicode
/// included), as JSON text.
fn chat(words: usize) -> String {
    let vocabulary = ["the", "cache", "prefix", "router", "engine", "naïve", "中文字符", "emoji 😀", "block", "window"];
    let turn = |n: usize, seed: usize| {
        (0..n).map(|i| vocabulary[(i * 7 + seed) % vocabulary.len()]).collect::<Vec<_>>().join(" ")
    };
    let per = words / 4;
    let messages = serde_json::json!([
        {"role": "system", "content": turn(per / 4, 1)},
        {"role": "user", "content": turn(per, 2)},
        {"role": "assistant", "content": turn(per, 3)},
        {"role": "user", "content": turn(per + per * 3 / 4, 4)},
    ]);
    messages.to_string()
}

/// p50 and p99 of `f`'s time per call, in µs, over `CALLS` calls.
fn time(mut f: impl FnMut()) -> (f64, f64) {
    let mut samples: Vec<f64> = (0..CALLS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    (samples[CALLS / 2], samples[CALLS * 99 / 100])
}

fn main() {
    for name in ["chatml", "qwen25"] {
        let renderer = Renderer::open(model(name)).expect("the model");
        let tokenizer = tokenizers::Tokenizer::from_file(model(name).join("tokenizer.json")).expect("tokenizer.json");
        for words in [700, 5_600] {
            let messages = chat(words);
            let text = renderer.render_chat(&messages, None, true).expect("renders");
            let ids = renderer.chat(&messages, None, true).expect("tokens");
            assert_eq!(tokenizer.encode(text.as_str(), false).expect("encodes").get_ids(), ids.as_slice());
            let (mut ours, mut anchor) = (Vec::new(), Vec::new());
            for _ in 0..RUNS {
                ours.push(time(|| {
                    black_box(renderer.chat(black_box(&messages), None, true).expect("tokens"));
                }));
                anchor.push(time(|| {
                    black_box(tokenizer.encode(black_box(text.as_str()), false).expect("encodes"));
                }));
            }
            let spread = |v: &[(f64, f64)], pick: fn(&(f64, f64)) -> f64| {
                let xs: Vec<f64> = v.iter().map(pick).collect();
                (xs.iter().copied().fold(f64::INFINITY, f64::min), xs.iter().copied().fold(0.0, f64::max))
            };
            let (o50, a50) = (spread(&ours, |t| t.0), spread(&anchor, |t| t.0));
            let (o99, a99) = (spread(&ours, |t| t.1), spread(&anchor, |t| t.1));
            let ratios: Vec<f64> = ours.iter().zip(&anchor).map(|(o, a)| o.0 / a.0).collect();
            println!(
                "{name}, {} tokens: Renderer::chat p50 {:.1}-{:.1} µs, p99 {:.1}-{:.1}; tokenizers' encode of the rendered text p50 {:.1}-{:.1} µs, p99 {:.1}-{:.1}; ratio (p50, per run) {:.2}-{:.2}x",
                ids.len(),
                o50.0,
                o50.1,
                o99.0,
                o99.1,
                a50.0,
                a50.1,
                a99.0,
                a99.1,
                ratios.iter().copied().fold(f64::INFINITY, f64::min),
                ratios.iter().copied().fold(0.0, f64::max),
            );
        }
    }
}
