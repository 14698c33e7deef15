//! `Warm` (the index a head links) and `Reader` (a file's last commit, read-only), as Python
//! classes.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::PyType;
use superfluid_warm as sw;

use crate::engine::{EngineBatch, payload_bytes};
use crate::errors::{Failure, Int, Result, count, millis, seq as batch_seq};
use crate::handle::{Ask, Handle, tenant};
use crate::records::{self, Hit, Prefix};
#[cfg(feature = "test-hooks")]
use crate::tokens::tokens;

/// The settings of `Warm.open` (and `SharedWarm.open`), as Python gives them.
pub struct Settings {
    pub capacity: Option<Int>,
    pub nodes_per_prefix: Option<Int>,
    pub node_cache_blocks: Option<Int>,
    pub sync_window_ms: Option<f64>,
    pub cache_bytes: Option<Int>,
    pub check_integrity: bool,
    pub compact_on_close: bool,
    pub engine_grace_ms: Option<f64>,
    pub attention_chunk: Option<Int>,
    pub import_json: Option<PathBuf>,
}

impl Settings {
    /// The library's builder, every setting checked (out of range: `InvalidConfig`).
    pub fn builder(&self) -> Result<sw::Builder> {
        let mut b = sw::Warm::builder();
        if let Some(c) = self.capacity {
            b.capacity(count("capacity", c)?);
        }
        if let Some(n) = self.nodes_per_prefix {
            // 0 is refused by the library with its own message; a huge one too.
            b.nodes_per_prefix(usize::try_from(count("nodes per prefix", n)?).unwrap_or(usize::MAX));
        }
        if let Some(n) = self.node_cache_blocks {
            b.node_cache_blocks(count("node cache blocks", n)?);
        }
        if let Some(ms) = self.sync_window_ms {
            b.sync_window(millis("sync window", ms)?);
        }
        if let Some(bytes) = self.cache_bytes {
            b.cache_size(usize::try_from(count("cache bytes", bytes)?).unwrap_or(usize::MAX));
        }
        if let Some(ms) = self.engine_grace_ms {
            b.engine_grace(millis("engine grace", ms)?);
        }
        if let Some(n) = self.attention_chunk {
            b.attention_chunk(usize::try_from(count("attention chunk", n)?).unwrap_or(usize::MAX));
        }
        if let Some(path) = &self.import_json {
            b.import_json(path.clone());
        }
        b.check_integrity_on_open(self.check_integrity).compact_on_close(self.compact_on_close);
        Ok(b)
    }
}

/// A node cache size: `None`, or 1 to `MAX_CAPACITY` blocks (checked by the library; a negative
/// one here).
pub fn cache_blocks(blocks: Option<Int>) -> Result<Option<u64>> {
    blocks
        .map(|b| {
            if b.0 < 0 {
                return Err(Failure::Invalid(
                    "InvalidConfig",
                    format!("invalid setting: node cache of {b} blocks (1 or more)"),
                ));
            }
            // Over u64: the library refuses it with its own range.
            Ok(u64::try_from(b.0).unwrap_or(u64::MAX))
        })
        .transpose()
}

