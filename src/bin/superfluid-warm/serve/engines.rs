//! The engines behind the head: where each serves HTTP, its load as the head counts it, whether
//! it is in the choice (ejected after failing in a row, back once its `/health` answers), and
//! whether its event stream is up; and the background task that keeps the last two and the
//! status file current.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use superfluid_warm::{EngineEndpoint, EngineStatus, IndexFile, ListenStatus, Listener, Load, Prefix};

use super::Head;
use super::flights::Flights;
use super::proxy::get;
use super::upstream::Connections;
use crate::CliError;

/// One engine.
pub(crate) struct Engine {
    /// Its node in the index.
    pub(crate) name: String,
    /// `HOST:PORT` of its HTTP server.
    pub(crate) authority: String,
    /// Whether the head follows its KV events.
    pub(crate) has_events: bool,
    /// Its event stream is connected and not waiting on a replay (or it has none): its warmth
    /// in the index is current.
    pub(crate) events_up: AtomicBool,
    /// Its requests in flight (one lock: the load is read whole).
    flights: Mutex<Flights>,
    failures_in_row: AtomicU32,
    /// Out of the choice until its health check answers.
    pub(crate) ejected: AtomicBool,
    /// It was ejected, and its event stream has said nothing since: it may have restarted with
    /// an empty cache, which the index learns only from its next batch. Priced on load alone
    /// until then.
    pub(crate) in_doubt: AtomicBool,
    /// Its listener's batch count when it was ejected.
    received_at_ejection: AtomicU64,
    /// Its HTTP connections, kept open between requests.
    pub(crate) connections: Connections,
}

/// Parses `NAME=http://HOST:PORT[,events=tcp://…][,replay=tcp://…][,topic=T]` into the engine
/// and, if it has events, the endpoint the listener follows.
///
/// # Errors
/// A refusal saying what is wrong with the spec.
pub(crate) fn parse(spec: &str, model: &str) -> Result<(Engine, Option<EngineEndpoint>), CliError> {
    let bad = |why: &str| {
        CliError::Refused(format!(
            "--engine {spec:?}: {why} (expected NAME=http://HOST:PORT[,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT])"
        ))
    };
    let mut parts = spec.split(',');
    let (name, url) = parts.next().and_then(|p| p.split_once('=')).ok_or_else(|| bad("no NAME=URL"))?;
    let authority = url.strip_prefix("http://").ok_or_else(|| bad("the URL must start with http://"))?;
    let authority = authority.trim_end_matches('/');
    if name.is_empty() || authority.is_empty() || authority.contains('/') {
        return Err(bad("a name and http://HOST:PORT, without a path"));
    }
    let (mut events, mut rest) = (None, Vec::new());
    for part in parts {
        match part.split_once('=') {
            Some(("events", e)) => events = Some(e),
            Some(("replay" | "topic", _)) => rest.push(part),
            _ => return Err(bad(&format!("unknown option {part:?}"))),
        }
    }
    if events.is_none() && !rest.is_empty() {
        return Err(bad("replay= and topic= need events="));
    }
    let endpoint = events
        .map(|events| {
            let listen_spec = std::iter::once(format!("{name}={events}")).chain(rest.iter().map(|r| r.to_string()));
            EngineEndpoint::parse(&listen_spec.collect::<Vec<_>>().join(","), Some(model))
        })
        .transpose()?;
    let engine = Engine {
        name: name.to_string(),
        authority: authority.to_string(),
        has_events: endpoint.is_some(),
        events_up: AtomicBool::new(endpoint.is_none()),
        flights: Mutex::default(),
        failures_in_row: AtomicU32::new(0),
        ejected: AtomicBool::new(false),
        in_doubt: AtomicBool::new(false),
        received_at_ejection: AtomicU64::new(0),
        connections: Connections::default(),
    };
    Ok((engine, endpoint))
}

impl Engine {
    /// Its load now.
    pub(crate) fn load(&self) -> Load {
        self.flights.lock().map_or_else(|_| Load::default(), |f| f.load(Instant::now()))
    }

    /// Its requests in flight, to change.
    fn flights(&self, change: impl FnOnce(&mut Flights)) {
        if let Ok(mut p) = self.flights.lock() {
            change(&mut p);
        }
    }
}

/// `received_at_ejection` before the background task has read the listener's count.
const UNMARKED: u64 = u64::MAX;

/// A request on an engine, from the moment it is sent until it ends (however it ends): its
/// share of the engine's load, and what is recorded of it when it ends.
pub(crate) struct Flight {
    pub(crate) head: Arc<Head>,
    pub(crate) engine: usize,
    /// Its number among the head's requests.
    serial: u64,
    pub(crate) predicted: u64,
    pub(crate) prompt: u64,
    /// The engine's `cached_tokens`, once its answer told them.
    pub(crate) cached: Option<u64>,
    /// The prompt's prefix, claimed for the engine once the request is on its way (`forward`).
    pub(crate) claim: Option<Prefix>,
    decoding: bool,
    ended: bool,
}

