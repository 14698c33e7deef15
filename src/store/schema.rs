//! What `open` does to the file before use: create the tables of a new file, check the format of
//! an old one, refuse one it does not know.

use redb::{Database, ReadableTableMetadata, TableHandle, WriteTransaction};

use super::codec;
use crate::decided::engines::upgrade_row;
use std::collections::BTreeMap;

use redb::ReadableTable;

use super::records::{
    DEFAULT_CAPACITY, META_KEY, Meta, SCHEMA_V1, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4, SCHEMA_V5, SCHEMA_V6, SCHEMA_V7,
    SCHEMA_V8, SCHEMA_VERSION, read_meta,
};
use super::tables::{
    ENGINE_BLOCKS, ENGINE_BLOCKS_V6, ENGINE_GROUP_BLOCKS, ENGINE_GROUPS, ENGINE_STREAMS, GENERATIONS, HELD, LIVE, META,
    NAMESPACE_IDS, NAMESPACES, NODE_CAPACITY, NODE_CLOCKS, NODE_FLOORS, NODE_IDS, NODES, OTHERS, PREFIXES, RETIRED,
    STATE,
};
use crate::error::{Error, Result, redb_err};
use crate::keys::{BLOCK_TOKENS, Scheme};

/// Writes the meta record in `txn`.
///
/// # Errors
/// [`Error::Codec`] or [`Error::Storage`].
pub(crate) fn write_file_meta(txn: &WriteTransaction, meta: &Meta) -> Result<()> {
    let bytes = codec::encode("meta", meta)?;
    txn.open_table(META)
        .and_then(|mut t| t.insert(META_KEY, bytes.as_slice()).map(drop).map_err(Into::into))
        .map_err(redb_err("writing the meta record"))
}

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

/// Checks `meta` is a format this build opens, and returns the hash scheme of its keys. Schema 2,
/// 3 and 4 files are upgraded to schema 5 when a writer opens them ([`prepare`]); a schema 2 file
/// keeps its own chain (`migrations/0003-tree-chain`), in schema 4 and 5 as before.
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
        (SCHEMA_V4 | SCHEMA_V5 | SCHEMA_V6 | SCHEMA_V7 | SCHEMA_V8, Some(scheme)) => scheme,
        (schema, _) => {
            return Err(Error::unknown_format(format!("schema {schema} with hash scheme {:?}", meta.hash_scheme)));
        }
    };
    if meta.block_tokens as usize != BLOCK_TOKENS {
        return Err(Error::unknown_format(format!("blocks of {} tokens", meta.block_tokens)));
    }
    Ok(scheme)
}

/// What [`prepare`] did to a file.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Prepared {
    /// The hash scheme of the file's keys.
    pub scheme: Scheme,
    /// Whether an old file's capacity was changed.
    pub resized: bool,
    /// The schema it was upgraded from, if it was.
    pub upgraded_from: Option<u32>,
}

/// Prepares a file opened for writing: creates a new one (with `capacity`, or the default), or
/// checks an old one, upgrades it to the current schema if it is older, and records `capacity` if one was
/// given and differs, all in one transaction. Otherwise an old file is only read (no commit:
/// opening is cheap).
///
/// # Errors
/// As [`read_file_meta`] and [`check`]; [`Error::Storage`].
pub(crate) fn prepare(db: &Database, capacity: Option<u64>) -> Result<Prepared> {
    let mut txn = db.begin_write().map_err(redb_err("starting the open"))?;
    let (mut meta, prepared) = match read_file_meta(&txn)? {
        Some(mut meta) => {
            let scheme = check(&meta)?;
            let resized = capacity.is_some_and(|c| c != meta.capacity);
            let upgraded_from = (meta.schema < SCHEMA_V8).then_some(meta.schema);
            if !resized && upgraded_from.is_none() {
                txn.abort().map_err(redb_err("ending the open"))?;
                return Ok(Prepared { scheme, resized, upgraded_from });
            }
            if meta.schema < SCHEMA_V4 {
                upgrade(&txn, &mut meta)?;
            }
            if meta.schema < SCHEMA_V5 {
                upgrade_v5(&txn, &mut meta)?;
            }
            if meta.schema < SCHEMA_V6 {
                upgrade_v6(&txn, &mut meta)?;
            }
            if meta.schema < SCHEMA_V7 {
                upgrade_v7(&txn, &mut meta)?;
            }
            if meta.schema < SCHEMA_V8 {
                upgrade_v8(&txn, &mut meta)?;
            }
            (meta, Prepared { scheme, resized, upgraded_from })
        }
        None => {
            create_tables(&txn)?;
            let new = Prepared { scheme: Scheme::TreeChain, resized: false, upgraded_from: None };
            (Meta::new_file(DEFAULT_CAPACITY), new)
        }
    };
    meta.capacity = capacity.unwrap_or(meta.capacity);
    write_file_meta(&txn, &meta)?;
    txn.set_durability(redb::Durability::Immediate).map_err(redb_err("setting durability"))?;
    txn.commit().map_err(redb_err("committing the open"))?;
    Ok(prepared)
}