/// The read-side methods of an index class (`prefix`, `warmest`, `warm_nodes` and their
/// `_prefix` forms) with the class's own methods: one `#[pymethods]` block.
macro_rules! index_methods {
    ($ty:ident { $($extra:tt)* }) => {
        #[pymethods]
        impl $ty {
            /// Hashes ``tokens`` for ``model`` (and ``tenant``) once, for ``warmest_prefix``,
            /// ``warm_nodes_prefix`` and ``ran_prefix``: hash once per request, use twice.
            ///
            /// ``tokens``: a ``list[int]`` (or any sequence of ints), or, read in place without a
            /// copy, a C-contiguous 1-D buffer of uint32 (a numpy ``uint32`` array,
            /// ``array('I')``). ``tenant`` (``str`` or ``bytes``): a tenant's prefixes are never
            /// shared with anyone else's, even for the same model and tokens.
            #[pyo3(signature = (model, tokens, tenant=None))]
            fn prefix(
                &self,
                py: Python<'_>,
                model: PyBackedStr,
                tokens: &Bound<'_, PyAny>,
                tenant: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<Prefix> {
                let (tokens, tenant) = (crate::tokens::tokens(tokens)?, crate::handle::tenant(tenant)?);
                crate::handle::prefix(py, &self.handle, Ask::new(&model, &tokens, &tenant))
            }

            /// The node that ran the longest remembered prefix of ``tokens`` for ``model`` (and
            /// ``tenant``), and how many tokens that prefix is; ``None`` under two blocks (128
            /// tokens). Sees every ``ran`` that returned. ``tokens`` as for ``prefix``.
            #[pyo3(signature = (model, tokens, tenant=None))]
            fn warmest(
                &self,
                py: Python<'_>,
                model: PyBackedStr,
                tokens: &Bound<'_, PyAny>,
                tenant: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<Option<Hit>> {
                let (tokens, tenant) = (crate::tokens::tokens(tokens)?, crate::handle::tenant(tenant)?);
                crate::handle::warmest(py, &self.handle, Ask::new(&model, &tokens, &tenant))
            }

            /// Every remembered node that ran a prefix of ``tokens`` (at least two blocks), with
            /// how many tokens of it, longest first (ties: the newest first); the first is
            /// ``warmest``'s answer. A forgotten node is never listed.
            #[pyo3(signature = (model, tokens, tenant=None))]
            fn warm_nodes(
                &self,
                py: Python<'_>,
                model: PyBackedStr,
                tokens: &Bound<'_, PyAny>,
                tenant: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<Vec<Hit>> {
                let (tokens, tenant) = (crate::tokens::tokens(tokens)?, crate::handle::tenant(tenant)?);
                crate::handle::warm_nodes(py, &self.handle, Ask::new(&model, &tokens, &tenant))
            }

            /// ``warmest`` for a prefix made by ``prefix``.
            fn warmest_prefix(&self, py: Python<'_>, prefix: PyRef<'_, Prefix>) -> PyResult<Option<Hit>> {
                crate::handle::warmest_prefix(py, &self.handle, &prefix)
            }

            /// ``warm_nodes`` for a prefix made by ``prefix``.
            fn warm_nodes_prefix(&self, py: Python<'_>, prefix: PyRef<'_, Prefix>) -> PyResult<Vec<Hit>> {
                crate::handle::warm_nodes_prefix(py, &self.handle, &prefix)
            }

            /// Whether ``close`` was called.
            #[getter]
            fn closed(&self) -> bool {
                self.handle.is_closed()
            }

            /// The index file's path.
            #[getter]
            fn path(&self) -> &str {
                &self.path
            }

            /// Itself: ``with Warm.open(path) as warm:`` closes it at the end of the block.
            fn __enter__(slf: Py<Self>) -> Py<Self> {
                slf
            }

            /// Closes it (even when the block raised).
            #[pyo3(signature = (*_args))]
            fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
                self.close(py)?;
                Ok(false)
            }

            fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
                let state = if self.handle.is_closed() { "closed" } else { "open" };
                let path = pyo3::types::PyString::new(py, &self.path).repr()?;
                Ok(format!("{}({path}, {state})", stringify!($ty)))
            }

            $($extra)*
        }
    };
}
#[cfg_attr(not(feature = "nats"), allow(unused_imports))] // used by `shared.rs` too
pub(crate) use index_methods;

/// Which node last ran each prompt prefix, kept in a crash-safe redb file: the index a router
/// (a head) asks before it places a request (``warmest``, ``warm_nodes``) and tells after
/// (``ran``).
///
/// Open it with ``Warm.open(path, ...)``, use it from any number of threads (every call
/// releases the GIL while it hashes, searches or waits for a commit), and close it with
/// ``close()`` or a ``with`` block. Only one process may have a file open at a time.
#[pyclass(frozen, module = "superfluid_warm", name = "Warm")]
pub struct Warm {
    handle: Handle<sw::Warm>,
    path: String,
}

impl Warm {
    pub fn handle(&self) -> &Handle<sw::Warm> {
        &self.handle
    }
}

index_methods!(Warm {
    /// Opens (or creates) the index at ``path``; a file left by a crash is recovered to its
    /// last commit.
    ///
    /// Settings (``None``: the default, or what the file has recorded):
    ///
    /// - ``capacity``: most entries (64-token blocks) kept; past it the oldest eighth is
    ///   evicted. Recorded in the file (a smaller one evicts on open). Default 1,048,576.
    /// - ``nodes_per_prefix``: nodes a block remembers (1 to 64, default 4).
    /// - ``node_cache_blocks``: the size of each node's KV cache in blocks: the index then
    ///   answers only what that LRU cache still holds. Recorded in the file.
    /// - ``sync_window_ms``: longest a ``ran`` waits before a background commit makes it
    ///   durable (default 50; 0 commits every ``ran`` before it returns; at most 60,000).
    /// - ``cache_bytes``: bytes of the file kept in memory (default 128 MiB).
    /// - ``check_integrity``: verify the file when it opens (default on).
    /// - ``compact_on_close``: compact a sparse file at a clean close (default on).
    /// - ``engine_grace_ms``: how long a ``ran`` on a node whose engine reports its KV events
    ///   is answered before the events confirm it (default 3,000).
    /// - ``attention_chunk``: the served model's attention chunk in tokens, for engines with
    ///   chunked local attention layers (Llama 4: 8,192); without it they hold nothing.
    /// - ``import_json``: a 0.1.7 ``warm.json`` to import once.
    ///
    /// Raises ``IndexFileError`` (``AlreadyOpen``, ``UnknownFormat``, ``Corrupted``, ...),
    /// ``InvalidInputError`` (``InvalidConfig``) or ``StorageError``.
    #[classmethod]
    #[pyo3(signature = (
        path, *, capacity=None, nodes_per_prefix=None, node_cache_blocks=None, sync_window_ms=None,
        cache_bytes=None, check_integrity=true, compact_on_close=true, engine_grace_ms=None, attention_chunk=None,
        import_json=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn open(
        _cls: &Bound<'_, PyType>,
        py: Python<'_>,
        path: PathBuf,
        capacity: Option<Int>,
        nodes_per_prefix: Option<Int>,
        node_cache_blocks: Option<Int>,
        sync_window_ms: Option<f64>,
        cache_bytes: Option<Int>,
        check_integrity: bool,
        compact_on_close: bool,
        engine_grace_ms: Option<f64>,
        attention_chunk: Option<Int>,
        import_json: Option<PathBuf>,
    ) -> PyResult<Warm> {
        let settings = Settings {
            capacity,
            nodes_per_prefix,
            node_cache_blocks,
            sync_window_ms,
            cache_bytes,
            check_integrity,
            compact_on_close,
            engine_grace_ms,
            attention_chunk,
            import_json,
        };
        let shown = path.display().to_string();
        let warm = crate::errors::detached(py, || Ok(settings.builder()?.open(&path)?))?;
        Ok(Warm { handle: Handle::new(warm, "index"), path: shown })
    }

    /// Records that ``node`` ran ``tokens`` for ``model`` (and ``tenant``): every whole block of
    /// it now points at ``node``. Atomic; answered at once by every thread; durable after the
    /// next ``sync()`` or within the sync window. Never waits for the disk (only for
    /// back-pressure when the commit thread is far behind).
    ///
    /// Raises ``InvalidInputError`` (``InvalidName``) for an empty or over-long model or node,
    /// ``StorageError`` (``CommitFailed``) while background commits fail (see
    /// ``needs_reopen``).
    #[pyo3(signature = (model, tokens, node, tenant=None))]
    fn ran(
        &self,
        py: Python<'_>,
        model: PyBackedStr,
        tokens: &Bound<'_, PyAny>,
        node: PyBackedStr,
        tenant: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (tokens, tenant) = (crate::tokens::tokens(tokens)?, self::tenant(tenant)?);
        let ask = Ask::new(&model, &tokens, &tenant);
        let node: &str = &node;
        self.handle.with(py, |warm| Ok(warm.ran_prefix(&ask.prefix(warm)?, node)?))
    }

    /// ``ran`` for a prefix made by ``prefix`` (hashed once for the question and the answer).
    fn ran_prefix(&self, py: Python<'_>, prefix: PyRef<'_, Prefix>, node: PyBackedStr) -> PyResult<()> {
        let (p, node): (&sw::Prefix, &str) = (&prefix.inner, &node);
        self.handle.with(py, |warm| Ok(warm.ran_prefix(p, node)?))
    }

    /// Forgets node ``name`` (it restarted or left: its KV cache is gone): no answer names it
    /// for anything it ran before, durably, when this returns. Its next ``ran`` starts afresh.
    /// A node never seen is nothing to forget.
    fn forget_node(&self, py: Python<'_>, name: PyBackedStr) -> PyResult<()> {
        let name: &str = &name;
        self.handle.with(py, |warm| Ok(warm.forget_node(name)?))
    }

    /// Sets node ``name``'s KV cache size in 64-token blocks (``None``: the default of
    /// ``node_cache_blocks`` again), for nodes of different sizes; a smaller size drops its
    /// oldest blocks at once. Kept in the file; returns once durable.
    #[pyo3(signature = (name, blocks))]
    fn set_node_capacity(&self, py: Python<'_>, name: PyBackedStr, blocks: Option<Int>) -> PyResult<()> {
        let name: &str = &name;
        self.handle.with(py, |warm| Ok(warm.set_node_capacity(name, cache_blocks(blocks)?)?))
    }

    /// Sets (``None``: removes) the default size of a node's KV cache, as ``node_cache_blocks``
    /// does at open. Kept in the file; returns once durable.
    #[pyo3(signature = (blocks))]
    fn set_node_cache_default(&self, py: Python<'_>, blocks: Option<Int>) -> PyResult<()> {
        self.handle.with(py, |warm| Ok(warm.set_node_cache_default(cache_blocks(blocks)?)?))
    }

    /// Makes every ``ran`` that returned before this call durable, whoever made it. Cheap when
    /// nothing changed. Raises ``StorageError`` if the commit fails (what was committed before
    /// is intact; the ``ran``s since stay answered and are retried).
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        self.handle.with(py, |warm| Ok(warm.sync()?))
    }

    /// Counts and settings (``Stats``), as of every ``ran`` that returned.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stats = self.handle.with(py, |warm| Ok(warm.stats()?))?;
        records::stats(py, &stats)
    }

    /// Imports a 0.1.7 ``warm.json`` in one transaction (the JSON is only read; the same file
    /// twice does nothing the second time). Returns an ``ImportReport``.
    fn import_json<'py>(&self, py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyAny>> {
        let report = self.handle.with(py, |warm| Ok(warm.import_json(&path)?))?;
        records::import_report(py, &report)
    }

    /// Applies one batch of node ``node``'s engine KV cache events (made by
    /// ``decode_engine_batch``), in the order its engine numbered them. Returns an
    /// ``EngineOutcome``: applied, a duplicate, or a gap to replay.
    fn engine_batch<'py>(
        &self,
        py: Python<'py>,
        node: PyBackedStr,
        batch: PyRef<'py, EngineBatch>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (node, batch): (&str, &sw::EngineBatch) = (&node, &batch.inner);
        let outcome = self.handle.with(py, |warm| Ok(warm.engine_batch(node, batch)?))?;
        records::engine_outcome(py, outcome)
    }

    /// Decodes one ZMQ message of vLLM's (or SGLang's) KV events and applies it to node
    /// ``node``: ``seq`` is the message's second frame as an int
    /// (``int.from_bytes(frame, "big")``), ``payload`` its third, ``model`` the model the engine
    /// serves. ``decode_engine_batch`` then ``engine_batch`` in one call, the GIL released.
    /// Raises ``EngineError`` for a payload that does not decode (nothing is applied).
    fn engine_payload<'py>(
        &self,
        py: Python<'py>,
        node: PyBackedStr,
        seq: Int,
        payload: &Bound<'py, PyAny>,
        model: PyBackedStr,
    ) -> PyResult<Bound<'py, PyAny>> {
        let seq = batch_seq(seq).map_err(|e| e.into_py(py))?;
        let payload = payload_bytes(payload)?;
        let (node, model, payload): (&str, &str, &[u8]) = (&node, &model, &payload);
        let outcome = self.handle.with(py, |warm| {
            let batch = sw::decode_engine_batch(seq, payload, model)?;
            Ok(warm.engine_batch(node, &batch)?)
        })?;
        records::engine_outcome(py, outcome)
    }

    /// Node ``node``'s engine cannot give the batches before ``batch`` (its replay started later
    /// than asked, or it has none): what the node was known to hold is dropped and ``batch``
    /// starts its stream again.
    fn engine_resync(&self, py: Python<'_>, node: PyBackedStr, batch: PyRef<'_, EngineBatch>) -> PyResult<()> {
        let (node, batch): (&str, &sw::EngineBatch) = (&node, &batch.inner);
        self.handle.with(py, |warm| Ok(warm.engine_resync(node, batch)?))
    }

    /// Where each engine stream stands and what each node holds: a list of ``EngineStats``.
    fn engine_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let stats = self.handle.with(py, |warm| Ok(warm.engine_stats()?))?;
        stats.iter().map(|s| records::engine_stats(py, s)).collect()
    }

    /// Commits what is pending, marks the file cleanly closed and closes it. Later calls raise
    /// ``ClosedError``; closing again does nothing. Waits for calls in progress on other
    /// threads. Raises ``StorageError`` if the last commit fails.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.handle.close(py, |warm| Ok(warm.close()?))
    }
});

