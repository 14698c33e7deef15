//! The ingester: one thread per engine endpoint, applying its KV event batches to a `Warm` in
//! the engine's order. A gap is covered by a replay from the engine's replay endpoint; what no
//! replay covers clears the node (the index may know less than the engine, never more).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::subscriber::{Endpoint, MAX_FRAME_BYTES, Message, Subscriber, host_port};
use super::vllm::decode_engine_batch;
use crate::decided::engines::{EngineBatch, EngineOutcome};
use crate::error::{Error, Result};
use crate::file::owner::Owner;
use crate::index::engine_events::EngineSink;
use crate::keys::{Namespace, check_node};
use crate::telemetry;

/// How long a replay may take before the gap is taken as lost.
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a replay endpoint that did not answer is left alone first: the gaps meanwhile clear
/// the node at once rather than wait for it again. Doubled at each failure, up to
/// [`REPLAY_BACKOFF_MAX`]; an answer ends it.
const REPLAY_BACKOFF_FIRST: Duration = Duration::from_secs(10);

/// See [`REPLAY_BACKOFF_FIRST`].
const REPLAY_BACKOFF_MAX: Duration = Duration::from_secs(300);

/// How often a listening thread looks up from its socket (to see whether it should stop).
const POLL: Duration = Duration::from_millis(100);

/// One engine to listen to: the node it is, where it publishes, and the model it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineEndpoint {
    /// The node's name in the index (what the head routes to).
    pub node: String,
    /// The engine's event endpoint (`tcp://host:5557`).
    pub events: String,
    /// The engine's replay endpoint, if it has one (`tcp://host:5558`).
    pub replay: Option<String>,
    /// The model the engine serves: the namespace its blocks are keyed in. A store under a
    /// LoRA is keyed under the LoRA's name (what a request names as its model), a store with a
    /// cache salt under that salt as the tenant.
    pub model: String,
    /// Only batches whose topic starts with this (`None`: all).
    pub topic: Option<String>,
    /// Bind the event endpoint rather than connect to it (vLLM connects when its endpoint
    /// names a host).
    pub bind: bool,
}

impl EngineEndpoint {
    /// Parses `NAME=ENDPOINT[,replay=ENDPOINT][,model=M][,topic=T][,bind]`; `model` is
    /// `default_model` unless given.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] saying what is wrong with the spec.
    pub fn parse(spec: &str, default_model: Option<&str>) -> Result<EngineEndpoint> {
        let bad = |detail: String| Error::InvalidConfig { detail: format!("engine {spec:?}: {detail}") };
        let mut parts = spec.split(',');
        let head = parts.next().unwrap_or_default();
        let Some((node, events)) = head.split_once('=') else {
            return Err(bad("expected NAME=ENDPOINT, e.g. gpu-0=tcp://10.0.0.7:5557".into()));
        };
        if node.is_empty() || !events.contains("://") {
            return Err(bad("expected NAME=ENDPOINT, e.g. gpu-0=tcp://10.0.0.7:5557".into()));
        }
        // Every batch would fail on it otherwise.
        check_node(node).map_err(|e| bad(format!("{e}: give a shorter node name")))?;
        let mut endpoint = EngineEndpoint {
            node: node.to_string(),
            events: events.to_string(),
            replay: None,
            model: default_model.unwrap_or_default().to_string(),
            topic: None,
            bind: false,
        };
        for part in parts {
            match part.split_once('=') {
                Some(("replay", v)) if v.contains("://") => endpoint.replay = Some(v.to_string()),
                Some(("model", v)) if !v.is_empty() => endpoint.model = v.to_string(),
                Some(("topic", v)) => endpoint.topic = Some(v.to_string()),
                None if part == "bind" => endpoint.bind = true,
                _ => return Err(bad(format!("unknown option {part:?} (replay=ENDPOINT, model=M, topic=T, bind)"))),
            }
        }
        if endpoint.model.is_empty() {
            return Err(bad("no model: add model=M, or give a default model".into()));
        }
        Namespace::new(&endpoint.model).map_err(|e| bad(e.to_string()))?;
        let events = check_address(&endpoint.events, endpoint.bind).map_err(bad)?;
        if let Some(replay) = &endpoint.replay {
            let replay = check_address(replay, false).map_err(|e| bad(format!("replay: {e}")))?;
            if replay.is_some() && replay == events {
                return Err(bad("the replay endpoint is the event endpoint: give the engine's replay (ROUTER) \
                     endpoint, another port (vLLM's `replay_endpoint`), or leave replay= out"
                    .into()));
            }
        }
        Ok(endpoint)
    }

