//! What `open` does to the file before use: create the tables of a new file, check the format of
//! an old one, upgrade a schema it knows, refuse one it does not.

use redb::{Database, ReadableTable, ReadableTableMetadata, TableHandle, WriteTransaction};

use crate::chain::{BLOCK_TOKENS, HASH_SCHEME};
use crate::codec;
use crate::error::{Error, Result, redb_err};
use crate::records::{Meta, SCHEMA_VERSION, Writer};
use crate::state::empty_meta;
use crate::tables::{BY_CLOCK, META, META_KEY, NAMESPACE_IDS, NAMESPACES, NODE_IDS, NODES, PREFIXES};

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

/// Checks `meta` is a format this build writes, upgrading an older schema it knows.
///
/// # Errors
/// [`Error::NewerSchema`] or [`Error::UnknownFormat`].
pub(crate) fn check(meta: &mut Meta) -> Result<()> {
    if meta.schema > SCHEMA_VERSION {
        return Err(Error::NewerSchema { found: meta.schema, supported: SCHEMA_VERSION });
    }
    if meta.schema == 0 {
        return Err(Error::UnknownFormat { detail: "schema version 0".into() });
    }
    // Schema 1 is the first redb schema: no upgrade step exists yet. A later schema adds its
    // step here, one match arm per version, each taking the file one version up.
    if meta.hash_scheme != HASH_SCHEME {
        return Err(Error::UnknownFormat { detail: format!("hash scheme {:?}", meta.hash_scheme) });
    }
    if meta.block_tokens as usize != BLOCK_TOKENS {
        return Err(Error::UnknownFormat { detail: format!("blocks of {} tokens", meta.block_tokens) });
    }
    Ok(())
}

/// Prepares a file opened for writing: creates or checks it, records the capacity and this writer,
/// moves the clock past any entry (it never goes back), and commits that durably.
pub(crate) fn prepare(db: &Database, capacity: u64) -> Result<()> {
    let mut txn = db.begin_write().map_err(redb_err("starting the open"))?;
    let mut meta = match read_meta(&txn)? {
        Some(mut meta) => {
            check(&mut meta)?;
            meta
        }
        None => empty_meta(),
    };
    for_each_table(&txn)?;
    let last = txn
        .open_table(BY_CLOCK)
        .map_err(redb_err("opening the clock table"))?
        .last()
        .map_err(redb_err("reading the clock table"))?
        .map(|(k, _)| k.value().0);
    meta.clock = meta.clock.max(last.unwrap_or(0));
    meta.capacity = capacity;
    meta.schema = SCHEMA_VERSION;
    meta.writer = Some(Writer { pid: std::process::id() });
    let bytes = codec::encode("meta", &meta)?;
    txn.open_table(META)
        .and_then(|mut t| t.insert(META_KEY, bytes.as_slice()).map(drop).map_err(Into::into))
        .map_err(redb_err("writing the meta record"))?;
    txn.set_durability(redb::Durability::Immediate).map_err(redb_err("setting durability"))?;
    txn.commit().map_err(redb_err("committing the open"))
}

/// Opens (so creates) every table, so that readers find them all.
fn for_each_table(txn: &WriteTransaction) -> Result<()> {
    let err = redb_err::<redb::TableError>("creating tables");
    txn.open_table(PREFIXES).map_err(&err)?;
    txn.open_table(BY_CLOCK).map_err(&err)?;
    txn.open_table(NODES).map_err(&err)?;
    txn.open_table(NODE_IDS).map_err(&err)?;
    txn.open_table(NAMESPACES).map_err(&err)?;
    txn.open_table(NAMESPACE_IDS).map_err(&err)?;
    Ok(())
}