/// Upgrades a schema 2 or 3 file to schema 4 in the open transaction: the new tables, and each
/// node's count of the blocks that name it (one scan of the prefix table). Every other table
/// and every key stays as it is; a crash before the commit leaves the old file untouched.
fn upgrade(txn: &WriteTransaction, meta: &mut Meta) -> Result<()> {
    let err = redb_err::<redb::TableError>("upgrading to schema 4");
    txn.open_table(OTHERS).map_err(&err)?;
    txn.open_table(RETIRED).map_err(&err)?;
    txn.open_table(STATE).map_err(&err)?;
    let mut held: BTreeMap<u32, u64> = BTreeMap::new();
    {
        let prefixes = txn.open_table(PREFIXES).map_err(&err)?;
        for item in prefixes.iter().map_err(redb_err("upgrading to schema 4"))? {
            let (_, value) = item.map_err(redb_err("upgrading to schema 4"))?;
            *held.entry(value.value().0).or_default() += 1;
        }
    }
    let mut table = txn.open_table(HELD).map_err(&err)?;
    for (node, n) in held {
        table.insert(node, n).map_err(redb_err("upgrading to schema 4"))?;
    }
    meta.schema = SCHEMA_V4;
    Ok(())
}

/// Upgrades a schema 4 file to schema 5 in the open transaction: the node cache tables, empty (a
/// schema 4 file sets no cache size, and a node's cache is kept only once it has one: its
/// counts then start from what the file names of it). Every other table and every answer stays
/// as it is; a crash before the commit leaves the old file untouched.
fn upgrade_v5(txn: &WriteTransaction, meta: &mut Meta) -> Result<()> {
    let err = redb_err::<redb::TableError>("upgrading to schema 5");
    txn.open_table(NODE_CLOCKS).map_err(&err)?;
    txn.open_table(NODE_FLOORS).map_err(&err)?;
    txn.open_table(NODE_CAPACITY).map_err(&err)?;
    meta.schema = SCHEMA_V5;
    Ok(())
}

/// Upgrades a schema 5 file to schema 6 in the open transaction: the engine tables, empty (no
/// node of a schema 5 file has an event stream, so every answer stays as it is). A crash before
/// the commit leaves the old file untouched.
fn upgrade_v6(txn: &WriteTransaction, meta: &mut Meta) -> Result<()> {
    let err = redb_err::<redb::TableError>("upgrading to schema 6");
    txn.open_table(ENGINE_BLOCKS_V6).map_err(&err)?;
    txn.open_table(ENGINE_STREAMS).map_err(&err)?;
    meta.schema = SCHEMA_V6;
    Ok(())
}

/// Upgrades a schema 6 file to schema 7 in the open transaction: every engine block row is
/// rewritten from `engine_blocks/v6` into `engine_blocks/v7`, keyed by its store's clock (taken
/// out of the row), every copy on the GPU as schema 6 held it; the old table is deleted. Every
/// answer stays as it is; a crash before the commit leaves the old file untouched.
fn upgrade_v7(txn: &WriteTransaction, meta: &mut Meta) -> Result<()> {
    const WHAT: &str = "upgrading to schema 7";
    let err = redb_err::<redb::TableError>(WHAT);
    {
        let old = txn.open_table(ENGINE_BLOCKS_V6).map_err(&err)?;
        let mut new = txn.open_table(ENGINE_BLOCKS).map_err(&err)?;
        for item in old.iter().map_err(redb_err(WHAT))? {
            let (k, v) = item.map_err(redb_err(WHAT))?;
            let (node, hash) = k.value();
            let (key, row) = upgrade_row(node, hash, v.value())?;
            new.insert(key, row.as_ref()).map_err(redb_err(WHAT))?;
        }
    }
    txn.delete_table(ENGINE_BLOCKS_V6).map_err(&err)?;
    meta.schema = SCHEMA_V7;
    Ok(())
}