    /// Parses every spec ([`EngineEndpoint::parse`]) and refuses two of the same node name
    /// (each engine's stream would make the other's look restarted), naming both.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] saying what is wrong with a spec, or which two name one node.
    pub fn parse_all<S: AsRef<str>>(specs: &[S], default_model: Option<&str>) -> Result<Vec<EngineEndpoint>> {
        let engines =
            specs.iter().map(|spec| EngineEndpoint::parse(spec.as_ref(), default_model)).collect::<Result<Vec<_>>>()?;
        let specs: Vec<&str> = specs.iter().map(AsRef::as_ref).collect();
        distinct(&engines, |i| specs.get(i).map_or_else(String::new, |s| (*s).to_string()))?;
        Ok(engines)
    }
}

/// Refuses two engines of one node name, naming both (as `spec` gives the `i`th).
fn distinct(engines: &[EngineEndpoint], spec: impl Fn(usize) -> String) -> Result<()> {
    let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (i, engine) in engines.iter().enumerate() {
        if let Some(&first) = seen.get(engine.node.as_str()) {
            return Err(Error::InvalidConfig {
                detail: format!(
                    "engines {:?} and {:?} are both node {:?}: each stream would make the other look \
                     restarted; give each engine its own node name",
                    spec(first),
                    spec(i),
                    engine.node
                ),
            });
        }
        seen.insert(&engine.node, i);
    }
    Ok(())
}

/// What is wrong with a ZMQ address an engine spec names, if anything: a tcp address needs a
/// host that resolves (an IPv6 one in brackets; `*` or an interface's name when bound) and a
/// port of 1-65535. Other transports (`ipc://`, ...) are left to ZMQ. Gives the host (lower
/// case) and port of a tcp address.
fn check_address(address: &str, bind: bool) -> std::result::Result<Option<(String, u16)>, String> {
    let Some((host, port)) = host_port(address) else {
        return Ok(None);
    };
    let example = "e.g. tcp://10.0.0.7:5557, or tcp://[::1]:5557 for IPv6";
    let port = port.parse::<u64>().ok().and_then(|p| u16::try_from(p).ok()).filter(|&p| p > 0).ok_or_else(|| {
        let port = match port {
            "" => "none".to_string(),
            p if p.bytes().all(|b| b.is_ascii_digit()) => p.to_string(),
            p => format!("{p:?}"),
        };
        format!("{address:?}: port {port} is not a port: give one of 1-65535 ({example})")
    })?;
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        // A scope (`%eth0`) may follow a link-local address.
        let literal = v6.split_once('%').map_or(v6, |(a, _)| a);
        return match literal.parse::<std::net::Ipv6Addr>() {
            Ok(_) => Ok(Some((host.to_ascii_lowercase(), port))),
            Err(_) => Err(format!("{address:?}: {v6:?} is not an IPv6 address ({example})")),
        };
    }
    if host.contains(':') {
        return Err(format!("{address:?}: an IPv6 address goes in brackets ({example})"));
    }
    if host.is_empty() {
        return Err(format!("{address:?}: no host ({example})"));
    }
    let wildcard = bind && host == "*";
    let interface = bind && std::path::Path::new("/sys/class/net").join(host).exists();
    if !wildcard && !interface && std::net::ToSocketAddrs::to_socket_addrs(&(host, port)).is_err() {
        let what = if bind { "no address or interface of this host" } else { "a host that does not resolve" };
        return Err(format!("{address:?}: {host:?} is {what}: check the name, or give an IP address ({example})"));
    }
    Ok(Some((host.to_ascii_lowercase(), port)))
}

