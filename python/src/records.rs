//! What the calls return: `Hit` and `Prefix` as native classes (made on every request), the
//! reports as the frozen dataclasses of `superfluid_warm/_types.py`.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString, PyTuple};
use superfluid_warm as sw;

/// The node that ran the longest remembered prefix of a prompt, how many tokens of the prompt
/// that prefix is (a multiple of 64, at least 128), and where the node keeps it. Immutable,
/// compared and hashed by value.
#[pyclass(frozen, eq, hash, module = "superfluid_warm", name = "Hit")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Hit {
    /// The node's name.
    #[pyo3(get)]
    pub node: String,
    /// How many tokens of the prompt the node ran (a multiple of 64, at least 128).
    #[pyo3(get)]
    pub tokens: usize,
    /// The slowest tier the node keeps that prefix in.
    pub tier: &'static str,
    /// Of `tokens`, how many from the prompt's start are in GPU memory.
    #[pyo3(get)]
    pub gpu_tokens: usize,
}

/// The tiers a hit may name, fastest first ("other": a medium this build does not know).
const TIERS: [&str; 4] = ["gpu", "cpu", "storage", "other"];

/// The name of a medium, as `Hit.tier` gives it.
pub fn tier(medium: sw::Medium) -> &'static str {
    match medium {
        sw::Medium::Gpu => "gpu",
        sw::Medium::Cpu => "cpu",
        sw::Medium::Storage => "storage",
        _ => "other",
    }
}

#[pymethods]
impl Hit {
    /// A hit (for tests and fakes: the index makes its own): by default all of it in GPU
    /// memory (``tier="gpu"``, ``gpu_tokens=tokens``).
    #[new]
    #[pyo3(signature = (node, tokens, tier="gpu", gpu_tokens=None))]
    fn new(node: String, tokens: usize, tier: &str, gpu_tokens: Option<usize>) -> PyResult<Hit> {
        let Some(tier) = TIERS.iter().copied().find(|t| *t == tier) else {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("tier must be one of {TIERS:?}")));
        };
        Ok(Hit { node, tokens, tier, gpu_tokens: gpu_tokens.unwrap_or(tokens) })
    }

    /// The slowest tier the node keeps that prefix in, by its engine's KV events: ``"gpu"``
    /// when all of it is in GPU memory, ``"cpu"`` or ``"storage"`` when an offloading
    /// connector keeps part of it there (``"other"``: a medium this build does not know).
    /// ``"gpu"`` for a node known by its ``ran``s.
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Hit(node={}, tokens={}, tier='{}', gpu_tokens={})",
            PyString::new(py, &self.node).repr()?,
            self.tokens,
            self.tier,
            self.gpu_tokens
        ))
    }

    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str, &'static str) {
        ("node", "tokens", "tier", "gpu_tokens")
    }
}

impl From<sw::Hit> for Hit {
    fn from(h: sw::Hit) -> Hit {
        Hit { tier: tier(h.tier), gpu_tokens: h.gpu_tokens, node: h.node, tokens: h.tokens }
    }
}

/// A prompt's block hashes, computed once by `prefix(...)` and used for both the question
/// (`warmest_prefix`, `warm_nodes_prefix`) and the answer (`ran_prefix`) of one request. Tied to
/// the hash scheme of the index that made it.
#[pyclass(frozen, module = "superfluid_warm", name = "Prefix")]
pub struct Prefix {
    pub inner: sw::Prefix,
}

#[pymethods]
impl Prefix {
    /// Whole 64-token blocks in the prompt.
    #[getter]
    fn blocks(&self) -> usize {
        self.inner.blocks()
    }

    /// Tokens covered by whole blocks.
    #[getter]
    fn tokens(&self) -> usize {
        self.inner.tokens()
    }

    /// The model the prefix was hashed for.
    #[getter]
    fn model(&self) -> &str {
        self.inner.namespace().model()
    }

