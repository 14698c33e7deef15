//! vLLM's (and SGLang's) KV event batches as the library's engine batches: the decoded events,
//! with each store's namespace chosen from the endpoint's model, its LoRA and its cache salt.

use std::sync::Arc;

use super::decode::{self, Event, Extra};
use crate::decided::engines::{CacheGroup, EngineBatch, EngineEvent, EngineStored, GroupKind, Medium};
use crate::error::{Error, Result};
use crate::keys::Namespace;

/// One batch of vLLM's (or SGLang's) KV cache events as the library's, for
/// [`crate::Warm::engine_batch`]: `seq` is the message's second frame (8 bytes big-endian),
/// `payload` its third (msgpack `[ts, events, data_parallel_rank]`, events as maps or as the
/// older tagged arrays). A store is keyed under `model`, or under its LoRA's name if it has one
/// (what a request names as its model), with its cache salt as the tenant; a store whose blocks
/// hash more than their tokens (images, prompt embeddings) is kept but keyed under nothing.
/// Events of a type this build does not know are skipped.
///
/// # Errors
/// [`Error::Engine`] for a payload that is not a well-formed batch (nothing of it is taken).
pub fn decode_engine_batch(seq: u64, payload: &[u8], model: &str) -> Result<EngineBatch> {
    let decoded = decode::decode_batch(payload)
        .map_err(|e| Error::Engine { detail: format!("batch {seq}: {e}"), source: Some(Arc::new(e)) })?;
    // Publish times order an engine's processes (a restart publishes later): a time that is
    // not a number would make every later batch look like a restart, or none.
    if !decoded.ts.is_finite() {
        return Err(Error::Engine {
            detail: format!("batch {seq}: publish time {} is not a time", decoded.ts),
            source: None,
        });
    }
    Ok(EngineBatch { seq, ts: decoded.ts, events: decoded.events.into_iter().map(|e| event(model, e)).collect() })
}

/// One decoded event as the library's (see [`decode_engine_batch`]).
fn event(model: &str, event: Event) -> EngineEvent {
    match event {
        Event::Stored {
            hashes,
            parent,
            tokens,
            block_size,
            medium,
            lora_name,
            extra_keys,
            group,
            locality,
            lookahead,
            ..
        } => EngineEvent::Stored(EngineStored {
            // A block hashed with tokens past its end is reused only by prompts that share
            // those too: it keys nothing, as a block with an image does not.
            namespace: namespace(model, lora_name.as_deref(), &extra_keys).filter(|_| !lookahead),
            parent,
            hashes,
            tokens,
            block_size,
            medium: medium_at(medium.as_deref(), locality.as_deref()),
            group: group
                .index
                .map(|index| CacheGroup { index, kind: GroupKind::named(group.kind.as_deref(), group.window) }),
        }),
        Event::Removed { hashes, medium, group, locality } => {
            EngineEvent::Removed { hashes, medium: medium_at(medium.as_deref(), locality.as_deref()), group }
        }
        Event::Cleared => EngineEvent::Cleared,
    }
}

/// Where an event's blocks are: its medium, unless they are held by another engine than the
/// publisher (`locality` `"REMOTE"`), which this node cannot reuse from.
fn medium_at(medium: Option<&str>, locality: Option<&str>) -> Medium {
    match locality {
        Some(l) if l.eq_ignore_ascii_case("remote") => Medium::Other,
        _ => Medium::named(medium),
    }
}

