//! What rendering a request into tokens costs the head (issue 42's decision overhead, its
//! tokenization part): `Renderer::chat` (the chat template, then the tokenizer) on chats of
//! about 1,000 and 8,000 tokens, against the `tokenizers` crate encoding the same rendered text
//! whole (the anchor: "no slower than `tokenizers` itself"), in the same run: new chats (text
//! the renderer never saw), and next turns (a chat it rendered before, one exchange longer: the
//! pieces it kept are not tokenized again). `cargo bench --bench render` prints each one's p50
//! and p99 per call over 5 runs, and the ratio.

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
/// included), as a list of messages; `seed` starts it with a word of its own, so that no two
/// seeds share a piece of text.
fn chat(words: usize, seed: usize) -> Vec<serde_json::Value> {
    let vocabulary = ["the", "cache", "prefix", "router", "engine", "naïve", "中文字符", "emoji 😀", "block", "window"];
    let turn = |n: usize, seed: usize| {
        (0..n).map(|i| vocabulary[(i * 7 + seed) % vocabulary.len()]).collect::<Vec<_>>().join(" ")
    };
    let per = words / 4;
    vec![
        serde_json::json!({"role": "system", "content": format!("s{seed} {}", turn(per / 4, 1))}),
        serde_json::json!({"role": "user", "content": turn(per, 2)}),
        serde_json::json!({"role": "assistant", "content": turn(per, 3)}),
        serde_json::json!({"role": "user", "content": turn(per + per * 3 / 4, 4)}),
    ]
}

/// p50 and p99 of `f`'s time per call (given the call's number), in µs, over `CALLS` calls.
fn time(mut f: impl FnMut(usize)) -> (f64, f64) {
    let mut samples: Vec<f64> = (0..CALLS)
        .map(|i| {
            let t = Instant::now();
            f(i);
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    (samples[CALLS / 2], samples[CALLS * 99 / 100])
}

/// (min, max) of one figure over the runs.
fn spread(v: &[(f64, f64)], pick: fn(&(f64, f64)) -> f64) -> (f64, f64) {
    let xs: Vec<f64> = v.iter().map(pick).collect();
    (xs.iter().copied().fold(f64::INFINITY, f64::min), xs.iter().copied().fold(0.0, f64::max))
}

fn report(what: &str, ours: &[(f64, f64)], anchor: &[(f64, f64)]) {
    let (o50, a50) = (spread(ours, |t| t.0), spread(anchor, |t| t.0));
    let (o99, a99) = (spread(ours, |t| t.1), spread(anchor, |t| t.1));
    let ratios: Vec<f64> = ours.iter().zip(anchor).map(|(o, a)| o.0 / a.0).collect();
    println!(
        "{what}: Renderer::chat p50 {:.1}-{:.1} µs, p99 {:.1}-{:.1}; tokenizers' encode of the whole rendered text p50 {:.1}-{:.1} µs, p99 {:.1}-{:.1}; ratio (p50, per run) {:.2}-{:.2}x",
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

fn main() {
    for name in ["chatml", "qwen25"] {
        let renderer = Renderer::open(model(name)).expect("the model");
        let tokenizer = tokenizers::Tokenizer::from_file(model(name).join("tokenizer.json")).expect("tokenizer.json");
        for words in [700, 5_600] {
            // New chats: every call's text is new to the renderer (no piece kept helps).
            let (mut ours, mut anchor) = (Vec::new(), Vec::new());
            let mut tokens = 0;
            for run in 0..RUNS {
                let chats: Vec<String> =
                    (0..CALLS).map(|i| serde_json::Value::from(chat(words, run * CALLS + i)).to_string()).collect();
                let texts: Vec<String> =
                    chats.iter().map(|c| renderer.render_chat(c, None, true).expect("renders")).collect();
                let fresh = Renderer::open(model(name)).expect("the model");
                for (c, t) in chats.iter().zip(&texts).take(3) {
                    let ids = fresh.chat(c, None, true).expect("tokens");
                    assert_eq!(tokenizer.encode(t.as_str(), false).expect("encodes").get_ids(), ids.as_slice());
                    tokens = ids.len();
                }
                ours.push(time(|i| {
                    black_box(renderer.chat(black_box(&chats[i]), None, true).expect("tokens"));
                }));
                anchor.push(time(|i| {
                    black_box(tokenizer.encode(black_box(texts[i].as_str()), false).expect("encodes"));
                }));
            }
            report(&format!("{name}, new chats of {tokens} tokens"), &ours, &anchor);
            // Next turns: each call is an earlier call's chat with one more exchange, as a
            // client sends a conversation's history again.
            let (mut ours, mut anchor) = (Vec::new(), Vec::new());
            for run in 0..RUNS {
                let base = 1_000_000 + run * CALLS;
                let earlier: Vec<String> =
                    (0..CALLS).map(|i| serde_json::Value::from(chat(words, base + i)).to_string()).collect();
                let next: Vec<String> = (0..CALLS)
                    .map(|i| {
                        let mut m = chat(words, base + i);
                        m.push(serde_json::json!({"role": "assistant", "content": "the engine holds the block"}));
                        m.push(serde_json::json!({"role": "user", "content": "and the window naïve 中文字符?"}));
                        serde_json::Value::from(m).to_string()
                    })
                    .collect();
                let texts: Vec<String> =
                    next.iter().map(|c| renderer.render_chat(c, None, true).expect("renders")).collect();
                for c in &earlier {
                    black_box(renderer.chat(c, None, true).expect("tokens"));
                }
                ours.push(time(|i| {
                    black_box(renderer.chat(black_box(&next[i]), None, true).expect("tokens"));
                }));
                anchor.push(time(|i| {
                    black_box(tokenizer.encode(black_box(texts[i].as_str()), false).expect("encodes"));
                }));
            }
            report(&format!("{name}, next turns of ~{tokens} tokens"), &ours, &anchor);
        }
    }
}