    /// Whether it was hashed for a tenant (never shown).
    #[getter]
    fn has_tenant(&self) -> bool {
        self.inner.namespace().has_tenant()
    }

    fn __len__(&self) -> usize {
        self.inner.tokens()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let tenant = if self.has_tenant() { ", tenant=..." } else { "" };
        Ok(format!("Prefix(model={}{tenant}, blocks={})", PyString::new(py, self.model()).repr()?, self.blocks()))
    }
}

/// The dataclasses of `superfluid_warm._types`, imported once.
static TYPES: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// `superfluid_warm._types.<name>(**kwargs)`.
pub fn record<'py>(py: Python<'py>, name: &str, kwargs: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyAny>> {
    let module = TYPES.get_or_try_init(py, || py.import("superfluid_warm._types").map(Bound::unbind))?;
    module.bind(py).getattr(name)?.call((), Some(kwargs))
}

/// Keyword arguments: `kwargs!(py, a = 1, b = "x")`.
macro_rules! kwargs {
    ($py:expr, $($key:ident = $value:expr),* $(,)?) => {{
        let dict = pyo3::types::PyDict::new($py);
        $( dict.set_item(stringify!($key), $value)?; )*
        dict
    }};
}
#[cfg_attr(not(feature = "nats"), allow(unused_imports))] // used by `shared.rs` too
pub(crate) use kwargs;

pub fn stats<'py>(py: Python<'py>, s: &sw::Stats) -> PyResult<Bound<'py, PyAny>> {
    let nodes = s
        .nodes
        .iter()
        .map(|n| record(py, "NodeStats", &kwargs!(py, name = n.name.as_str(), forgotten = n.forgotten)))
        .collect::<PyResult<Vec<_>>>()?;
    let caches = s.node_caches.iter().map(|c| node_cache(py, c)).collect::<PyResult<Vec<_>>>()?;
    let open_check = match s.open_check {
        sw::OpenCheck::Seal => "seal",
        sw::OpenCheck::Pages => "pages",
        sw::OpenCheck::Skipped => "skipped",
        _ => "other",
    };
    record(
        py,
        "Stats",
        &kwargs!(
            py,
            entries = s.entries,
            legacy_entries = s.legacy_entries,
            capacity = s.capacity,
            clock = s.clock,
            nodes = PyTuple::new(py, nodes)?,
            others = s.others,
            reclaimable = s.reclaimable,
            pending = s.pending,
            open_check = open_check,
            upgraded_from = s.upgraded_from,
            recovered_from = s.recovered_from,
            node_caches = PyTuple::new(py, caches)?,
        ),
    )
}

fn node_cache<'py>(py: Python<'py>, c: &sw::NodeCacheStats) -> PyResult<Bound<'py, PyAny>> {
    record(
        py,
        "NodeCacheStats",
        &kwargs!(py, node = c.node.as_str(), held = c.held, capacity = c.capacity, floor = c.floor),
    )
}

pub fn import_report<'py>(py: Python<'py>, r: &sw::ImportReport) -> PyResult<Bound<'py, PyAny>> {
    record(
        py,
        "ImportReport",
        &kwargs!(
            py,
            in_file = r.in_file,
            imported = r.imported,
            already_imported = r.already_imported,
            evicted = r.evicted,
        ),
    )
}

pub fn engine_outcome<'py>(py: Python<'py>, o: sw::EngineOutcome) -> PyResult<Bound<'py, PyAny>> {
    let (kind, from) = match o {
        sw::EngineOutcome::Applied => ("applied", None),
        sw::EngineOutcome::Duplicate => ("duplicate", None),
        sw::EngineOutcome::Gap { from } => ("gap", Some(from)),
        _ => ("other", None),
    };
    record(py, "EngineOutcome", &kwargs!(py, kind = kind, replay_from = from))
}

