//! Loading the decided state (`decided/`) from a committed file: its records, live counts, node
//! cache rows and engine rows, read in one read transaction; and the scans that seed a node
//! cache or recount one. The decided state knows no storage; this is where the file meets it.

use std::collections::BTreeMap;
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable};

use super::codec;
use super::records::{NodeRecords, read_meta, read_registry};
use super::tables::{
    ENGINE_BLOCKS, ENGINE_BLOCKS_V6, ENGINE_GROUP_BLOCKS, ENGINE_GROUPS, ENGINE_STREAMS, Entry, GENERATIONS, LIVE,
    META, NAMESPACE_IDS, NODE_CACHE_KEY, NODE_CAPACITY, NODE_CLOCKS, NODE_FLOORS, OTHERS, PREFIXES, STATE, members,
    table_key,
};
use super::writer::read_floor;
use crate::decided::Decided;
use crate::decided::caches::NodeCaches;
use crate::decided::engines::{
    BlockRowKey, Engines, GroupedRow, Layout, Row, StreamRecord, decode_grouped, decode_kind, decode_row,
};
use crate::decided::horizon::Horizon;
use crate::decided::namespaces::Namespaces;
use crate::decided::registry::Registry;
use crate::error::{Error, Result, redb_err};
use crate::keys::{Scheme, is_legacy, legacy_key};

/// The decided state of a committed file, read in one read transaction.
///
/// # Errors
/// [`Error::Corrupted`] for records that contradict each other (live counts that do not add
/// up, rows of unknown node ids); [`Error::Codec`]; [`Error::Storage`].
pub(crate) fn load_decided(db: &Database, scheme: Scheme) -> Result<Decided> {
    read_decided(&db.begin_read().map_err(redb_err("starting a read"))?, scheme)
}

/// [`load_decided`] from a read transaction (a head's, or a reader's of a live file).
///
/// # Errors
/// As [`load_decided`].
pub(crate) fn read_decided(read: &redb::ReadTransaction, scheme: Scheme) -> Result<Decided> {
    let meta = read_meta(&read.open_table(META).map_err(redb_err("reading the meta record"))?)?
        .ok_or_else(|| Error::unknown_format("no meta record"))?;
    let state = read.open_table(STATE).map_err(redb_err("reading the floor"))?;
    let floor = read_floor(&state)?;
    // The clock never goes back, whatever the meta record says.
    let generations = read.open_table(GENERATIONS).map_err(redb_err("reading the generations"))?;
    let newest = generations.last().map_err(redb_err("reading the generations"))?.map_or(0, |(c, _)| c.value());
    let NodeRecords { names, retired, stray } = read_registry(read)?;
    if let Some(id) = stray.first() {
        return Err(Error::Corrupted { detail: format!("node id {id} has a row and no node record") });
    }
    let nodes = Registry::new(names.into_iter().map(Arc::from).collect(), retired);
    // The registry hands out the next id after the node table's; the meta record must agree.
    if nodes.next_id() != meta.next_node {
        return Err(Error::Corrupted {
            detail: format!(
                "the node table holds {} nodes, the meta record counts {}",
                nodes.next_id(),
                meta.next_node
            ),
        });
    }
    const LIVE_COUNTS: &str = "reading the live counts";
    let live = read.open_table(LIVE).map_err(redb_err(LIVE_COUNTS))?;
    let live = live.iter().map_err(redb_err(LIVE_COUNTS))?;
    let live = live.map(|item| item.map(|(c, n)| (c.value(), n.value())).map_err(redb_err(LIVE_COUNTS)));
    // 0.1.7's entries (imported), each by its clock: a range of the prefix table, read only
    // for a file that holds some.
    const LEGACY: &str = "reading the 0.1.7 entries";
    let prefixes = read.open_table(PREFIXES).map_err(redb_err(LEGACY))?;
    let legacy: Vec<Result<u64>> = match meta.legacy_entries {
        0 => Vec::new(),
        _ => {
            let (low, high) = legacy_range();
            let range = prefixes.range(low..=high).map_err(redb_err(LEGACY))?;
            range.map(|item| item.map(|(_, v)| Entry::from_tuple(v.value()).clock).map_err(redb_err(LEGACY))).collect()
        }
    };
    let counts = (meta.entries, meta.legacy_entries);
    let horizon = Horizon::from_counts(live, legacy, floor, counts, meta.capacity)?;
    let caches = read_caches(read, floor, meta.next_node)?;
    let clock = meta.clock.max(newest);
    let engines = read_engines(read, scheme, clock)?;
    const NAMESPACE: &str = "reading namespaces";
    let ids = read.open_table(NAMESPACE_IDS).map_err(redb_err(NAMESPACE))?;
    let ids = ids.iter().map_err(redb_err(NAMESPACE))?.map(|i| i.map(|(k, v)| (k.value(), v.value())));
    let namespaces = Namespaces::new(ids.collect::<Result<_, _>>().map_err(redb_err(NAMESPACE))?, meta.next_namespace);
    Ok(Decided { clock, nodes, namespaces, horizon, caches, engines, scheme })
}

