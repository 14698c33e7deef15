//! Text tokenized in pieces, and the pieces of recent prompts kept: a conversation's next turn
//! sends its history again, and only what is new is tokenized.
//!
//! A tokenizer of the families below encodes a text as the concatenation of its pieces' encodings
//! when every cut is just before a space that follows a letter or digit:
//! - added tokens are found in the raw text first; none holds a space, and none that eats the
//!   space after it ends in a letter or digit, so none spans or moves a cut;
//! - the normalizers kept (Unicode forms, lowercase, BERT's) work char by char or between
//!   starters, and a space is a starter that composes with nothing;
//! - every pre-tokenizer kept ends a match at a space that follows a letter or digit and starts
//!   the next one there, with no look past it (GPT-2's byte-level regex and the Llama 3, Qwen 2
//!   and GPT-4o splits, whitespace, BERT's, Metaspace with its splits); a piece that starts with
//!   its space gets no prefix space, so Metaspace's and byte-level's prefix rules agree;
//! - the models (BPE, WordPiece, WordLevel, Unigram) encode each pre-token alone.
//!
//! Any other tokenizer is encoded whole, as `tokenizers` does it. The special tokens a completion
//! adds are taken from the post-processor by encoding two probes; a post-processor that does
//! more than add tokens around the text, truncation or padding, turn the pieces off.
//!
//! Pieces end at the first cut at or after every [`STRIDE`] bytes, so two texts with a common
//! start cut it alike. A piece is kept under the chained BLAKE3 hash of the text up to its end
//! (the previous piece's key and its bytes), as prompt blocks are, and the pieces used least
//! recently go past [`KEPT_IDS`] ids: a conversation whose history comes back every turn keeps
//! it, however many new prompts came between its turns.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use serde_json::Value;

/// Bytes of text between the cuts (a cut is the first allowed place at or after each multiple).
pub(crate) const STRIDE: usize = 1024;

/// The ids the kept pieces may hold together (128 MiB of ids: on the conversation trace a
/// history comes back 30-100 s after its last turn, after ~8M ids of other text at its pace).
pub(crate) const KEPT_IDS: usize = 1 << 25;

/// The pre-tokenizer splits kept, as `tokenizer.json` writes them: Llama 3's (and OpenAI's
/// cl100k), Qwen 2's, and GPT-4o's (o200k).
const SPLITS: [&str; 3] = [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// A tokenizer's encoding in pieces, with the pieces of recent texts kept.
pub(crate) struct Pieces {
    /// The ids a completion's special tokens put before and after the text (`None`: the
    /// post-processor does more, and such a completion is encoded whole).
    around: Option<(Vec<u32>, Vec<u32>)>,
    kept: Mutex<Kept>,
    /// Pieces found kept, since the start.
    reused: AtomicU64,
}

/// The kept pieces: each piece's ids by the key of the text up to its end, the least recently
/// used first out.
struct Kept {
    /// Each piece's ids, and the stamp of its last use.
    ids: HashMap<[u8; 32], (Arc<[u32]>, u64)>,
    /// Keys with the stamp each had then, oldest first; one whose piece has a later stamp since
    /// (used again) or is gone is passed over.
    order: VecDeque<([u8; 32], u64)>,
    /// Ids the pieces hold together.
    held: usize,
    /// The last stamp given.
    stamp: u64,
    /// At most this many ids held.
    limit: usize,
}

impl Pieces {
    /// The pieces for a tokenizer, if its `tokenizer.json` (`config`) is of the families that
    /// encode piece by piece; `None` otherwise.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer, config: &Value) -> Option<Pieces> {
        let cuttable = tokenizer.get_truncation().is_none()
            && tokenizer.get_padding().is_none()
            && normalizer_kept(config.get("normalizer"))
            && pre_tokenizer_kept(config.get("pre_tokenizer"))
            && model_kept(config.get("model"))
            && added_tokens_kept(config.get("added_tokens"));
        if !cuttable {
            return None;
        }
        Some(Pieces { around: around(tokenizer), kept: Mutex::new(Kept::new(KEPT_IDS)), reused: AtomicU64::new(0) })
    }

    /// `text`'s ids as `tokenizer.encode_fast(text, add_special_tokens)` gives them.
    ///
    /// `step` is given the ids so far, the bytes of `text` they encode and `text`'s length,
    /// before each piece tokenized but the first (pieces found kept go by without a step).
    ///
    /// # Errors
    /// The tokenizer's own error.
    pub(crate) fn encode(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        add_special_tokens: bool,
        step: &mut dyn FnMut(&[u32], usize, usize),
    ) -> tokenizers::Result<Vec<u32>> {
        let (before, after): (&[u32], &[u32]) = match (&self.around, add_special_tokens) {
            (_, false) => (&[], &[]),
            (Some((before, after)), true) => (before, after),
            (None, true) => return Ok(tokenizer.encode_fast(text, true)?.get_ids().to_vec()),
        };
        let mut out = Vec::with_capacity(before.len() + text.len() / 3 + after.len());
        out.extend_from_slice(before);
        // Each piece's key, and its ids if kept; the first piece not kept ends the walk.
        let mut pieces = Vec::new();
        let mut key = *blake3::hash(b"superfluid-warm render pieces").as_bytes();
        let mut start = 0;
        for end in cuts(text) {
            let piece = text.get(start..end).unwrap_or_default();
            let mut hasher = blake3::Hasher::new();
            hasher.update(&key).update(piece.as_bytes());
            key = *hasher.finalize().as_bytes();
            pieces.push((key, start, end));
            start = end;
        }
        let mut found = 0;
        if let Ok(mut kept) = self.kept.lock() {
            for (key, _, _) in &pieces {
                let Some(ids) = kept.used(key) else { break };
                out.extend_from_slice(&ids);
                found += 1;
            }
        }
        self.reused.fetch_add(found as u64, Relaxed);
        let mut new = Vec::new();
        for &(key, start, end) in pieces.get(found..).unwrap_or_default() {
            if start > 0 {
                step(&out, start, text.len());
            }
            let encoding = tokenizer.encode_fast(text.get(start..end).unwrap_or_default(), false)?;
            let ids: Arc<[u32]> = encoding.get_ids().into();
            out.extend_from_slice(&ids);
            new.push((key, ids));
        }
        if !new.is_empty()
            && let Ok(mut kept) = self.kept.lock()
        {
            kept.keep(new);
        }
        out.extend_from_slice(after);
        Ok(out)
    }

    /// Pieces found kept (not tokenized again), since the start.
    pub(crate) fn reused(&self) -> u64 {
        self.reused.load(Relaxed)
    }
}