pub fn engine_stats<'py>(py: Python<'py>, e: &sw::EngineStats) -> PyResult<Bound<'py, PyAny>> {
    let c = &e.counts;
    let counts = record(
        py,
        "EngineCounts",
        &kwargs!(
            py,
            batches = c.batches,
            stored = c.stored,
            removed = c.removed,
            clears = c.clears,
            restarts = c.restarts,
            gaps = c.gaps,
            lost = c.lost,
            duplicate_batches = c.duplicate_batches,
            duplicate_blocks = c.duplicate_blocks,
            unknown_parents = c.unknown_parents,
            unknown_removals = c.unknown_removals,
            other_medium = c.other_medium,
            unkeyed = c.unkeyed,
            malformed = c.malformed,
            unaligned = c.unaligned,
        ),
    )?;
    record(
        py,
        "EngineStats",
        &kwargs!(
            py,
            node = e.node.as_str(),
            last_seq = e.last_seq,
            last_ts = e.last_ts,
            engine_blocks = e.engine_blocks,
            by_tier = PyTuple::new(py, e.by_tier)?,
            blocks = e.blocks,
            counts = counts,
            groups = PyTuple::new(py, e.groups.iter().map(|g| group(py, g)).collect::<PyResult<Vec<_>>>()?)?,
            unplaced_blocks = e.unplaced_blocks,
            group_changes = e.group_changes,
        ),
    )
}

/// A KV cache group as `(index, kind, window)`.
fn group<'py>(py: Python<'py>, g: &sw::CacheGroup) -> PyResult<Bound<'py, PyTuple>> {
    (g.index, g.kind.name(), g.kind.window()).into_pyobject(py)
}

pub fn file_check<'py>(py: Python<'py>, c: &sw::FileCheck) -> PyResult<Bound<'py, PyAny>> {
    record(
        py,
        "FileCheck",
        &kwargs!(
            py,
            healthy = c.healthy(),
            problems = PyTuple::new(py, c.problems())?,
            integrity = c.integrity,
            crashed_writer = c.crashed_writer.is_some(),
            crashed_writer_pid = c.crashed_writer.flatten(),
            entries = c.invariants.as_ref().map(|i| i.entries),
            side_file_missing = c.side_file_missing,
        ),
    )
}

pub fn listen_status<'py>(py: Python<'py>, s: &sw::ListenStatus) -> PyResult<Bound<'py, PyAny>> {
    let engines = s
        .engines
        .iter()
        .map(|e| {
            record(
                py,
                "EngineStatus",
                &kwargs!(
                    py,
                    node = e.node.as_str(),
                    connected = e.connected,
                    received = e.received,
                    undecodable = e.undecodable,
                    malformed = e.malformed,
                    replays = e.replays,
                    replays_short = e.replays_short,
                    replays_skipped = e.replays_skipped,
                    replaying = e.replaying,
                    replay_backoff_s = e.replay_backoff_s,
                    dropped = e.dropped,
                    lag_p50_ms = e.lag_p50_ms,
                    lag_p99_ms = e.lag_p99_ms,
                    silent_for_s = e.silent_for_s,
                    error = e.error.as_deref(),
                ),
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    let sharing = match &s.sharing {
        None => None,
        Some(l) => Some(record(
            py,
            "LinkStatus",
            &kwargs!(
                py,
                stream = l.stream.as_str(),
                head = l.head.as_str(),
                connected = l.connected,
                ready = l.ready,
                applied = l.applied,
                unapplied = l.unapplied,
                published = l.published,
                buffered = l.buffered,
                dropped = l.dropped,
                error = l.error.as_deref(),
                halted = l.halted.as_deref(),
            ),
        )?),
    };
    record(
        py,
        "ListenStatus",
        &kwargs!(
            py,
            pid = s.pid,
            running = s.running,
            written_at = s.written_at,
            refresh_s = s.refresh_s,
            error = s.error.as_deref(),
            down = s.down(),
            sharing = sharing,
            engines = PyTuple::new(py, engines)?,
        ),
    )
}