/// What one engine's listening thread has seen (`Listener::stats`).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct ListenStats {
    /// The node.
    pub node: String,
    /// Whether the engine is connected now (a ZMQ connection to its event socket is up).
    pub connected: bool,
    /// Batches received (live and replayed).
    pub received: u64,
    /// Batches that did not decode (each then clears the node at the next batch).
    pub undecodable: u64,
    /// Messages of the wrong shape (frames), skipped.
    pub malformed: u64,
    /// Replays asked for.
    pub replays: u64,
    /// Replays that did not cover their gap (started later than asked, timed out, or no replay
    /// endpoint): the node was cleared.
    pub replays_short: u64,
    /// Gaps not replayed because the replay endpoint did not answer the last time and is left
    /// alone for a while (see [`ListenStats::replay_backoff`]): the node was cleared at once,
    /// rather than the engine's batches waiting for the replay timeout again.
    pub replays_skipped: u64,
    /// Whether a replay is being waited for now: meanwhile what the node holds is not answered.
    pub replaying: bool,
    /// Seconds until the replay endpoint is asked again, after it did not answer in time
    /// (nothing listening there, or a mute engine); `None` while it answers.
    pub replay_backoff: Option<f64>,
    /// Connections to the engine that ZMQ dropped for good (a frame over the 256 MiB cap: it
    /// then never connects again by itself), each made again by the listener. What the engine
    /// sent from that frame on was lost: the node was cleared at the next batch.
    pub dropped: u64,
    /// Seconds since the last batch was received (`None`: none yet).
    pub silent_for: Option<f64>,
    /// Lag from publish (the engine's clock) to applied (this host's), in seconds: the median
    /// and 99th percentile of the last batches received live (up to 65,536), a gap's replay
    /// included.
    pub lag_p50: Option<f64>,
    /// See [`ListenStats::lag_p50`].
    pub lag_p99: Option<f64>,
    /// The newest error, if the thread had one (it retries; a file that needs reopening stops
    /// it).
    pub error: Option<String>,
}

impl From<&ListenStats> for crate::EngineStatus {
    fn from(s: &ListenStats) -> crate::EngineStatus {
        let ms = |l: Option<f64>| l.map(|l| l * 1000.0);
        crate::EngineStatus {
            node: s.node.clone(),
            connected: s.connected,
            received: s.received,
            undecodable: s.undecodable,
            malformed: s.malformed,
            replays: s.replays,
            replays_short: s.replays_short,
            replays_skipped: s.replays_skipped,
            replaying: s.replaying,
            replay_backoff_s: s.replay_backoff,
            dropped: s.dropped,
            lag_p50_ms: ms(s.lag_p50),
            lag_p99_ms: ms(s.lag_p99),
            silent_for_s: s.silent_for,
            error: s.error.clone(),
        }
    }
}

/// Lags kept for the percentiles.
const LAGS: usize = 1 << 16;

/// What one thread has seen: its counts, when it last received a batch, its last lags.
#[derive(Default)]
struct Seen {
    stats: ListenStats,
    last: Option<Instant>,
    /// The replay endpoint is not asked before this (it did not answer).
    replay_after: Option<Instant>,
    lags: std::collections::VecDeque<f64>,
}

/// One thread's [`Seen`], shared with the [`Listener`].
type Shared = Arc<Mutex<Seen>>;

/// The listening threads of a set of engines, applying to one `Warm`.
pub struct Listener {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    stats: Vec<Shared>,
    /// The process that started the threads: a fork's child has none of them to stop.
    owner: Owner,
}