/// Upgrades a schema 7 file to schema 8 in the open transaction: the hybrid engine tables,
/// empty (schema 7 kept a hybrid engine's holdings in memory only: its stream is where it was,
/// holding nothing, as a schema 7 build reopening it would have it). Every answer stays as it
/// is; a crash before the commit leaves the old file untouched.
fn upgrade_v8(txn: &WriteTransaction, meta: &mut Meta) -> Result<()> {
    let err = redb_err::<redb::TableError>("upgrading to schema 8");
    txn.open_table(ENGINE_GROUPS).map_err(&err)?;
    txn.open_table(ENGINE_GROUP_BLOCKS).map_err(&err)?;
    meta.schema = SCHEMA_V8;
    Ok(())
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
    txn.open_table(OTHERS).map_err(&err)?;
    txn.open_table(RETIRED).map_err(&err)?;
    txn.open_table(HELD).map_err(&err)?;
    txn.open_table(STATE).map_err(&err)?;
    txn.open_table(NODE_CLOCKS).map_err(&err)?;
    txn.open_table(NODE_FLOORS).map_err(&err)?;
    txn.open_table(NODE_CAPACITY).map_err(&err)?;
    txn.open_table(ENGINE_BLOCKS).map_err(&err)?;
    txn.open_table(ENGINE_STREAMS).map_err(&err)?;
    txn.open_table(ENGINE_GROUPS).map_err(&err)?;
    txn.open_table(ENGINE_GROUP_BLOCKS).map_err(&err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;
    use crate::keys::{HASH_SCHEME, HASH_SCHEME_V2};

    fn meta(schema: u32, scheme: &str, block_tokens: u32) -> Meta {
        Meta { schema, hash_scheme: scheme.into(), block_tokens, ..Meta::new_file(DEFAULT_CAPACITY) }
    }

    #[test]
    fn each_schema_is_opened_in_its_own_scheme_or_refused() {
        assert_eq!(check(&meta(SCHEMA_V3, HASH_SCHEME, 64)).ok(), Some(Scheme::TreeChain));
        assert_eq!(check(&meta(SCHEMA_V2, HASH_SCHEME_V2, 64)).ok(), Some(Scheme::KeyedChain));
        assert_eq!(check(&meta(SCHEMA_V4, HASH_SCHEME, 64)).ok(), Some(Scheme::TreeChain));
        assert_eq!(check(&meta(SCHEMA_V5, HASH_SCHEME, 64)).ok(), Some(Scheme::TreeChain));
        assert_eq!(check(&meta(SCHEMA_V5, HASH_SCHEME_V2, 64)).ok(), Some(Scheme::KeyedChain));
        assert_eq!(check(&meta(SCHEMA_V6, HASH_SCHEME, 64)).ok(), Some(Scheme::TreeChain));
        assert_eq!(check(&meta(SCHEMA_V7, HASH_SCHEME, 64)).ok(), Some(Scheme::TreeChain));
        assert_eq!(check(&meta(SCHEMA_V8, HASH_SCHEME, 64)).ok(), Some(Scheme::TreeChain));
        assert_eq!(
            check(&meta(SCHEMA_V4, HASH_SCHEME_V2, 64)).ok(),
            Some(Scheme::KeyedChain),
            "an upgraded 0.2.0 file"
        );
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
            meta(SCHEMA_V4, "md5-chain", 64),
            meta(0, HASH_SCHEME, 64),
            meta(SCHEMA_V3, HASH_SCHEME, 32),
        ] {
            assert!(matches!(check(&bad), Err(Error::UnknownFormat { .. })), "{bad:?}");
        }
    }
}
