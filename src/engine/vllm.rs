//! vLLM's (and SGLang's) KV event batches as the library's engine batches: the decoded events,
//! with each store's namespace chosen from the endpoint's model, its LoRA and its cache salt.

use std::sync::Arc;

use super::decode::{self, Event, Extra};
use crate::decided::engines::{EngineBatch, EngineEvent, EngineStored, Medium};
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
        Event::Stored { hashes, parent, tokens, block_size, medium, lora_name, extra_keys, .. } => {
            EngineEvent::Stored(EngineStored {
                namespace: namespace(model, lora_name.as_deref(), &extra_keys),
                parent,
                hashes,
                tokens,
                block_size,
                medium: Medium::named(medium.as_deref()),
            })
        }
        Event::Removed { hashes, medium } => EngineEvent::Removed { hashes, medium: Medium::named(medium.as_deref()) },
        Event::Cleared => EngineEvent::Cleared,
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

    #[test]
    fn garbage_is_a_typed_error() {
        assert!(matches!(decode_engine_batch(3, &[0x93, 0xc1], "m"), Err(Error::Engine { .. })));
    }
}