impl Kept {
    fn new(limit: usize) -> Kept {
        Kept { ids: HashMap::new(), order: VecDeque::new(), held: 0, stamp: 0, limit }
    }

    /// Piece `key`'s ids, if kept, now its most recently used.
    fn used(&mut self, key: &[u8; 32]) -> Option<Arc<[u32]>> {
        self.stamp += 1;
        let (ids, stamp) = self.ids.get_mut(key)?;
        *stamp = self.stamp;
        let ids = Arc::clone(ids);
        self.order.push_back((*key, self.stamp));
        self.compact();
        Some(ids)
    }

    /// Keeps `pieces` as the most recently used, then lets the least recently used go past the
    /// limit.
    fn keep(&mut self, pieces: Vec<([u8; 32], Arc<[u32]>)>) {
        for (key, ids) in pieces {
            self.stamp += 1;
            let n = ids.len();
            if let Some((before, _)) = self.ids.insert(key, (ids, self.stamp)) {
                self.held -= before.len();
            }
            self.held += n;
            self.order.push_back((key, self.stamp));
        }
        while self.held > self.limit {
            let Some((key, stamp)) = self.order.pop_front() else { break };
            if self.ids.get(&key).is_some_and(|(_, last)| *last == stamp)
                && let Some((ids, _)) = self.ids.remove(&key)
            {
                self.held -= ids.len();
            }
        }
        self.compact();
    }

    /// Drops the passed-over keys once they outnumber the pieces (each use adds one).
    fn compact(&mut self) {
        if self.order.len() > 2 * self.ids.len() + 64 {
            let ids = &self.ids;
            self.order.retain(|(key, stamp)| ids.get(key).is_some_and(|(_, last)| last == stamp));
        }
    }
}

/// Where `text`'s pieces end: the first cut at or after each multiple of [`STRIDE`], and the
/// text's end. A cut is a byte index of a space whose previous char is a letter or digit.
fn cuts(text: &str) -> impl Iterator<Item = usize> + '_ {
    let bytes = text.as_bytes();
    let mut from = STRIDE;
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        while from < bytes.len() {
            let at = bytes.get(from..).and_then(|rest| rest.iter().position(|&b| b == b' ')).map(|i| from + i);
            let Some(at) = at else { break };
            // `at` is a space, so a char boundary; the char before it is the last of text[..at].
            let cut = text.get(..at).and_then(|left| left.chars().next_back()).is_some_and(char::is_alphanumeric);
            from = at + 1;
            if cut {
                // The next cut at or after the next multiple past this one.
                from = (at / STRIDE + 1) * STRIDE;
                return Some(at);
            }
        }
        done = true;
        Some(bytes.len())
    })
}

