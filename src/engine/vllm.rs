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

    #[test]
    fn garbage_is_a_typed_error() {
        assert!(matches!(decode_engine_batch(3, &[0x93, 0xc1], "m"), Err(Error::Engine { .. })));
    }
}