impl Listener {
    /// Opens a subscriber per engine and starts its thread, applying to `sink`: a head's
    /// [`crate::Warm`], or a sharing head's stream (`SharedWarm`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for two engines of one node name (give each its own);
    /// [`Error::Engine`] for an endpoint ZMQ refuses (malformed, or it cannot be bound);
    /// [`Error::Thread`] if a thread cannot be started.
    pub fn start<S: EngineSink + 'static>(
        sink: Arc<S>,
        engines: &[EngineEndpoint],
        replay_timeout: Duration,
    ) -> Result<Listener> {
        Listener::start_with(sink, engines, replay_timeout, MAX_FRAME_BYTES.unsigned_abs())
    }

    /// [`Listener::start`], accepting frames of up to `max_frame` bytes ([`Listener::start`]
    /// takes 256 MiB). A frame over the cap is dropped with its connection: the engine is
    /// connected again, counted in [`ListenStats::dropped`], and followed again from its next
    /// batch.
    ///
    /// # Errors
    /// As [`Listener::start`].
    pub fn start_with<S: EngineSink + 'static>(
        sink: Arc<S>,
        engines: &[EngineEndpoint],
        replay_timeout: Duration,
        max_frame: u64,
    ) -> Result<Listener> {
        let max_frame = i64::try_from(max_frame).unwrap_or(i64::MAX);
        distinct(engines, |i| engines.get(i).map_or_else(String::new, |e| format!("{}={}", e.node, e.events)))?;
        let sink: Arc<dyn EngineSink> = sink;
        let stop = Arc::new(AtomicBool::new(false));
        let mut listener =
            Listener { stop: Arc::clone(&stop), threads: Vec::new(), stats: Vec::new(), owner: Owner::current() };
        for engine in engines {
            let endpoint = Endpoint {
                events: engine.events.clone(),
                replay: engine.replay.clone(),
                topic: engine.topic.clone(),
                bind: engine.bind,
            };
            let subscriber = Subscriber::open_with(endpoint, max_frame).map_err(|e| Error::Engine {
                detail: format!("engine {}: {e}", engine.node),
                source: Some(Arc::new(e)),
            })?;
            let stats = Arc::new(Mutex::new(Seen {
                stats: ListenStats { node: engine.node.clone(), ..ListenStats::default() },
                ..Seen::default()
            }));
            listener.stats.push(Arc::clone(&stats));
            let mut one = One {
                sink: Arc::clone(&sink),
                engine: engine.clone(),
                subscriber,
                stats,
                replay_timeout,
                resync: false,
                undecodable_warned: None,
                dropped: 0,
                replay_backoff: Duration::ZERO,
            };
            let stop = Arc::clone(&stop);
            telemetry::engine_listening(&engine.node);
            let handle = std::thread::Builder::new()
                .name(format!("superfluid-warm-listen-{}", engine.node))
                .spawn(move || one.run(&stop))
                .map_err(|source| Error::Thread { source: Arc::new(source) })?;
            listener.threads.push(handle);
        }
        Ok(listener)
    }

    /// What each engine's thread has seen so far.
    pub fn stats(&self) -> Vec<ListenStats> {
        self.stats
            .iter()
            .filter_map(|s| s.lock().ok())
            .map(|seen| {
                let mut stats = seen.stats.clone();
                stats.silent_for = seen.last.map(|t| t.elapsed().as_secs_f64());
                stats.replay_backoff = seen
                    .replay_after
                    .map(|t| t.saturating_duration_since(Instant::now()).as_secs_f64())
                    .filter(|&left| left > 0.0);
                let mut lags: Vec<f64> = seen.lags.iter().copied().collect();
                lags.sort_by(f64::total_cmp);
                let at = |q: f64| lags.get(((lags.len() as f64 - 1.0) * q).round() as usize).copied();
                (stats.lag_p50, stats.lag_p99) = (at(0.5), at(0.99));
                stats
            })
            .collect()
    }

    /// Batches each engine's thread has received so far (live and replayed), in the order the
    /// engines were given: cheaper than [`Listener::stats`], for a caller that paces itself.
    pub fn received(&self) -> Vec<u64> {
        self.stats.iter().map(|s| s.lock().map_or(0, |seen| seen.stats.received)).collect()
    }

    /// Stops every thread and waits for them (each within one poll of its socket). In a fork's
    /// child, which has none of them, it stops nothing and gives what the parent had seen.
    pub fn stop(mut self) -> Vec<ListenStats> {
        self.halt();
        self.stats()
    }

    fn halt(&mut self) {
        if !self.owner.is_current() {
            // A fork's child: the threads (and the flag they read) are the parent's.
            std::mem::forget(std::mem::take(&mut self.threads));
            return;
        }
        self.stop.store(true, Ordering::Release);
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.halt();
    }
}