/// The ids a completion's special tokens add before and after its text, read from two probes
/// (`None` if the two do not agree on a text between them).
fn around(tokenizer: &tokenizers::Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let split = |probe: &str| -> Option<(Vec<u32>, Vec<u32>)> {
        let plain = tokenizer.encode_fast(probe, false).ok()?.get_ids().to_vec();
        let full = tokenizer.encode_fast(probe, true).ok()?.get_ids().to_vec();
        let at = (0..=full.len().checked_sub(plain.len())?).find(|&i| full.get(i..i + plain.len()) == Some(&plain))?;
        Some((full.get(..at)?.to_vec(), full.get(at + plain.len()..)?.to_vec()))
    };
    let first = split("a")?;
    (split("The pieces, 12 of them.")? == first).then_some(first)
}

fn kind(v: &Value) -> Option<&str> {
    v.get("type").and_then(Value::as_str)
}

fn normalizer_kept(n: Option<&Value>) -> bool {
    let Some(n) = n.filter(|n| !n.is_null()) else { return true };
    match kind(n) {
        Some("NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" | "BertNormalizer") => true,
        Some("Sequence") => n
            .get("normalizers")
            .and_then(Value::as_array)
            .is_some_and(|all| all.iter().all(|n| normalizer_kept(Some(n)))),
        _ => false,
    }
}

fn pre_tokenizer_kept(p: Option<&Value>) -> bool {
    // Some member must split at spaces; a byte-level pre-tokenizer without its regex only maps
    // bytes, after a split that does.
    fn member(p: &Value) -> Option<bool> {
        let flag = |k: &str| p.get(k).and_then(Value::as_bool);
        match kind(p)? {
            "ByteLevel" => Some(flag("use_regex").unwrap_or(true)),
            "WhitespaceSplit" | "Whitespace" | "BertPreTokenizer" => Some(true),
            "Metaspace" => flag("split").unwrap_or(true).then_some(true),
            "Digits" | "Punctuation" => Some(false),
            "Split" => {
                let pattern = p.get("pattern")?.get("Regex")?.as_str()?;
                let isolated = p.get("behavior").and_then(Value::as_str) == Some("Isolated");
                (SPLITS.contains(&pattern) && isolated && flag("invert") != Some(true)).then_some(true)
            }
            _ => None,
        }
    }
    let Some(p) = p.filter(|p| !p.is_null()) else { return false };
    let members: Vec<&Value> = match kind(p) {
        Some("Sequence") => {
            p.get("pretokenizers").and_then(Value::as_array).map(|a| a.iter().collect()).unwrap_or_default()
        }
        _ => vec![p],
    };
    let splits: Option<Vec<bool>> = members.iter().map(|m| member(m)).collect();
    splits.is_some_and(|s| s.contains(&true))
}

fn model_kept(m: Option<&Value>) -> bool {
    let Some(m) = m else { return false };
    match kind(m) {
        Some("BPE") => m.get("dropout").is_none_or(Value::is_null),
        Some("WordLevel" | "WordPiece" | "Unigram") => true,
        _ => false,
    }
}