/// The prefix table's keys that can hold a 0.1.7 hash (`keys/legacy.rs`), first and last.
fn legacy_range() -> (u128, u128) {
    (table_key(&legacy_key(0)), table_key(&legacy_key(u64::MAX)))
}

/// The node caches of the file `read` reads (`floor`: its eviction floor; `next_node`: the ids
/// it has handed out).
///
/// # Errors
/// [`Error::Storage`]; [`Error::Corrupted`] for a count of 0 or a node id the file never
/// handed out.
pub(crate) fn read_caches(read: &redb::ReadTransaction, floor: u64, next_node: u32) -> Result<NodeCaches> {
    const READ: &str = "reading the node caches";
    let clocks = read.open_table(NODE_CLOCKS).map_err(redb_err(READ))?;
    let floors = read.open_table(NODE_FLOORS).map_err(redb_err(READ))?;
    let capacity = read.open_table(NODE_CAPACITY).map_err(redb_err(READ))?;
    let state = read.open_table(STATE).map_err(redb_err(READ))?;
    let default = state.get(NODE_CACHE_KEY).map_err(redb_err(READ))?.map(|g| g.value());
    NodeCaches::from_rows(
        clocks.iter().map_err(redb_err(READ))?.map(|i| i.map(|(k, v)| (k.value(), v.value())).map_err(redb_err(READ))),
        floors.iter().map_err(redb_err(READ))?.map(|i| i.map(|(k, v)| (k.value(), v.value())).map_err(redb_err(READ))),
        capacity
            .iter()
            .map_err(redb_err(READ))?
            .map(|i| i.map(|(k, v)| (Arc::from(k.value()), v.value())).map_err(redb_err(READ))),
        default,
        (floor, next_node),
    )
}

/// The engine streams of the file `read` reads (none in a file older than schema 6).
///
/// # Errors
/// [`Error::Corrupted`] or [`Error::Codec`] for a row that does not decode; [`Error::Storage`].
pub(crate) fn read_engines(read: &redb::ReadTransaction, scheme: Scheme, clock: u64) -> Result<Engines> {
    let what = "reading the engine streams";
    let streams = match read.open_table(ENGINE_STREAMS) {
        Ok(s) => s,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Engines::default()),
        Err(e) => return Err(redb_err(what)(e)),
    };
    let streams = streams.iter().map_err(redb_err(what))?.map(|item| {
        let (k, v) = item.map_err(redb_err(what))?;
        Ok((k.value(), codec::decode::<StreamRecord>("engine stream", v.value())?))
    });
    let mut engines = Engines::with_streams(streams, clock)?;
    visit_rows(read, |node, hash, row| {
        engines.add_row(node, hash, row);
        true
    })?;
    // A hybrid engine's groups, then its blocks (none before schema 8).
    match read.open_table(ENGINE_GROUPS) {
        Ok(groups) => {
            for item in groups.iter().map_err(redb_err(what))? {
                let (k, v) = item.map_err(redb_err(what))?;
                let (node, index) = k.value();
                engines.add_group(node, index, decode_kind(v.value())?);
            }
        }
        Err(redb::TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(redb_err(what)(e)),
    }
    visit_hybrid_rows(read, |node, since, hash, row| engines.add_hybrid_row(node, hash, since, row).map(|()| true))?;
    engines.finish(scheme);
    Ok(engines)
}

/// Calls `visit` with each hybrid engine's block row (node id, clock of its first store, engine
/// hash, the row), in key order, until it returns false or fails (none before schema 8).
///
/// # Errors
/// [`Error::Corrupted`] for a row that does not decode; [`Error::Storage`]; what `visit`
/// returns.
pub(crate) fn visit_hybrid_rows(
    read: &redb::ReadTransaction,
    mut visit: impl FnMut(u32, u64, u64, GroupedRow) -> Result<bool>,
) -> Result<()> {
    let what = "reading a hybrid engine's blocks";
    let table = match read.open_table(ENGINE_GROUP_BLOCKS) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(()),
        Err(e) => return Err(redb_err(what)(e)),
    };
    for item in table.iter().map_err(redb_err(what))? {
        let (k, v) = item.map_err(redb_err(what))?;
        let (node, since, hash) = k.value();
        if !visit(node, since, hash, decode_grouped(v.value())?)? {
            break;
        }
    }
    Ok(())
}