/// One engine's thread.
struct One {
    sink: Arc<dyn EngineSink>,
    engine: EngineEndpoint,
    subscriber: Subscriber,
    stats: Shared,
    replay_timeout: Duration,
    /// A batch was lost (it did not decode): the next one starts the stream again.
    resync: bool,
    /// When an undecodable message was last warned of.
    undecodable_warned: Option<Instant>,
    /// Connections the subscriber had made again after ZMQ dropped them, as last seen.
    dropped: u64,
    /// How long the replay endpoint is left alone after its last failure (zero: it answers).
    replay_backoff: Duration,
}

impl One {
    fn run(&mut self, stop: &AtomicBool) {
        self.follow(stop);
        telemetry::engine_stopped(&self.engine.node);
    }

    fn follow(&mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::Acquire) {
            match self.step() {
                Ok(()) => {}
                Err(e) => {
                    let fatal = e.needs_reopen();
                    self.note(|s| s.error = Some(e.to_string()));
                    if fatal {
                        telemetry::engine_listener_stopped(&self.engine.node, &e);
                        return;
                    }
                    std::thread::sleep(POLL);
                }
            }
        }
    }

    fn note(&self, f: impl FnOnce(&mut ListenStats)) {
        if let Ok(mut seen) = self.stats.lock() {
            f(&mut seen.stats);
        }
    }

    /// Takes the next live batch, if one comes within a poll, and applies it.
    fn step(&mut self) -> Result<()> {
        let message = self
            .subscriber
            .next(POLL)
            .map_err(|e| Error::Engine { detail: e.to_string(), source: Some(Arc::new(e)) })?;
        let (malformed, connected) = (self.subscriber.malformed(), self.subscriber.connected());
        let dropped = self.subscriber.dropped();
        if dropped > self.dropped {
            // A frame over the cap (or one breaking the protocol): it and what came after it
            // until the connection was made again are lost, and no replay can give a frame the
            // replay socket would drop too. The next batch starts the stream again.
            self.dropped = dropped;
            self.resync = true;
            telemetry::engine_connection_dropped(&self.engine.node, &self.engine.events);
        }
        let mut was = connected;
        self.note(|s| {
            was = s.connected;
            (s.malformed, s.connected, s.dropped) = (malformed, connected, dropped);
        });
        // The gauge starts at 0 (`engine_listening`), as `connected` does: a change is reported.
        if was != connected {
            telemetry::engine_connection(&self.engine.node, &self.engine.events, connected, was);
        }
        let Some(message) = message else { return Ok(()) };
        if let Ok(mut seen) = self.stats.lock() {
            seen.stats.received += 1;
            seen.last = Some(Instant::now());
        }
        let batch = self.batch(&message);
        // The frame is not needed once decoded: a large batch's frame is not held while it is
        // applied.
        drop(message);
        let Some(batch) = batch else { return Ok(()) };
        if std::mem::take(&mut self.resync) {
            return self.sink.engine_resync(&self.engine.node, &batch);
        }
        if let EngineOutcome::Gap { from } = self.sink.engine_batch(&self.engine.node, &batch)? {
            self.cover(from, &batch)?;
        }
        // The live batch is applied (after its gap's replay, if it had one).
        if let Ok(mut seen) = self.stats.lock() {
            if seen.lags.len() == LAGS {
                seen.lags.pop_front();
            }
            seen.lags.push_back(now() - batch.ts);
        }
        telemetry::engine_lag(&self.engine.node, now() - batch.ts);
        Ok(())
    }

    /// Covers a gap before `live` by a replay from `from`; what it does not cover clears the
    /// node, and `live` starts its stream again. While the replay is waited for, what the node
    /// holds is not answered ([`EngineSink::engine_in_doubt`]), and the status says so.
    fn cover(&mut self, from: u64, live: &EngineBatch) -> Result<()> {
        let node = self.engine.node.clone();
        self.sink.engine_in_doubt(&node, true)?;
        self.note(|s| s.replaying = true);
        let covered = self.cover_in_doubt(from, live);
        self.note(|s| s.replaying = false);
        let trusted = self.sink.engine_in_doubt(&node, false);
        covered.and(trusted)
    }

    fn cover_in_doubt(&mut self, from: u64, live: &EngineBatch) -> Result<()> {
        let backing_off = self.stats.lock().is_ok_and(|s| s.replay_after.is_some_and(|t| Instant::now() < t));
        if self.engine.replay.is_some() && backing_off {
            // It did not answer lately: the node starts again here, without waiting for it.
            self.note(|s| s.replays_skipped += 1);
            telemetry::engine_replay_skipped(&self.engine.node, from);
            return self.sink.engine_resync(&self.engine.node, live);
        }
        self.note(|s| s.replays += 1);
        let replayed = match self.engine.replay {
            Some(_) => match self.subscriber.replay(from, self.replay_timeout) {
                Ok(replayed) => {
                    self.replay_backoff = Duration::ZERO;
                    self.set_replay_after(None);
                    Some(replayed)
                }
                Err(e) => {
                    self.replay_backoff = (self.replay_backoff * 2).clamp(REPLAY_BACKOFF_FIRST, REPLAY_BACKOFF_MAX);
                    self.set_replay_after(Instant::now().checked_add(self.replay_backoff));
                    telemetry::engine_replay_failed(&self.engine.node, &e.to_string(), self.replay_backoff);
                    None
                }
            },
            None => None,
        };
        let Some(replayed) = replayed.filter(|r| !r.messages.is_empty()) else {
            self.note(|s| s.replays_short += 1);
            telemetry::engine_replay(&self.engine.node, from, 0, false);
            return self.sink.engine_resync(&self.engine.node, live);
        };
        telemetry::engine_replay(&self.engine.node, from, replayed.messages.len(), replayed.starts_at_requested);
        let decoded: Vec<EngineBatch> = replayed.messages.iter().filter_map(|m| self.batch(m)).collect();
        let mut batches = decoded.iter();
        if !replayed.starts_at_requested {
            self.note(|s| s.replays_short += 1);
            if let Some(first) = batches.next() {
                self.sink.engine_resync(&self.engine.node, first)?;
            }
        }
        for batch in batches {
            if let EngineOutcome::Gap { .. } = self.sink.engine_batch(&self.engine.node, batch)? {
                // The replay itself has a hole (a batch that did not decode): start again here.
                self.sink.engine_resync(&self.engine.node, batch)?;
            }
        }
        // The live batch, if the replay did not reach it.
        if let EngineOutcome::Gap { .. } = self.sink.engine_batch(&self.engine.node, live)? {
            self.sink.engine_resync(&self.engine.node, live)?;
        }
        // A replayed batch that did not decode was a hole of the replay, handled above.
        self.resync = false;
        Ok(())
    }

    /// The replay endpoint is not asked before `after` (`None`: it is asked at the next gap).
    fn set_replay_after(&self, after: Option<Instant>) {
        if let Ok(mut seen) = self.stats.lock() {
            seen.replay_after = after;
        }
    }

    /// A message as the library's batch; `None` (counted, and the next batch resyncs) if it
    /// does not decode.
    fn batch(&mut self, message: &Message) -> Option<EngineBatch> {
        match decode_engine_batch(message.seq, &message.payload, &self.engine.model) {
            Ok(batch) => Some(batch),
            Err(e) => {
                // Warned of once a minute at most (an engine of another format sends nothing
                // else); every one is counted.
                let loud = self.undecodable_warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(60));
                if loud {
                    self.undecodable_warned = Some(Instant::now());
                }
                telemetry::engine_undecodable(&self.engine.node, &e, loud);
                self.note(|s| s.undecodable += 1);
                self.resync = true;
                None
            }
        }
    }
}