/// A file's answers as of its last commit, read-only, whether or not a head has it open: what
/// a head would answer had it just opened the file. Open another to see later commits.
#[pyclass(frozen, module = "superfluid_warm", name = "Reader")]
pub struct Reader {
    handle: Handle<sw::Reader>,
    path: String,
}

index_methods!(Reader {
    /// Opens ``path`` read-only at its last commit (verified first). Raises ``IndexFileError``
    /// for a file that is not an index, or was left by a crashed head (open it once with
    /// ``Warm.open`` to recover it).
    #[classmethod]
    fn open(_cls: &Bound<'_, PyType>, py: Python<'_>, path: PathBuf) -> PyResult<Reader> {
        let shown = path.display().to_string();
        let reader = crate::errors::detached(py, || Ok(sw::Reader::open(&path)?))?;
        Ok(Reader { handle: Handle::new(reader, "reader"), path: shown })
    }

    /// Lets the file go (a head may then rewrite it). Later calls raise ``ClosedError``.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.handle.close(py, |reader| {
            drop(reader);
            Ok(())
        })
    }
});

/// Checks the index file at ``path`` without writing it: redb's page checksums (on a copy,
/// when no head has it open) and the index's invariants. A file left by a crashed head is
/// checked on a recovered copy and reported as needing recovery. Returns a ``FileCheck``;
/// raises ``IndexFileError`` or ``StorageError`` when the file cannot be checked at all (a
/// corrupted file is a verdict, not an error).
#[pyfunction]
pub fn check_file<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyAny>> {
    let check = crate::errors::detached(py, || Ok(sw::IndexFile::new(&path).check()?))?;
    records::file_check(py, &check)
}

