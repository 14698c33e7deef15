//! What `open` does to the file before use: create the tables of a new file, check the format of
//! an old one, refuse one it does not know.

use redb::{Database, ReadableTableMetadata, TableHandle, WriteTransaction};

use super::codec;
use super::records::{DEFAULT_CAPACITY, META_KEY, Meta, SCHEMA_V1, SCHEMA_V2, SCHEMA_V3, SCHEMA_VERSION, read_meta};
use super::tables::{GENERATIONS, LIVE, META, NAMESPACE_IDS, NAMESPACES, NODE_IDS, NODES, PREFIXES};
use crate::error::{Error, Result, redb_err};
use crate::keys::{BLOCK_TOKENS, Scheme};

/// The meta record of a file opened for writing, `None` for a new (empty) file.
///
/// # Errors
/// [`Error::UnknownFormat`] for a redb file with other tables and no meta record.
pub(crate) fn read_file_meta(txn: &WriteTransaction) -> Result<Option<Meta>> {
    let table = txn.open_table(META).map_err(redb_err("opening the meta table"))?;
    if let Some(meta) = read_meta(&table)? {
        return Ok(Some(meta));
    }
    let others = txn.list_tables().map_err(redb_err("listing tables"))?.filter(|t| t.name() != META.name()).count();
    if others > 0 || table.len().map_err(redb_err("reading the meta table"))? > 0 {
        return Err(Error::unknown_format("a redb file without a superfluid-warm meta record"));
    }
    Ok(None)
}

/// Checks `meta` is a format this build writes, and returns the hash scheme of its keys.
/// Schema 2 files are read and written as they are, with their own chain: the tables are the
/// same, only the keys are made differently (`migrations/0003-tree-chain`).
///
/// # Errors
/// [`Error::NewerSchema`], [`Error::RetiredSchema`] or [`Error::UnknownFormat`].
pub(crate) fn check(meta: &Meta) -> Result<Scheme> {
    if meta.schema > SCHEMA_VERSION {
        return Err(Error::NewerSchema { found: meta.schema, supported: SCHEMA_VERSION });
    }
    // Schema 1 keyed blocks by 16 bytes of their own hash; later keys need the hash of the
    // segment's first block, which a stored key does not give back, so there is no upgrade step.
    if meta.schema == SCHEMA_V1 {
        return Err(Error::RetiredSchema { found: SCHEMA_V1 });
    }
    let scheme = match (meta.schema, Scheme::named(&meta.hash_scheme)) {
        (SCHEMA_V2, Some(Scheme::KeyedChain)) => Scheme::KeyedChain,
        (SCHEMA_V3, Some(Scheme::TreeChain)) => Scheme::TreeChain,
        (schema, _) => {
            return Err(Error::unknown_format(format!("schema {schema} with hash scheme {:?}", meta.hash_scheme)));
        }
    };
    if meta.block_tokens as usize != BLOCK_TOKENS {
        return Err(Error::unknown_format(format!("blocks of {} tokens", meta.block_tokens)));
    }
    Ok(scheme)
}

/// Prepares a file opened for writing: creates a new one (with `capacity`, or the default), or
/// checks an old one and records `capacity` if one was given and differs. Otherwise an old file
/// is only read (no commit: opening is cheap). Returns the hash scheme of the file's keys, and
/// whether an old file's capacity was changed.
///
/// # Errors
/// As [`read_file_meta`] and [`check`]; [`Error::Storage`].
pub(crate) fn prepare(db: &Database, capacity: Option<u64>) -> Result<(Scheme, bool)> {
    let mut txn = db.begin_write().map_err(redb_err("starting the open"))?;
    let (mut meta, scheme, old) = match read_file_meta(&txn)? {
        Some(meta) => {
            let scheme = check(&meta)?;
            if capacity.is_none_or(|c| c == meta.capacity) {
                txn.abort().map_err(redb_err("ending the open"))?;
                return Ok((scheme, false));
            }
            (meta, scheme, true)
        }
        None => {
            create_tables(&txn)?;
            (Meta::new_file(DEFAULT_CAPACITY), Scheme::TreeChain, false)
        }
    };
    meta.capacity = capacity.unwrap_or(DEFAULT_CAPACITY);
    let bytes = codec::encode("meta", &meta)?;
    txn.open_table(META)
        .and_then(|mut t| t.insert(META_KEY, bytes.as_slice()).map(drop).map_err(Into::into))
        .map_err(redb_err("writing the meta record"))?;
    txn.set_durability(redb::Durability::Immediate).map_err(redb_err("setting durability"))?;
    txn.commit().map_err(redb_err("committing the open"))?;
    Ok((scheme, old))
}

/// Opens (so creates) every table, so that readers find them all.
fn create_tables(txn: &WriteTransaction) -> Result<()> {
    let err = redb_err::<redb::TableError>("creating tables");
    txn.open_table(PREFIXES).map_err(&err)?;
    txn.open_table(GENERATIONS).map_err(&err)?;
    txn.open_table(LIVE).map_err(&err)?;
    txn.open_table(NODES).map_err(&err)?;
    txn.open_table(NODE_IDS).map_err(&err)?;
    txn.open_table(NAMESPACES).map_err(&err)?;
    txn.open_table(NAMESPACE_IDS).map_err(&err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{HASH_SCHEME, HASH_SCHEME_V2};

    fn meta(schema: u32, scheme: &str, block_tokens: u32) -> Meta {
        Meta { schema, hash_scheme: scheme.into(), block_tokens, ..Meta::new_file(DEFAULT_CAPACITY) }
    }

    #[test]
    fn each_schema_is_opened_in_its_own_scheme_or_refused() {
        assert_eq!(check(&meta(SCHEMA_V3, HASH_SCHEME, 64)).ok(), Some(Scheme::TreeChain));
        assert_eq!(check(&meta(SCHEMA_V2, HASH_SCHEME_V2, 64)).ok(), Some(Scheme::KeyedChain));
        assert!(matches!(check(&meta(SCHEMA_V1, "anything", 64)), Err(Error::RetiredSchema { found: 1 })));
        assert!(matches!(
            check(&meta(SCHEMA_VERSION + 1, HASH_SCHEME, 64)),
            Err(Error::NewerSchema { found, supported: SCHEMA_VERSION }) if found == SCHEMA_VERSION + 1
        ));
        // A schema with the other schema's chain, an unknown chain, schema 0, other block sizes.
        for bad in [
            meta(SCHEMA_V2, HASH_SCHEME, 64),
            meta(SCHEMA_V3, HASH_SCHEME_V2, 64),
            meta(SCHEMA_V3, "md5-chain", 64),
            meta(0, HASH_SCHEME, 64),
            meta(SCHEMA_V3, HASH_SCHEME, 32),
        ] {
            assert!(matches!(check(&bad), Err(Error::UnknownFormat { .. })), "{bad:?}");
        }
    }
}