/// The namespace a store's blocks are keyed in; `None` when they hash more than their tokens,
/// or the names are not valid ones.
fn namespace(model: &str, lora: Option<&str>, extra_keys: &[Option<Vec<Extra>>]) -> Option<Namespace> {
    let mut salt: Option<&str> = None;
    for (i, keys) in extra_keys.iter().enumerate() {
        for key in keys.iter().flatten() {
            match key {
                Extra::Text(t) if Some(t.as_str()) == lora => {}
                // vLLM puts the cache salt in the first block's extra keys only.
                Extra::Text(t) if i == 0 && salt.is_none() => salt = Some(t),
                _ => return None,
            }
        }
    }
    let model = lora.unwrap_or(model);
    Namespace::of(model, salt.map(str::as_bytes)).ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    #[test]
    fn a_store_is_keyed_under_its_lora_and_salt_and_not_keyed_with_images() {
        let plain = namespace("m", None, &[None, None]);
        assert_eq!(plain, Namespace::new("m").ok());
        let lora = namespace("m", Some("ad"), &[Some(vec![Extra::Text("ad".into())])]);
        assert_eq!(lora, Namespace::new("ad").ok());
        let salted = namespace("m", None, &[Some(vec![Extra::Text("s1".into())]), None]);
        assert_eq!(salted, Namespace::with_tenant("m", b"s1").ok());
        assert_eq!(namespace("m", None, &[Some(vec![Extra::Other])]), None, "an image");
        assert_eq!(namespace("m", None, &[Some(vec![Extra::Bytes(vec![1])])]), None, "prompt embeddings");
        let late = namespace("m", None, &[None, Some(vec![Extra::Text("x".into())])]);
        assert_eq!(late, None, "text past the first block");
    }

    /// vLLM 0.33's every field: a sliding-window group's store, with lookahead tokens in its
    /// hash (so it keys nothing), local to the publisher; its removal names its group.
    #[test]
    fn a_store_carries_its_group_and_lookahead_keys_nothing() -> Result<()> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kv-events/v033_store_all_fields.msgpack");
        let bytes = std::fs::read(path).map_err(|e| Error::Engine { detail: e.to_string(), source: None })?;
        let batch = decode_engine_batch(13, &bytes, "m")?;
        let [EngineEvent::Stored(stored), EngineEvent::Removed { group, medium, .. }] = batch.events.as_slice() else {
            panic!("a store and a removal: {:?}", batch.events)
        };
        let sliding = CacheGroup { index: 1, kind: GroupKind::SlidingWindow { window: 4096 } };
        assert_eq!((stored.group, stored.medium, &stored.namespace), (Some(sliding), Medium::Gpu, &None));
        assert_eq!((*group, *medium), (Some(1), Medium::Gpu));
        assert_eq!(medium_at(Some("GPU"), Some("REMOTE")), Medium::Other, "another engine's blocks");
        assert_eq!(GroupKind::named(Some("sliding_window"), None), GroupKind::Other, "a window it did not give");
        assert_eq!(GroupKind::named(Some("mla_attention"), None), GroupKind::Full);
        Ok(())
    }

    /// vLLM's reuse rule (`decided/engines/reuse.rs`) against vLLM's own answers
    /// (`tests/fixtures/hybrid`: its `KVCacheManager` driven with KV events on, by
    /// `make_fixtures.py` there): from the events alone, what each group holds (copies counted
    /// per group and hash, a block known by the dense store that lists it) and the rule give
    /// every probe's `cached_tokens`, chunked local attention included.
    #[test]
    fn the_rule_over_the_events_gives_vllms_own_answers() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hybrid");
        let mut cases: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
            .expect("the fixtures")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .collect();
        cases.sort();
        let mut checked = 0;
        for case in &cases {
            checked += check_case(case);
        }
        assert!(cases.len() >= 3 && checked >= 300, "{} cases, {checked} probes", cases.len());
    }

    /// Replays one fixture; returns the probes checked.
    fn check_case(path: &std::path::Path) -> usize {
        use std::collections::HashMap;

        use serde_json::Value;

        use crate::decided::engines::{Need, Spec, vllm_reuse as reuse};

        let text = std::fs::read_to_string(path).expect("a fixture");
        let name = path.display();
        let mut specs: Vec<(Spec, Vec<u32>)> = Vec::new();
        // (parent, a block's tokens) → its hash, from the dense stores seen.
        let mut oracle: HashMap<(Option<u64>, Vec<u32>), u64> = HashMap::new();
        let mut copies: HashMap<(u32, u64), u32> = HashMap::new();
        let mut block_size = 0;
        let (mut probes, mut wrong) = (0, Vec::new());
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).expect("a JSON line");
            if let Some(case) = v.get("case") {
                if case["hash_block_size"] != case["groups"][0]["block_size"] {
                    // Hits finer than a block (vLLM's partial hash hits): not modelled.
                    return 0;
                }
                for (index, g) in case["groups"].as_array().expect("groups").iter().enumerate() {
                    let size = g["block_size"].as_u64().expect("block_size") as usize;
                    let need = match g["kind"].as_str().expect("kind") {
                        "full_attention" => Need::All,
                        "sliding_window" => Need::Window { window: g["window"].as_u64().expect("window") as usize },
                        "chunked_local_attention" => {
                            Need::Chunk { chunk: g["attention_chunk_size"].as_u64().expect("chunk") as usize }
                        }
                        "mamba" => Need::State,
                        other => panic!("{name}: kind {other}"),
                    };
                    let spec = Spec { need, block_size: size };
                    block_size = size;
                    match specs.iter_mut().find(|(s, _)| *s == spec) {
                        Some((_, groups)) => groups.push(index as u32),
                        None => specs.push((spec, vec![index as u32])),
                    }
                }
            } else if let Some(batch) = v.get("batch") {
                let payload = hex(batch["payload"].as_str().expect("payload"));
                let seq = batch["seq"].as_u64().expect("seq");
                for event in decode_engine_batch(seq, &payload, "m").expect("decodes").events {
                    match event {
                        EngineEvent::Stored(s) => {
                            let group = s.group.expect("a group").index;
                            let size = s.block_size as usize;
                            if size > 0 && s.tokens.len() == s.hashes.len() * size {
                                let mut parent = s.parent;
                                for (hash, tokens) in s.hashes.iter().zip(s.tokens.chunks_exact(size)) {
                                    oracle.insert((parent, tokens.to_vec()), *hash);
                                    parent = Some(*hash);
                                }
                            }
                            for hash in s.hashes {
                                *copies.entry((group, hash)).or_default() += 1;
                            }
                        }
                        EngineEvent::Removed { hashes, group, .. } => {
                            for hash in hashes {
                                let left = copies.entry((group.expect("a group"), hash)).or_default();
                                *left = left.checked_sub(1).expect("a removal of a copy held");
                            }
                        }
                        EngineEvent::Cleared => copies.clear(),
                    }
                }
            } else if let Some(probe) = v.get("probe") {
                let tokens: Vec<u32> = probe["tokens"]
                    .as_array()
                    .expect("tokens")
                    .iter()
                    .map(|t| t.as_u64().expect("a token") as u32)
                    .collect();
                let mut hashes = Vec::new();
                let mut parent = None;
                for block in tokens.chunks_exact(block_size) {
                    let Some(&hash) = oracle.get(&(parent, block.to_vec())) else { break };
                    hashes.push(hash);
                    parent = Some(hash);
                }
                let only: Vec<Spec> = specs.iter().map(|(s, _)| *s).collect();
                let got = reuse(&only, tokens.len(), |s, i| {
                    let (Some((_, groups)), Some(hash)) = (specs.get(s), hashes.get(i)) else { return false };
                    groups.iter().all(|g| copies.get(&(*g, *hash)).is_some_and(|&c| c > 0))
                });
                let want = probe["cached_tokens"].as_u64().expect("cached_tokens") as usize;
                probes += 1;
                if got != Some(want) {
                    wrong.push((probe["label"].clone(), tokens.len(), want, got));
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "{name}: {} of {probes} probes differ (label, tokens, vLLM, rule): {wrong:?}",
            wrong.len()
        );
        probes
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2).unwrap_or("00"), 16).unwrap_or(0)).collect()
    }

    #[test]
    fn garbage_is_a_typed_error() {
        assert!(matches!(decode_engine_batch(3, &[0x93, 0xc1], "m"), Err(Error::Engine { .. })));
    }
}
