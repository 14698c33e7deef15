//! What `open` does to the file before use: create the tables of a new file, check the format of
//! an old one, upgrade a schema it knows, refuse one it does not.

use redb::{Database, ReadableTable, ReadableTableMetadata, TableHandle, WriteTransaction};

use crate::chain::{BLOCK_TOKENS, Scheme};
use crate::codec;
use crate::error::{Error, Result, redb_err};
use crate::records::{Meta, SCHEMA_VERSION};
use crate::state::empty_meta;
use crate::tables::{GENERATIONS, LIVE, META, META_KEY, NAMESPACE_IDS, NAMESPACES, NODE_IDS, NODES, PREFIXES};

/// Reads the meta record of a file, `None` for a new (empty) file.
///
/// # Errors
/// [`Error::UnknownFormat`] for a redb file with other tables and no meta record.
pub(crate) fn read_meta(txn: &WriteTransaction) -> Result<Option<Meta>> {
    let table = txn.open_table(META).map_err(redb_err("opening the meta table"))?;
    let found = table.get(META_KEY).map_err(redb_err("reading the meta record"))?;
    match found {
        Some(bytes) => Ok(Some(codec::decode("meta", bytes.value())?)),
        None => {
            let others =
                txn.list_tables().map_err(redb_err("listing tables"))?.filter(|t| t.name() != META.name()).count();
            if others > 0 || table.len().map_err(redb_err("reading the meta table"))? > 0 {
                return Err(Error::UnknownFormat {
                    detail: "a redb file without a superfluid-warm meta record".into(),
                });
            }
            Ok(None)
        }
    }
}

/// Checks `meta` is a format this build writes, and returns the hash scheme of its keys.
/// Schema 2 files (0.2.0) are read and written as they are, with their own chain: the tables are
/// the same, only the keys are made differently (migrations/0003-tree-chain).
///
/// # Errors
/// [`Error::NewerSchema`], [`Error::RetiredSchema`] or [`Error::UnknownFormat`].
pub(crate) fn check(meta: &Meta) -> Result<Scheme> {
    if meta.schema > SCHEMA_VERSION {
        return Err(Error::NewerSchema { found: meta.schema, supported: SCHEMA_VERSION });
    }
    if meta.schema == 0 {
        return Err(Error::UnknownFormat { detail: "schema version 0".into() });
    }
    // Schema 1 (pre-release builds) keyed blocks by 16 bytes of their own hash; later keys need
    // the hash of the segment's first block, which a stored key does not give back, so there is
    // no upgrade step (migrations/0002-segment-keys-and-generations).
    if meta.schema == 1 {
        return Err(Error::RetiredSchema { found: 1 });
    }
    let scheme = match (meta.schema, Scheme::named(&meta.hash_scheme)) {
        (2, Some(Scheme::KeyedChain)) => Scheme::KeyedChain,
        (3, Some(Scheme::TreeChain)) => Scheme::TreeChain,
        (schema, _) => {
            return Err(Error::UnknownFormat {
                detail: format!("schema {schema} with hash scheme {:?}", meta.hash_scheme),
            });
        }
    };
    if meta.block_tokens as usize != BLOCK_TOKENS {
        return Err(Error::UnknownFormat { detail: format!("blocks of {} tokens", meta.block_tokens) });
    }
    Ok(scheme)
}

/// Prepares a file opened for writing: creates a new one (with `capacity`, or the default), or
/// checks an old one and records `capacity` if one was given and differs. Otherwise an old file
/// is only read (no commit: opening is cheap). Returns the hash scheme of the file's keys.
pub(crate) fn prepare(db: &Database, capacity: Option<u64>) -> Result<Scheme> {
    let mut txn = db.begin_write().map_err(redb_err("starting the open"))?;
    let (mut meta, scheme) = match read_meta(&txn)? {
        Some(meta) => {
            let scheme = check(&meta)?;
            if capacity.is_none_or(|c| c == meta.capacity) {
                txn.abort().map_err(redb_err("ending the open"))?;
                return Ok(scheme);
            }
            (meta, scheme)
        }
        None => {
            for_each_table(&txn)?;
            (empty_meta(), Scheme::TreeChain)
        }
    };
    meta.capacity = capacity.unwrap_or(crate::builder::DEFAULT_CAPACITY);
    let bytes = codec::encode("meta", &meta)?;
    txn.open_table(META)
        .and_then(|mut t| t.insert(META_KEY, bytes.as_slice()).map(drop).map_err(Into::into))
        .map_err(redb_err("writing the meta record"))?;
    txn.set_durability(redb::Durability::Immediate).map_err(redb_err("setting durability"))?;
    txn.commit().map_err(redb_err("committing the open"))?;
    Ok(scheme)
}

/// Opens (so creates) every table, so that readers find them all.
fn for_each_table(txn: &WriteTransaction) -> Result<()> {
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
