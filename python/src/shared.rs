//! `SharedWarm` (feature `nats`): a head's index shared with other heads through a NATS
//! JetStream stream.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::PyType;
use superfluid_warm as sw;

use crate::errors::{Int, count, detached, millis};
use crate::handle::{Ask, Handle, tenant};
use crate::records::{self, Hit, Prefix, kwargs, record};
use crate::tokens::tokens;
use crate::warm::{Settings, cache_blocks, index_methods};

/// A head's event, as ``SharedWarm.ran`` returns it: ``SharedWarm.wait_for(ticket)`` waits
/// until this head has applied it back from the stream.
#[pyclass(frozen, eq, module = "superfluid_warm", name = "Ticket")]
#[derive(PartialEq)]
pub struct Ticket {
    inner: sw::Ticket,
}

#[pymethods]
impl Ticket {
    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}

/// Seconds as a duration for the waits: finite and not negative.
fn seconds(what: &'static str, s: f64) -> crate::errors::Result<Duration> {
    millis(what, s * 1000.0)
}

/// A head's index shared with the other heads of one NATS JetStream stream (built with the
/// ``nats`` feature: ``maturin build --release --features nats``).
///
/// Every head publishes its ``ran``s and forgets to the stream and applies every event of it,
/// its own included, in stream order, to its own file: heads that applied the same prefix of
/// the stream answer alike. A head's own ``ran`` is answered at once and never waits on the
/// network. Same read side as ``Warm``.
#[pyclass(frozen, module = "superfluid_warm", name = "SharedWarm")]
pub struct SharedWarm {
    handle: Handle<sw::SharedWarm>,
    path: String,
}