impl Flight {
    /// Counts a request of `prompt` tokens, `predicted` of them warm, on `engine`.
    pub(crate) fn start(head: &Arc<Head>, engine: usize, prompt: u64, predicted: u64) -> Flight {
        let uncached = prompt.saturating_sub(predicted);
        let serial = head.flights.fetch_add(1, Relaxed);
        if let Some(e) = head.engines.get(engine) {
            e.flights(|f| f.sent(serial, uncached, Instant::now()));
        }
        Flight {
            head: Arc::clone(head),
            engine,
            serial,
            predicted,
            prompt,
            cached: None,
            claim: None,
            decoding: false,
            ended: false,
        }
    }

    fn engine(&self) -> Option<&Engine> {
        self.head.engines.get(self.engine)
    }

    /// Sets the request's prompt, counted on its engine, to its true length once known (it was
    /// routed on an estimate): its prefill still ahead is that, less the predicted warm tokens.
    pub(crate) fn resizer(&self) -> impl FnOnce(&Head, u64) + Send + 'static {
        let (engine, serial, predicted) = (self.engine, self.serial, self.predicted);
        move |head, prompt| {
            if let Some(e) = head.engines.get(engine) {
                e.flights(|f| f.resize(serial, prompt.saturating_sub(predicted)));
            }
        }
    }

    /// Its first token came back: its prefill is done, it decodes.
    pub(crate) fn first_token(&mut self) {
        if self.decoding || self.ended {
            return;
        }
        self.decoding = true;
        if let Some(e) = self.engine() {
            e.flights(|f| f.done(self.serial, Instant::now(), true));
        }
    }

    /// The engine answered (a status under 500): it is not failing.
    pub(crate) fn answered(&self) {
        if let Some(e) = self.engine() {
            e.failures_in_row.store(0, Relaxed);
        }
    }

    /// It ended without a byte to the client: the engine failed it (`why`). Ejects the engine
    /// after --eject-after failures in a row.
    pub(crate) fn failed(mut self, why: &str) {
        self.head.tally.failed(self.engine, why);
        if let Some(e) = self.engine()
            && e.failures_in_row.fetch_add(1, Relaxed) + 1 >= self.head.eject_after
            && !e.ejected.swap(true, Relaxed)
        {
            if e.has_events {
                e.received_at_ejection.store(UNMARKED, Relaxed);
                e.in_doubt.store(true, Relaxed);
            }
            self.head.tally.ejected(self.engine, false);
        }
        self.end(false);
    }

    /// It ended: its load is taken off, and its prediction recorded against what the engine
    /// delivered (if its answer told).
    fn end(&mut self, record: bool) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        if let Some(e) = self.engine() {
            if self.decoding {
                e.flights(Flights::ended_decoding);
            } else {
                e.flights(|f| f.done(self.serial, Instant::now(), false));
            }
        }
        if let (true, Some(cached)) = (record, self.cached) {
            self.head.tally.delivered(self.engine, self.predicted, cached, self.prompt);
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.end(true);
    }
}

/// How often the background task looks at the engines' event streams and health checks.
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// Health checks of ejected engines, this often.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// The background task: refreshes each engine's `events_up` from the listener, probes ejected
/// engines' `/health` and takes them back when it answers 200, and writes the status file
/// every `status_every`.
pub(crate) fn watch(
    head: Arc<Head>,
    listener: Arc<Mutex<Option<Listener>>>,
    path: PathBuf,
    status_every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks: u64 = 0;
        let probe_every = (PROBE_EVERY.as_millis() / WATCH_EVERY.as_millis()).max(1) as u64;
        let status_ticks = (status_every.as_millis() / WATCH_EVERY.as_millis()).max(1) as u64;
        loop {
            let stats = listener.lock().ok().and_then(|l| l.as_ref().map(Listener::stats)).unwrap_or_default();
            for e in head.engines.iter().filter(|e| e.has_events) {
                let listened = stats.iter().find(|s| s.node == e.name);
                let up = listened.is_some_and(|s| s.connected && !s.replaying);
                e.events_up.store(up, Relaxed);
                // Ejected: in doubt until its stream speaks again (a restarted engine's first
                // batch tells the index it restarted).
                let received = listened.map_or(0, |s| s.received);
                if e.in_doubt.load(Relaxed) {
                    let mark = e.received_at_ejection.load(Relaxed);
                    if mark == UNMARKED {
                        e.received_at_ejection.store(received, Relaxed);
                    } else if !e.ejected.load(Relaxed) && received > mark {
                        e.in_doubt.store(false, Relaxed);
                    }
                }
            }
            if ticks.is_multiple_of(probe_every) {
                for (i, e) in head.engines.iter().enumerate().filter(|(_, e)| e.ejected.load(Relaxed)) {
                    if let Ok((200, _)) = get(e, "/health", Duration::from_secs(1)).await {
                        e.failures_in_row.store(0, Relaxed);
                        e.ejected.store(false, Relaxed);
                        head.tally.ejected(i, true);
                    }
                }
            }
            if ticks.is_multiple_of(probe_every) {
                head.tickets.sweep();
            }
            if ticks.is_multiple_of(status_ticks) {
                let mut status = ListenStatus::now(true, status_every);
                status.engines = stats.iter().map(EngineStatus::from).collect();
                status.routes = head.tally.stats();
                if let Err(e) = status.write(&IndexFile::new(&path)) {
                    tracing::warn!(error = %e, "cannot write the status file");
                }
            }
            ticks += 1;
            tokio::time::sleep(WATCH_EVERY).await;
        }
    })
}