/// Seconds since the Unix epoch.
fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_or_say_what_is_wrong() {
        let e = EngineEndpoint::parse("gpu-0=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5558,topic=kv@,bind", Some("m"))
            .expect("a spec");
        assert_eq!(e.node, "gpu-0");
        assert_eq!(
            (e.replay.as_deref(), e.topic.as_deref(), e.bind, e.model.as_str()),
            (Some("tcp://10.0.0.7:5558"), Some("kv@"), true, "m")
        );
        assert_eq!(EngineEndpoint::parse("a=tcp://127.0.0.1:1,model=x", None).map(|e| e.model).ok(), Some("x".into()));
        for bad in ["gpu-0", "=tcp://h:1", "a=h:1", "a=tcp://h:1,color=red", "a=tcp://h:1"] {
            assert!(matches!(EngineEndpoint::parse(bad, None), Err(Error::InvalidConfig { .. })), "{bad}");
        }
    }

    /// Specs that can never work are refused when parsed, saying what is wrong: a node name
    /// no batch can be applied under, no port or one out of range, an unresolvable host, an
    /// IPv6 address outside brackets, a replay endpoint that is the event endpoint.
    #[test]
    fn specs_that_can_never_work_are_refused() {
        let long = format!("{}=tcp://127.0.0.1:5557", "n".repeat(300));
        let refused = [
            (long.as_str(), "shorter node name"),
            ("a=tcp://127.0.0.1:0", "port 0 is not a port"),
            ("a=tcp://127.0.0.1:99999", "port 99999 is not a port"),
            ("a=tcp://127.0.0.1", "port none is not a port"),
            ("a=tcp://127.0.0.1:*", "port \"*\" is not a port"),
            ("a=tcp://no-such-host.invalid:5557", "does not resolve"),
            ("a=tcp://::1:5557", "in brackets"),
            ("a=tcp://[::g]:5557", "not an IPv6 address"),
            ("a=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5557", "the replay endpoint is the event endpoint"),
            ("a=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:70000", "replay: \"tcp://127.0.0.1:70000\": port"),
            ("a=tcp://no-such-interface-0:5557,bind", "no address or interface"),
        ];
        for (spec, why) in refused {
            match EngineEndpoint::parse(spec, Some("m")) {
                Err(Error::InvalidConfig { detail }) => assert!(detail.contains(why), "{spec}: {detail}"),
                other => panic!("{spec}: {other:?}"),
            }
        }
        for good in [
            "a=tcp://[::1]:5557,replay=tcp://[::1]:5558",
            "a=tcp://localhost:5557",
            "a=tcp://127.0.0.1:65535",
            "a=tcp://*:5557,bind",
            "a=tcp://lo:5557,bind",
            "a=tcp://[fe80::1%lo]:5557",
            "a=ipc:///tmp/engine.sock",
        ] {
            assert!(EngineEndpoint::parse(good, Some("m")).is_ok(), "{good}");
        }
    }

    /// Two specs of one node name are refused, naming both (by the CLI's parse, and by
    /// `Listener::start` for a library's own endpoints).
    #[test]
    fn two_engines_of_one_node_are_refused_naming_both() {
        let specs = ["gpu-0=tcp://127.0.0.1:5557", "gpu-1=tcp://127.0.0.1:5559", "gpu-0=tcp://127.0.0.1:5561"];
        match EngineEndpoint::parse_all(&specs, Some("m")) {
            Err(Error::InvalidConfig { detail }) => {
                assert!(detail.contains(specs[0]) && detail.contains(specs[2]), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(EngineEndpoint::parse_all(&specs[..2], Some("m")).map(|e| e.len()).ok(), Some(2));
    }
}
