//! The ingester: one thread per engine endpoint, applying its KV event batches to a `Warm` in
//! the engine's order. A gap is covered by a replay from the engine's replay endpoint; what no
//! replay covers clears the node (the index may know less than the engine, never more).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::subscriber::{Endpoint, Message, Subscriber};
use super::vllm::decode_engine_batch;
use crate::error::{Error, Result};
use crate::index::engine_events::EngineSink;
use crate::keys::Namespace;
use crate::store::engines::{EngineBatch, EngineOutcome};
use crate::telemetry;

/// How long a replay may take before the gap is taken as lost.
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

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
        Ok(endpoint)
    }
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

/// Lags kept for the percentiles.
const LAGS: usize = 1 << 16;

/// What one thread has seen: its counts, when it last received a batch, its last lags.
#[derive(Default)]
struct Seen {
    stats: ListenStats,
    last: Option<Instant>,
    lags: std::collections::VecDeque<f64>,
}

/// One thread's [`Seen`], shared with the [`Listener`].
type Shared = Arc<Mutex<Seen>>;

/// The listening threads of a set of engines, applying to one `Warm`.
pub struct Listener {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    stats: Vec<Shared>,
}

impl Listener {
    /// Opens a subscriber per engine and starts its thread, applying to `sink`: a head's
    /// [`crate::Warm`], or a sharing head's stream (`SharedWarm`).
    ///
    /// # Errors
    /// [`Error::Engine`] for an endpoint ZMQ refuses (malformed, or it cannot be bound);
    /// [`Error::Thread`] if a thread cannot be started.
    pub fn start<S: EngineSink + 'static>(
        sink: Arc<S>,
        engines: &[EngineEndpoint],
        replay_timeout: Duration,
    ) -> Result<Listener> {
        let sink: Arc<dyn EngineSink> = sink;
        let stop = Arc::new(AtomicBool::new(false));
        let mut listener = Listener { stop: Arc::clone(&stop), threads: Vec::new(), stats: Vec::new() };
        for engine in engines {
            let endpoint = Endpoint {
                events: engine.events.clone(),
                replay: engine.replay.clone(),
                topic: engine.topic.clone(),
                bind: engine.bind,
            };
            let subscriber = Subscriber::open(endpoint).map_err(|e| Error::Engine {
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

    /// Stops every thread and waits for them (each within one poll of its socket).
    pub fn stop(mut self) -> Vec<ListenStats> {
        self.stop.store(true, Ordering::Release);
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
        self.stats()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
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
        let mut was = connected;
        self.note(|s| {
            was = s.connected;
            (s.malformed, s.connected) = (malformed, connected);
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
        let Some(batch) = self.batch(&message) else { return Ok(()) };
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
    /// node, and `live` starts its stream again.
    fn cover(&mut self, from: u64, live: &EngineBatch) -> Result<()> {
        self.note(|s| s.replays += 1);
        let replayed = match self.engine.replay {
            Some(_) => self.subscriber.replay(from, self.replay_timeout).ok(),
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
        assert_eq!(EngineEndpoint::parse("a=tcp://h:1,model=x", None).map(|e| e.model).ok(), Some("x".into()));
        for bad in ["gpu-0", "=tcp://h:1", "a=h:1", "a=tcp://h:1,color=red", "a=tcp://h:1"] {
            assert!(matches!(EngineEndpoint::parse(bad, None), Err(Error::InvalidConfig { .. })), "{bad}");
        }
    }
}