/// Calls `visit` with each engine block row of the file `read` reads (node id, engine hash, the
/// row), in key order, until it returns false: `engine_blocks/v7`, or a schema 6 file's
/// `engine_blocks/v6` (none before schema 6).
///
/// # Errors
/// [`Error::Corrupted`] for a row that does not decode; [`Error::Storage`].
pub(crate) fn visit_rows(read: &redb::ReadTransaction, mut visit: impl FnMut(u32, u64, Row) -> bool) -> Result<()> {
    let what = "reading the engine blocks";
    let rows: Box<dyn Iterator<Item = Result<(u32, u64, Row)>>> = match read.open_table(ENGINE_BLOCKS) {
        Ok(blocks) => Box::new(blocks.range::<BlockRowKey>(..).map_err(redb_err(what))?.map(|item| {
            let (k, v) = item.map_err(redb_err(what))?;
            let (node, clock, hash) = k.value();
            Ok((node, hash, decode_row(v.value(), Layout::V7, clock)?))
        })),
        Err(redb::TableError::TableDoesNotExist(_)) => match read.open_table(ENGINE_BLOCKS_V6) {
            Ok(blocks) => Box::new(blocks.range::<(u32, u64)>(..).map_err(redb_err(what))?.map(|item| {
                let (k, v) = item.map_err(redb_err(what))?;
                let (node, hash) = k.value();
                Ok((node, hash, decode_row(v.value(), Layout::V6, 0)?))
            })),
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(()),
            Err(e) => return Err(redb_err(what)(e)),
        },
        Err(e) => return Err(redb_err(what)(e)),
    };
    for row in rows {
        let (node, hash, row) = row?;
        if !visit(node, hash, row) {
            break;
        }
    }
    Ok(())
}

/// Every (node, clock) pair the file ties a block to, 0.1.7's entries left out (node caches
/// never count them): each block's node in the prefix table and the nodes among its others.
/// What a size is seeded from, and what `check` recounts.
///
/// # Errors
/// [`Error::Storage`] for a failed read.
pub(crate) fn each_named_pair(
    prefixes: &impl ReadableTable<u128, (u32, u32, u32, u64)>,
    others: Option<&impl ReadableTable<u128, &'static [u8]>>,
    mut see: impl FnMut(u32, u64),
) -> Result<()> {
    for item in prefixes.iter().map_err(redb_err("reading the prefix table"))? {
        let (key, value) = item.map_err(redb_err("reading the prefix table"))?;
        if !is_legacy(&key.value().to_be_bytes()) {
            let entry = Entry::from_tuple(value.value());
            see(entry.node, entry.clock);
        }
    }
    let Some(others) = others else { return Ok(()) };
    for item in others.iter().map_err(redb_err("reading the others"))? {
        let (key, row) = item.map_err(redb_err("reading the others"))?;
        if !is_legacy(&key.value().to_be_bytes()) {
            members(row.value()).for_each(|(node, clock)| see(node, clock));
        }
    }
    Ok(())
}

/// Per node of `ids`, the blocks the last commit names it on (prefix table or others), by
/// clock, those above `above(node)` (the eviction floor and the node's own); 0.1.7's entries
/// are not counted. What a node cache starts from when it is first kept: one scan of each
/// table (nothing to scan for no ids).
///
/// # Errors
/// [`Error::Storage`] for a failed read.
pub(crate) fn named_pairs(
    db: &Database,
    ids: &[u32],
    above: impl Fn(u32) -> u64,
) -> Result<BTreeMap<u32, BTreeMap<u64, u64>>> {
    let mut counts: BTreeMap<u32, BTreeMap<u64, u64>> = BTreeMap::new();
    if ids.is_empty() {
        return Ok(counts);
    }
    let read = db.begin_read().map_err(redb_err("starting a read"))?;
    let primary = read.open_table(PREFIXES).map_err(redb_err("reading the prefix table"))?;
    let others = read.open_table(OTHERS).map_err(redb_err("reading the others"))?;
    each_named_pair(&primary, Some(&others), |node, clock| {
        if ids.contains(&node) && clock > above(node) {
            *counts.entry(node).or_default().entry(clock).or_default() += 1;
        }
    })?;
    Ok(counts)
}