/// The status a listener (``superfluid-warm listen``) last wrote beside the index file at
/// ``path`` (``<path>.listen.json``), as a ``ListenStatus``; ``None`` if there is none. Raises
/// ``IndexFileError`` if the status file is not one, ``StorageError`` if it cannot be read.
#[pyfunction]
pub fn listen_status<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Option<Bound<'py, PyAny>>> {
    let status = crate::errors::detached(py, || Ok(sw::IndexFile::new(&path).listen_status()?))?;
    status.map(|s| records::listen_status(py, &s)).transpose()
}

/// Internal (the tests and ``bench.py``): replays ``prompts`` through a fresh ``Warm`` at
/// ``path`` entirely in Rust, as a router would: ``warmest``, then ``ran`` on the warm node, else
/// ``node-{i % 8}``. Returns ``(answers, warm_nodes_lists, nanoseconds)``: per request its
/// ``warmest`` answer as ``(node, tokens)`` or ``None``, its ``warm_nodes`` (before the ``ran``)
/// when ``warm_nodes`` is true (else an empty list each), and the time of its two calls.
#[cfg(feature = "test-hooks")]
#[pyfunction]
#[pyo3(signature = (path, model, prompts, *, capacity=None, sync_window_ms=None, tenant=None, warm_nodes=false))]
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn _replay_rust(
    py: Python<'_>,
    path: PathBuf,
    model: String,
    prompts: Vec<Bound<'_, PyAny>>,
    capacity: Option<Int>,
    sync_window_ms: Option<f64>,
    tenant: Option<&Bound<'_, PyAny>>,
    warm_nodes: bool,
) -> PyResult<(Vec<Option<(String, usize)>>, Vec<Vec<(String, usize)>>, Vec<u64>)> {
    use sw::ReadIndex;
    let tenant = self::tenant(tenant)?;
    // Copied before the clock starts: the Rust side gets its tokens as a Rust caller has them.
    let prompts: Vec<Vec<u32>> =
        prompts.iter().map(|p| tokens(p).map(|t| t.as_slice().to_vec())).collect::<PyResult<_>>()?;
    let settings = Settings {
        capacity,
        nodes_per_prefix: None,
        node_cache_blocks: None,
        sync_window_ms,
        cache_bytes: None,
        check_integrity: true,
        compact_on_close: true,
        engine_grace_ms: None,
        attention_chunk: None,
        import_json: None,
    };
    crate::errors::detached(py, || {
        let warm = settings.builder()?.open(&path)?;
        let ns = sw::Namespace::of(&model, tenant.as_deref())?;
        let (mut answers, mut lists, mut nanos) = (Vec::new(), Vec::new(), Vec::new());
        for (i, tokens) in prompts.iter().enumerate() {
            let list = match warm_nodes {
                true => warm.warm_nodes_prefix(&warm.prefix(&ns, tokens))?,
                false => Vec::new(),
            };
            let started = std::time::Instant::now();
            let hit = match tenant {
                None => warm.warmest(&model, tokens)?,
                Some(_) => warm.warmest_prefix(&warm.prefix(&ns, tokens))?,
            };
            let node = hit.as_ref().map_or_else(|| format!("node-{}", i % 8), |h| h.node.clone());
            match tenant {
                None => warm.ran(&model, tokens, &node)?,
                Some(_) => warm.ran_prefix(&warm.prefix(&ns, tokens), &node)?,
            }
            nanos.push(u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX));
            answers.push(hit.map(|h| (h.node, h.tokens)));
            lists.push(list.into_iter().map(|h| (h.node, h.tokens)).collect());
        }
        warm.close()?;
        Ok((answers, lists, nanos))
    })
}
