//! The one place bincode is used: cold records (meta, nodes, namespaces), never the hot path.
//!
//! Encoding: bincode 2 `standard()` configuration (little endian, varint integers) over serde.

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
    bincode::serde::encode_to_vec(value, config()).map_err(|e| Error::Codec { record, detail: e.to_string() })
}

/// Decodes a cold record; trailing bytes are an error.
///
/// # Errors
/// [`Error::Codec`] if the bytes are not a whole record of this type.
pub(crate) fn decode<T: DeserializeOwned>(record: &'static str, bytes: &[u8]) -> Result<T> {
    let (value, used) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|e| Error::Codec { record, detail: e.to_string() })?;
    if used != bytes.len() {
        return Err(Error::Codec { record, detail: format!("{} trailing bytes", bytes.len() - used) });
    }
    Ok(value)
}