index_methods!(SharedWarm {
    /// Opens the head's file at ``path`` (settings as ``Warm.open``; the sync window must not
    /// be 0) and starts sharing through stream ``stream`` of the NATS server at ``url``
    /// (``nats://host:port``) as head ``head`` (a name of its own, kept across restarts).
    /// Returns without waiting for the server (see ``wait_ready``). ``max_age_s`` and
    /// ``max_bytes``: the retention of a stream it creates; ``buffer_events``: most events
    /// buffered while the server is unreachable; ``publish_timeout_ms``: how long ``sync``
    /// waits for the head's events to be in the stream.
    #[classmethod]
    #[pyo3(signature = (
        path, url, stream, head, *, capacity=None, nodes_per_prefix=None, node_cache_blocks=None,
        sync_window_ms=None, cache_bytes=None, check_integrity=true, compact_on_close=true,
        engine_grace_ms=None, attention_chunk=None, max_age_s=None, max_bytes=None, buffer_events=None, publish_timeout_ms=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn open(
        _cls: &Bound<'_, PyType>,
        py: Python<'_>,
        path: PathBuf,
        url: PyBackedStr,
        stream: PyBackedStr,
        head: PyBackedStr,
        capacity: Option<Int>,
        nodes_per_prefix: Option<Int>,
        node_cache_blocks: Option<Int>,
        sync_window_ms: Option<f64>,
        cache_bytes: Option<Int>,
        check_integrity: bool,
        compact_on_close: bool,
        engine_grace_ms: Option<f64>,
        attention_chunk: Option<Int>,
        max_age_s: Option<f64>,
        max_bytes: Option<Int>,
        buffer_events: Option<Int>,
        publish_timeout_ms: Option<f64>,
    ) -> PyResult<SharedWarm> {
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
            import_json: None,
        };
        let shown = path.display().to_string();
        let (url, stream, head): (&str, &str, &str) = (&url, &stream, &head);
        let shared = detached(py, || {
            let mut sharing = sw::Sharing::nats(url, stream, head);
            if let Some(s) = max_age_s {
                sharing = sharing.max_age(seconds("max age", s)?);
            }
            if let Some(b) = max_bytes {
                sharing = sharing.max_bytes(count("max bytes", b)?);
            }
            if let Some(n) = buffer_events {
                sharing = sharing.buffer_events(usize::try_from(count("buffer events", n)?).unwrap_or(usize::MAX));
            }
            if let Some(ms) = publish_timeout_ms {
                sharing = sharing.publish_timeout(millis("publish timeout", ms)?);
            }
            Ok(sw::SharedWarm::open(&settings.builder()?, &path, sharing)?)
        })?;
        Ok(SharedWarm { handle: Handle::new(shared, "sharing head"), path: shown })
    }

    /// As ``Warm.ran``: answered here at once, published to the stream in the background, and
    /// applied (here and on every head) in stream order. Returns a ``Ticket``.
    #[pyo3(signature = (model, tokens, node, tenant=None))]
    fn ran(
        &self,
        py: Python<'_>,
        model: PyBackedStr,
        tokens: &Bound<'_, PyAny>,
        node: PyBackedStr,
        tenant: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Ticket> {
        let (tokens, tenant) = (self::tokens(tokens)?, self::tenant(tenant)?);
        let ask = Ask::new(&model, &tokens, &tenant);
        let node: &str = &node;
        let inner = self.handle.with(py, |head| Ok(head.ran_prefix(&ask.prefix(head)?, node)?))?;
        Ok(Ticket { inner })
    }

    /// ``ran`` for a prefix made by ``prefix``.
    fn ran_prefix(&self, py: Python<'_>, prefix: PyRef<'_, Prefix>, node: PyBackedStr) -> PyResult<Ticket> {
        let (p, node): (&sw::Prefix, &str) = (&prefix.inner, &node);
        let inner = self.handle.with(py, |head| Ok(head.ran_prefix(p, node)?))?;
        Ok(Ticket { inner })
    }

    /// As ``Warm.forget_node``; returns once the forget is in the stream, or raises
    /// ``SharingError`` (``Unpublished``) after the publish timeout (it stays buffered).
    fn forget_node(&self, py: Python<'_>, name: PyBackedStr) -> PyResult<()> {
        let name: &str = &name;
        self.handle.with(py, |head| Ok(head.forget_node(name)?))
    }

    /// As ``Warm.set_node_capacity``, for every head of the stream; returns once the change is
    /// in the stream, with the ``Ticket`` of its application here.
    #[pyo3(signature = (name, blocks))]
    fn set_node_capacity(&self, py: Python<'_>, name: PyBackedStr, blocks: Option<Int>) -> PyResult<Ticket> {
        let name: &str = &name;
        let inner = self.handle.with(py, |head| Ok(head.set_node_capacity(name, cache_blocks(blocks)?)?))?;
        Ok(Ticket { inner })
    }

    /// Waits (at most ``timeout_s`` seconds) until the head has connected and opened its
    /// stream; raises ``SharingError`` saying why not.
    fn wait_ready(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        self.handle.with(py, |head| Ok(head.wait_ready(seconds("timeout", timeout_s)?)?))
    }

    /// Waits (at most ``timeout_s`` seconds) until this head has applied ``ticket``'s event;
    /// whether it has.
    fn wait_for(&self, py: Python<'_>, ticket: PyRef<'_, Ticket>, timeout_s: f64) -> PyResult<bool> {
        let ticket = &ticket.inner;
        self.handle.with(py, |head| Ok(head.wait_for(ticket, seconds("timeout", timeout_s)?)))
    }

    /// Waits (at most ``timeout_s`` seconds) until this head has applied the stream up to
    /// sequence ``seq``; whether it has.
    fn wait_applied(&self, py: Python<'_>, seq: Int, timeout_s: f64) -> PyResult<bool> {
        // A number past any the stream can reach is never applied; a negative one already is.
        let seq = u64::try_from(seq.0.max(0)).unwrap_or(u64::MAX);
        self.handle.with(py, |head| Ok(head.wait_applied(seq, seconds("timeout", timeout_s)?)))
    }

    /// Makes this head's events durable: waits until every one made before the call is in the
    /// stream (at most the publish timeout), then commits what it applied.
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        self.handle.with(py, |head| Ok(head.sync()?))
    }

    /// ``(Stats, ShareStats)``: the head's index and how it stands with the stream.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let (index, share) = self.handle.with(py, |head| Ok(head.stats()?))?;
        Ok((records::stats(py, &index)?, share_stats(py, &share)?))
    }

    /// How the head stands with the stream (``ShareStats``).
    fn share_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let share = self.handle.with(py, |head| Ok(head.share_stats()))?;
        share_stats(py, &share)
    }

    /// Publish-to-applied lags of other heads' events applied here (the newest 65,536), in
    /// nanoseconds.
    fn lags_ns(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.handle.with(py, |head| Ok(head.lags_ns()))
    }

    /// Stops sharing (publishing what is buffered, for at most the publish timeout), then
    /// closes the file as ``Warm.close``.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.handle.close(py, |head| Ok(head.close()?))
    }
});

fn share_stats<'py>(py: Python<'py>, s: &sw::ShareStats) -> PyResult<Bound<'py, PyAny>> {
    record(
        py,
        "ShareStats",
        &kwargs!(
            py,
            head = s.head.as_str(),
            stream = s.stream.as_str(),
            connected = s.connected,
            applied = s.applied,
            durable = s.durable,
            unapplied = s.unapplied,
            oldest_unapplied_age_s = s.oldest_unapplied_age.map(|d| d.as_secs_f64()),
            buffered = s.buffered,
            published = s.published,
            dropped = s.dropped,
            applied_events = s.applied_events,
            skipped = s.skipped,
            rejected = s.rejected,
            pending_own = s.pending_own,
            error = s.error.as_deref(),
            halted = s.halted.as_deref(),
        ),
    )
}
