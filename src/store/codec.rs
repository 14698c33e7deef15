//! The one place bincode is used: cold records (meta, nodes, namespaces, the seal), never the
//! hot path.
//!
//! Encoding: bincode 2 `standard()` configuration (little endian, varint integers) over serde.

use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

fn config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// Encodes a cold record.
///
/// # Errors
/// [`Error::Codec`] if the record cannot be encoded.
pub(crate) fn encode<T: Serialize>(record: &'static str, value: &T) -> Result<Vec<u8>> {
    bincode::serde::encode_to_vec(value, config()).map_err(|e| Error::Codec { record, source: Arc::new(e) })
}

/// Decodes a cold record; trailing bytes are an error.
///
/// # Errors
/// [`Error::Codec`] if the bytes are not a whole record of this type.
pub(crate) fn decode<T: DeserializeOwned>(record: &'static str, bytes: &[u8]) -> Result<T> {
    let (value, used) =
        bincode::serde::decode_from_slice(bytes, config()).map_err(|e| Error::Codec { record, source: Arc::new(e) })?;
    if used != bytes.len() {
        let trailing = format!("{} trailing bytes after the record", bytes.len() - used);
        return Err(Error::Codec {
            record,
            source: Arc::from(Box::<dyn std::error::Error + Send + Sync>::from(trailing)),
        });
    }
    Ok(value)
}