fn added_tokens_kept(a: Option<&Value>) -> bool {
    let Some(tokens) = a.and_then(Value::as_array) else { return a.is_none_or(Value::is_null) };
    tokens.iter().all(|t| {
        let content = t.get("content").and_then(Value::as_str).unwrap_or_default();
        let rstrip = t.get("rstrip").and_then(Value::as_bool).unwrap_or(false);
        let spans = content.chars().any(char::is_whitespace);
        let eats_a_cut = rstrip && content.chars().next_back().is_some_and(char::is_alphanumeric);
        !spans && !eats_a_cut
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_before_a_space_after_a_letter_or_digit_once_a_stride() {
        let text = format!("{}x .{} b{}", "a".repeat(STRIDE - 1), " ".repeat(STRIDE), "c".repeat(10));
        // The space after `x` is the first after a letter or digit at or past STRIDE; no space
        // after it follows one.
        assert_eq!(cuts(&text).collect::<Vec<_>>(), vec![STRIDE, text.len()]);
        let words = "word ".repeat(STRIDE);
        let at: Vec<usize> = cuts(&words).collect();
        assert_eq!(at.len(), 5);
        assert_eq!(at.last(), Some(&words.len()));
        assert!(
            at.iter()
                .take(4)
                .zip(1..)
                .all(|(&c, k)| c >= k * STRIDE && c < k * STRIDE + 5 && words.as_bytes().get(c) == Some(&b' '))
        );
        assert_eq!(cuts(&"a".repeat(10)).collect::<Vec<_>>(), vec![10]);
        assert_eq!(cuts("").collect::<Vec<_>>(), vec![0]);
    }

    /// A word-level tokenizer on whitespace, and a BERT-like WordPiece one, as JSON.
    fn made(kind: &str) -> Value {
        let words = ["the", "cache", "block", "naïve", "12", "345", ".", ",", "!", "'", "s", "中", "文", "e\u{301}"];
        let vocab: serde_json::Map<String, Value> =
            words.iter().enumerate().map(|(i, w)| ((*w).to_string(), Value::from(i))).collect();
        let mut vocab_unk = vocab.clone();
        vocab_unk.insert("[UNK]".into(), Value::from(words.len()));
        vocab_unk.insert("##s".into(), Value::from(words.len() + 1));
        let (model, normalizer, pre) = match kind {
            "words" => (
                serde_json::json!({"type": "WordLevel", "vocab": vocab_unk, "unk_token": "[UNK]"}),
                Value::Null,
                serde_json::json!({"type": "WhitespaceSplit"}),
            ),
            _ => (
                serde_json::json!({"type": "WordPiece", "vocab": vocab_unk, "unk_token": "[UNK]",
                    "continuing_subword_prefix": "##", "max_input_chars_per_word": 100}),
                serde_json::json!({"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                    "strip_accents": null, "lowercase": true}),
                serde_json::json!({"type": "BertPreTokenizer"}),
            ),
        };
        serde_json::json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": null, "decoder": null, "model": model})
    }

    fn tokenizer(json: &Value) -> tokenizers::Tokenizer {
        json.to_string().parse().expect("a tokenizer")
    }

    /// Texts that grow as a conversation does, each the last plus more: words, Unicode, emoji,
    /// digits, punctuation, runs of spaces and newlines, and text that looks like special tokens.
    fn conversation(seed: u64, turns: usize) -> Vec<String> {
        let parts = [
            "the",
            "cache",
            "block",
            "naïve",
            "Русский",
            "中文字符",
            "😀👍🏽",
            "12345",
            "3.14",
            "don't",
            "it's",
            ".",
            ",",
            "!?",
            "e\u{301}",
            "<|im_start|>",
            "<|im_end|>",
            "<|begin_of_text|>",
            "<tool_call>",
            "\u{a0}",
            "x_y",
            "ǅ",
        ];
        let seps = [" ", " ", " ", " ", "", "\n", "\n\n", "  ", "\t", " \n"];
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let mut text = String::new();
        let mut texts = Vec::new();
        for _ in 0..turns {
            for _ in 0..(200 + next(1500)) {
                text.push_str(parts.get(next(parts.len())).copied().unwrap_or_default());
                text.push_str(seps.get(next(seps.len())).copied().unwrap_or_default());
            }
            texts.push(text.clone());
        }
        texts
    }

    fn root() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/render")
    }

    #[test]
    fn texts_encode_in_pieces_as_they_encode_whole_and_a_next_turn_reuses_the_last() {
        let mut configs: Vec<(String, Value)> = ["chatml", "llama3", "qwen25"]
            .iter()
            .map(|m| {
                let text = std::fs::read_to_string(root().join(m).join("tokenizer.json")).expect("a fixture");
                ((*m).to_string(), serde_json::from_str(&text).expect("JSON"))
            })
            .collect();
        configs.push(("words".into(), made("words")));
        configs.push(("wordpiece".into(), made("wordpiece")));
        for (name, config) in &configs {
            let t = tokenizer(config);
            let pieces = Pieces::new(&t, config).unwrap_or_else(|| panic!("{name} encodes in pieces"));
            let (mut compared, mut steps_seen) = (0, 0);
            for seed in 1..6 {
                for text in conversation(seed, 5) {
                    for special in [true, false] {
                        let whole = t.encode_fast(text.as_str(), special).expect("encodes").get_ids().to_vec();
                        let mut steps = 0;
                        let cut = pieces
                            .encode(&t, &text, special, &mut |ids, bytes, _| {
                                steps += 1;
                                // Every 7th step checked (each check encodes the start again).
                                if steps % 7 != 1 {
                                    return;
                                }
                                let start =
                                    t.encode_fast(text.get(..bytes).unwrap_or_default(), special).expect("encodes");
                                assert_eq!(
                                    ids,
                                    start.get_ids().get(..ids.len()).unwrap_or_default(),
                                    "{name}: the ids so far start the whole"
                                );
                            })
                            .expect("encodes");
                        steps_seen += steps;
                        assert!(whole == cut, "{name}: a text of {} bytes encodes alike in pieces", text.len());
                        compared += 1;
                    }
                }
            }
            assert_eq!(compared, 50);
            assert!(steps_seen > 20, "{name}: {steps_seen} steps");
            // Long new texts (nothing kept yet), past 64 pieces.
            for seed in 6..8 {
                let Some(text) = conversation(seed, 16).pop() else { continue };
                assert!(text.len() > 64 * STRIDE, "{} bytes", text.len());
                for special in [true, false] {
                    let fresh = Pieces::new(&t, config).unwrap_or_else(|| panic!("{name} encodes in pieces"));
                    let whole = t.encode_fast(text.as_str(), special).expect("encodes").get_ids().to_vec();
                    let cut = fresh.encode(&t, &text, special, &mut |_, _, _| {}).expect("encodes");
                    assert!(whole == cut, "{name}: a new text of {} bytes encodes alike in pieces", text.len());
                }
            }
            // Every turn after the first found the last turn's pieces (and the second encoding
            // of each text all of its own).
            assert!(pieces.reused() > 100, "{name}: {} pieces reused", pieces.reused());
        }
    }

    #[test]
    fn tokenizers_whose_encoding_is_not_local_are_encoded_whole() {
        let base = made("words");
        let with = |key: &str, value: Value| {
            let mut c = base.clone();
            if let Some(map) = c.as_object_mut() {
                map.insert(key.into(), value);
            }
            c
        };
        let refused = [
            with("normalizer", serde_json::json!({"type": "Replace", "pattern": {"String": " "}, "content": "_"})),
            with("pre_tokenizer", Value::Null),
            with(
                "pre_tokenizer",
                serde_json::json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": false}),
            ),
            with(
                "pre_tokenizer",
                serde_json::json!({"type": "Split", "pattern": {"Regex": "\\w+ \\w+"}, "behavior": "Isolated", "invert": false}),
            ),
            with(
                "added_tokens",
                serde_json::json!([{"id": 99, "content": "two words", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}]),
            ),
            with(
                "added_tokens",
                serde_json::json!([{"id": 99, "content": "cache", "single_word": false, "lstrip": false, "rstrip": true, "normalized": false, "special": false}]),
            ),
        ];
        for (i, config) in refused.iter().enumerate() {
            assert!(Pieces::new(&tokenizer(config), config).is_none(), "case {i} is encoded whole");
        }
        assert!(Pieces::new(&tokenizer(&base), &base).is_some());
    }

    fn piece(n: u8, len: usize) -> ([u8; 32], Arc<[u32]>) {
        ([n; 32], vec![u32::from(n); len].into())
    }

    /// Past the limit, the piece used least recently goes, not the oldest kept: a history that
    /// comes back every turn stays, however many new pieces came between.
    #[test]
    fn the_pieces_used_least_recently_go_first() {
        let mut kept = Kept::new(30);
        kept.keep(vec![piece(1, 10), piece(2, 10), piece(3, 10)]);
        assert_eq!(kept.used(&[1; 32]).as_deref(), Some(&[1u32; 10][..]), "kept");
        kept.keep(vec![piece(4, 10)]);
        assert!(kept.used(&[2; 32]).is_none(), "the least recently used went");
        for n in [3, 4, 1] {
            assert!(kept.used(&[n; 32]).is_some(), "piece {n} stays");
        }
        assert_eq!(kept.held, 30);
        // Many uses and pieces later, the keys passed over are dropped and the count holds.
        for round in 0..200u8 {
            kept.keep(vec![piece(5 + round % 50, 10)]);
            assert!(kept.used(&[1; 32]).is_some(), "used every round, it stays");
        }
        assert_eq!(kept.held, 30);
        assert!(kept.order.len() <= 2 * kept.ids.len() + 64, "{} keys for {} pieces", kept.order.len(), kept.ids.len());
    }
}
