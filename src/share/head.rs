//! `SharedWarm`: a head's index shared with other heads through a NATS JetStream stream.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use super::event::{EVENT_VERSION, Event, Origin, What, WireBatch};
use super::link::{self, Shared, Status, unix_ns};
use super::outbox::{Out, Outbox};
use super::own_events::{OwnEvents, OwnView};
use super::sharing::Sharing;
use crate::decided::engines::{Applied, EngineBatch, EngineOutcome, EngineStats, Follows};
use crate::error::{Error, Result};
use crate::index::builder::Builder;
use crate::index::engine_events::EngineSink;
use crate::index::layer::Layer;
use crate::index::read_index::ReadIndex;
use crate::index::warm::{Hit, Stats, Warm, check_node_capacity};
use crate::keys::{Namespace, Prefix, check_node};
use crate::telemetry;

/// A head's event, as [`SharedWarm::ran`] returns it: another head that has applied it answers
/// it ([`SharedWarm::wait_for`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ticket {
    head: Arc<str>,
    boot: u64,
    local: u64,
}

/// How a sharing head stands with the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShareStats {
    /// This head's name.
    pub head: String,
    /// The stream.
    pub stream: String,
    /// Whether the client is connected to the server now.
    pub connected: bool,
    /// The stream sequence of the last event applied here.
    pub applied: u64,
    /// Of the file: the stream sequence of the last event committed durably.
    pub durable: u64,
    /// Events in the stream not yet applied here (as last seen).
    pub unapplied: u64,
    /// How long ago the oldest of those was stored (as last seen).
    pub oldest_unapplied_age: Option<Duration>,
    /// This head's events not yet in the stream (buffered while the server is unreachable).
    pub buffered: u64,
    /// This head's events the stream acknowledged.
    pub published: u64,
    /// This head's events dropped because the buffer was full.
    pub dropped: u64,
    /// Events applied here (this head's and others').
    pub applied_events: u64,
    /// Redelivered events at or below the position, skipped (never applied twice).
    pub skipped: u64,
    /// Events no head can apply (garbage, another version or hash scheme), skipped by all.
    pub rejected: u64,
    /// This head's own events answered here but not yet back from the stream.
    pub pending_own: u64,
    /// The last transient error (the link retries it).
    pub error: Option<String>,
    /// Why the head stopped applying the stream, if it did (it still routes and publishes).
    pub halted: Option<String>,
}

/// A head's index, shared with the other heads of the stream.
///
/// Every head publishes its `ran`s and forgets to one stream and applies every event of the
/// stream, its own included, in stream order, to its own file: heads that have applied the same
/// prefix of the stream answer every query alike. A head's own `ran` is answered at once,
/// before it comes back from the stream, and never waits on the network. See `ARCHITECTURE.md`,
/// "Sharing".
pub struct SharedWarm {
    shared: Arc<Shared>,
    link: Option<JoinHandle<()>>,
    next_local: AtomicU64,
    /// Per node, the last engine batch this head published (number, publish time), from the
    /// file's position when it first publishes one: where its listener's replays start.
    forwarded: Mutex<Forwarded>,
    /// The outbox dropped events since the last engine batch was forwarded (the server was away
    /// too long): an engine batch among them never reaches the stream, so where each engine
    /// stands is read again from the file, and the listener replays what it lacks.
    outbox_dropped: AtomicBool,
}

/// Per node, the last engine batch a head published (number, publish time), and the last ones
/// it published or its file applied (a copy of one is not published again).
type Forwarded = HashMap<String, (Option<(u64, f64)>, Applied)>;

impl std::fmt::Debug for SharedWarm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWarm")
            .field("head", &self.shared.sharing.head)
            .field("stream", &self.shared.sharing.stream)
            .finish_non_exhaustive()
    }
}

impl SharedWarm {
    /// Opens the head's file with `builder`'s settings and starts sharing. Returns without
    /// waiting for the server: until it answers, the head routes on its file and buffers its
    /// events. Every head of a stream must use the same capacity and nodes per prefix, and start
    /// from a new file, or a copy of another head's file of the stream.
    ///
    /// # Errors
    /// As [`Builder::open`]; [`Error::Sharing`] for a server URL that is not a NATS server's
    /// (`nats://host:port`, the scheme and host required) or names NATS would refuse;
    /// [`Error::InvalidConfig`] for a zero sync window (a sharing head has a commit thread).
    pub fn open(builder: &Builder, path: impl AsRef<Path>, sharing: Sharing) -> Result<SharedWarm> {
        sharing.validate()?;
        let warm: Warm = builder.open(path)?;
        if !warm.threaded() {
            return Err(Error::InvalidConfig { detail: "a sharing head needs a sync window above zero".into() });
        }
        let boot = unix_ns(SystemTime::now()) ^ (u64::from(std::process::id()) << 32);
        let shared = Arc::new(Shared {
            outbox: Mutex::new(Outbox::new(sharing.buffer_events)),
            sharing,
            boot,
            warm,
            pending: Mutex::new(OwnEvents::default()),
            wake: tokio::sync::Notify::new(),
            status: Mutex::new(Status::default()),
            progress: Condvar::new(),
            stop: AtomicBool::new(false),
            ready: AtomicBool::new(false),
        });
        let link = link::spawn(Arc::clone(&shared))?;
        Ok(SharedWarm {
            shared,
            link: Some(link),
            next_local: AtomicU64::new(1),
            forwarded: Mutex::default(),
            outbox_dropped: AtomicBool::new(false),
        })
    }

    /// As [`Warm::ran`]: answered here at once, published to the stream in the background, and
    /// applied (here and on every head) in stream order.
    ///
    /// # Errors
    /// As [`Warm::ran`]; [`Error::Codec`] if the event cannot be encoded.
    pub fn ran(&self, model: &str, tokens: &[u32], node: &str) -> Result<Ticket> {
        self.ran_prefix(&self.prefix(&Namespace::new(model)?, tokens), node)
    }

    /// As [`SharedWarm::ran`] for a prefix hashed by [`ReadIndex::prefix`].
    ///
    /// # Errors
    /// As [`SharedWarm::ran`].
    pub fn ran_prefix(&self, prefix: &Prefix, node: &str) -> Result<Ticket> {
        self.shared.warm.in_owner()?;
        check_node(node)?;
        let ns = prefix.namespace();
        let what = What::Ran {
            model: ns.model().to_string(),
            tenant: ns.has_tenant(),
            namespace: ns.id(),
            scheme: self.shared.warm.scheme().name().to_string(),
            node: node.to_string(),
            keys: prefix.keys().to_vec(),
        };
        if prefix.scheme != self.shared.warm.scheme() {
            // The file's own check and message.
            self.shared.warm.warmest_prefix(prefix)?;
        }
        let keys: Arc<[_]> = prefix.keys().into();
        self.send(what, |pending, local| pending.ran(local, keys, node))
    }

    /// As [`Warm::forget_node`]: answers leave the node out at once; returns once the forget is
    /// in the stream (durable there), or with [`Error::Unpublished`] after the publish timeout
    /// (it stays buffered and is published when the server answers).
    ///
    /// # Errors
    /// As [`SharedWarm::sync`].
    pub fn forget_node(&self, name: &str) -> Result<()> {
        check_node(name)?;
        self.send(What::Forget { node: name.to_string() }, |pending, local| pending.forget(local, name))?;
        self.sync()
    }

    /// As [`Warm::set_node_capacity`], for every head sharing the stream: each applies it in
    /// stream order (this one too: until then its answers keep the size before), so that all
    /// keep the same caches. Returns once the change is in the stream (durable there), with the
    /// ticket to [`SharedWarm::wait_for`] its application here. `None` gives the name back to
    /// each head's own default ([`Builder::node_cache_blocks`]): heads opened with the same one
    /// agree.
    ///
    /// # Errors
    /// As [`Warm::set_node_capacity`] for a name or size it refuses (nothing is published); as
    /// [`SharedWarm::sync`].
    pub fn set_node_capacity(&self, name: &str, blocks: Option<u64>) -> Result<Ticket> {
        check_node_capacity(name, blocks)?;
        let ticket = self.send(What::Capacity { node: name.to_string(), blocks }, |_, _| {})?;
        self.sync()?;
        Ok(ticket)
    }

    fn send(&self, what: What, answer: impl FnOnce(&mut OwnEvents, u64)) -> Result<Ticket> {
        self.shared.warm.in_owner()?;
        // Numbered under the pending lock, so that the outbox (and the stream) has them in
        // number order, as the pending events compare them.
        let mut pending = self.shared.pending();
        let local = self.next_local.fetch_add(1, Ordering::Relaxed);
        let origin = Origin {
            head: self.shared.sharing.head.clone(),
            boot: self.shared.boot,
            local,
            at_unix_ns: unix_ns(SystemTime::now()),
        };
        let event = Event { version: EVENT_VERSION, origin, what };
        let out = Out { local, id: event.message_id(), payload: event.encode()? };
        answer(&mut pending, local);
        if let Some(dropped) = self.shared.outbox().push(out) {
            pending.settle(dropped);
            self.outbox_dropped.store(true, Ordering::Release);
        }
        drop(pending);
        self.shared.wake.notify_one();
        Ok(Ticket { head: self.shared.sharing.head.as_str().into(), boot: self.shared.boot, local })
    }

    /// Waits until the head's link has connected to the server and opened (or created) the
    /// stream and its consumer, at most `timeout`; once it has, this returns at once (a later
    /// outage shows in [`ShareStats::connected`]). [`SharedWarm::open`] does not wait for the
    /// server; a caller that cannot do without it (a replay, a deployment check) asks this.
    ///
    /// # Errors
    /// [`Error::Sharing`] saying why not: why the head halted ([`ShareStats::halted`]), else
    /// the link's last error (nothing listening at the URL, JetStream not enabled on the
    /// server, ...), else that the server did not answer in time.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        self.shared.warm.in_owner()?;
        let started = Instant::now();
        self.wait_until(timeout, |status| status.consuming);
        let status = self.shared.status();
        let detail = match &status.halted {
            Some(halted) => halted.clone(),
            None if status.consuming => return Ok(()),
            None => {
                drop(status);
                match self.shared.trouble(started) {
                    Some(why) => format!("no stream after {:.1?}: {why}", started.elapsed()),
                    None => format!(
                        "no answer from the NATS server at {} after {:.1?}: check that nats-server -js runs there",
                        self.shared.sharing.url,
                        started.elapsed()
                    ),
                }
            }
        };
        Err(Error::Sharing { detail, source: None })
    }

    /// Waits until this head has applied `ticket`'s event (and all its head made before it),
    /// at most `timeout`, or until it halts ([`ShareStats::halted`]: it applies nothing more);
    /// whether it has.
    pub fn wait_for(&self, ticket: &Ticket, timeout: Duration) -> bool {
        let origin = (ticket.head.to_string(), ticket.boot);
        self.wait_until(timeout, |status| status.from.get(&origin).is_some_and(|&l| l >= ticket.local))
    }

    /// Waits until this head has applied the stream up to sequence `seq`, at most `timeout`,
    /// or until it halts ([`ShareStats::halted`]); whether it has.
    pub fn wait_applied(&self, seq: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |status| status.applied >= seq)
    }

    /// Waits until `done` holds, looked at with the link's status held each time the link makes
    /// progress (and every 20 ms), at most `timeout`, and no longer once the link has halted
    /// (what it has not applied then it never will); whether it held.
    fn wait_until(&self, timeout: Duration, done: impl FnMut(&Status) -> bool) -> bool {
        self.wait(timeout, |status| status.halted.is_some(), done)
    }

    /// [`SharedWarm::wait_until`] for what the link publishes: a halted link still publishes,
    /// unless its stream is gone.
    fn wait_while_publishing(&self, timeout: Duration, done: impl FnMut(&Status) -> bool) -> bool {
        self.wait(timeout, |status| status.stream_gone, done)
    }

    /// Waits until `done` holds, or `ended` (then never), at most `timeout`; whether `done` held.
    fn wait(&self, timeout: Duration, ended: impl Fn(&Status) -> bool, mut done: impl FnMut(&Status) -> bool) -> bool {
        if self.shared.warm.in_owner().is_err() {
            // A fork's child: the link is the parent's, nothing progresses here.
            return false;
        }
        let deadline = Instant::now() + timeout;
        let mut status = self.shared.status();
        loop {
            if done(&status) {
                return true;
            }
            if ended(&status) {
                return false;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            status = match self.shared.progress.wait_timeout(status, left.min(Duration::from_millis(20))) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// Makes this head's events durable: waits until every one made before the call is in the stream
    /// (at most the publish timeout), then commits what it applied (as [`Warm::sync`]).
    ///
    /// # Errors
    /// [`Error::Sharing`] if the stream this head applied was deleted ([`ShareStats::halted`]
    /// says so: it applies and publishes nothing more), at once or when that is found during the
    /// wait (a head halted for a retention gap still publishes, and syncs as any other);
    /// [`Error::Unpublished`] if events are still buffered
    /// after the publish timeout (they are kept and published when the server answers), with
    /// what the link found wrong meanwhile; as [`Warm::sync`].
    pub fn sync(&self) -> Result<()> {
        self.shared.warm.in_owner()?;
        let started = Instant::now();
        let timeout = self.shared.sharing.publish_timeout;
        // The events made before this call, not those made while it waits.
        let last = self.next_local.load(Ordering::Relaxed).saturating_sub(1);
        // A head halted for a retention gap still publishes; one whose stream is gone does not.
        let published = self.wait_while_publishing(timeout, |_| self.shared.outbox().count_through(last) == 0);
        let status = self.shared.status();
        if let (true, Some(halted)) = (status.stream_gone, &status.halted) {
            return Err(Error::Sharing { detail: halted.clone(), source: None });
        }
        drop(status);
        if !published {
            // (Published just after the wait gave up: then it is done.)
            let events = self.shared.outbox().count_through(last);
            if events > 0 {
                let reason = self.shared.trouble(started);
                return Err(Error::Unpublished { events, waited: started.elapsed(), reason });
            }
        }
        self.shared.warm.sync()
    }

    /// The head's index's counts ([`Warm::stats`]), and how it stands with the stream.
    ///
    /// # Errors
    /// As [`Warm::stats`].
    pub fn stats(&self) -> Result<(Stats, ShareStats)> {
        let index = self.shared.warm.stats()?;
        Ok((index, self.share_stats()))
    }

    /// How the head stands with the stream.
    pub fn share_stats(&self) -> ShareStats {
        let pending_own = self.shared.pending().len() as u64;
        let (buffered, published, dropped) = {
            let outbox = self.shared.outbox();
            (outbox.len() as u64, outbox.published, outbox.dropped)
        };
        let status = self.shared.status();
        ShareStats {
            head: self.shared.sharing.head.clone(),
            stream: self.shared.sharing.stream.clone(),
            connected: status.connected,
            applied: status.applied,
            durable: self.shared.warm.durable_position(),
            unapplied: status.unapplied,
            oldest_unapplied_age: status.oldest_unapplied.and_then(|t| t.elapsed().ok()),
            buffered,
            published,
            dropped,
            applied_events: status.applied_events,
            skipped: status.skipped,
            rejected: status.rejected,
            pending_own,
            error: status.error.clone(),
            halted: status.halted.clone(),
        }
    }

    /// Publish-to-applied lags of other heads' events applied here (the newest 65,536), in ns.
    pub fn lags_ns(&self) -> Vec<u64> {
        self.shared.status().lags_ns.iter().copied().collect()
    }

    /// Stops sharing (publishing what is buffered, for at most the publish timeout), then
    /// closes the file as [`Warm::close`].
    ///
    /// # Errors
    /// As [`Warm::close`].
    pub fn close(mut self) -> Result<()> {
        self.shared.warm.in_owner()?;
        self.stop();
        let shared = Arc::clone(&self.shared);
        drop(self);
        match Arc::try_unwrap(shared) {
            Ok(shared) => shared.warm.close(),
            Err(_) => Err(Error::Poisoned),
        }
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_one();
        if let Some(link) = self.link.take() {
            // A link that panicked has nothing left to do.
            let _ = link.join();
        }
    }
}

impl SharedWarm {
    /// The engine streams as this head's file has applied them ([`Warm::engine_stats`]).
    ///
    /// # Errors
    /// As [`Warm::engine_stats`].
    pub fn engine_stats(&self) -> Result<Vec<EngineStats>> {
        self.shared.warm.engine_stats()
    }

    /// Where node `node`'s engine stream stands in this head's file
    /// ([`Warm::engine_position`]).
    ///
    /// # Errors
    /// As [`Warm::engine_position`].
    pub fn engine_position(&self, node: &str) -> Result<Option<(u64, f64)>> {
        self.shared.warm.engine_position(node)
    }

    /// Publishes node `node`'s engine batch to the stream, where every head applies it in order
    /// (this one too); the stream stores a batch once, whichever heads publish it.
    fn forward(&self, node: &str, batch: &EngineBatch) -> Result<()> {
        self.send(What::Engine { node: node.to_string(), batch: WireBatch::of(batch) }, |_, _| {}).map(drop)
    }
}

/// A sharing head's listener publishes each engine batch to the stream instead of applying it:
/// every head applies it from there, in stream order. Gaps are told by what this head has
/// published (from its file's position), by the one rule every head applies
/// ([`Warm::engine_batch`]), so that its listener replays them from the engine before it
/// publishes what follows; a batch after a gap no replay covered starts the node's stream again
/// on every head.
impl EngineSink for SharedWarm {
    fn engine_batch(&self, node: &str, batch: &EngineBatch) -> Result<EngineOutcome> {
        self.shared.warm.in_owner()?;
        check_node(node)?;
        let mut forwarded = self.shared_lock_forwarded()?;
        if self.outbox_dropped.swap(false, Ordering::AcqRel) {
            forwarded.clear();
        }
        if !forwarded.contains_key(node) {
            let followed = self.shared.warm.engine_followed(node)?;
            forwarded.insert(node.to_string(), followed);
        }
        let follows = forwarded.get(node).map(|(last, applied)| Follows::after(*last, applied, batch));
        let outcome = match follows.unwrap_or_else(|| Follows::after(None, &Applied::default(), batch)) {
            Follows::Next | Follows::Restart => EngineOutcome::Applied,
            Follows::Copy => return Ok(EngineOutcome::Duplicate),
            Follows::Gap { from } => {
                // Seen here, before the stream: the listener replays it before this batch is
                // forwarded (the heads applying the stream see no gap unless it is lost).
                drop(forwarded);
                telemetry::engine_gap(node, batch.seq, from);
                return Ok(EngineOutcome::Gap { from });
            }
        };
        self.forward(node, batch)?;
        mark_forwarded(&mut forwarded, node, batch);
        Ok(outcome)
    }

    fn engine_resync(&self, node: &str, batch: &EngineBatch) -> Result<()> {
        self.shared.warm.in_owner()?;
        check_node(node)?;
        let mut forwarded = self.shared_lock_forwarded()?;
        self.forward(node, batch)?;
        mark_forwarded(&mut forwarded, node, batch);
        Ok(())
    }
}

/// Node `node`'s `batch` is forwarded: the last, and remembered (a copy of it is not forwarded).
fn mark_forwarded(forwarded: &mut Forwarded, node: &str, batch: &EngineBatch) {
    let (last, applied) = forwarded.entry(node.to_string()).or_default();
    *last = Some((batch.seq, batch.ts));
    applied.push(batch);
}

impl SharedWarm {
    fn shared_lock_forwarded(&self) -> Result<std::sync::MutexGuard<'_, Forwarded>> {
        self.forwarded.lock().map_err(|_| Error::Poisoned)
    }
}

impl ReadIndex for SharedWarm {
    /// As a [`Warm`]'s.
    fn prefix(&self, namespace: &Namespace, tokens: &[u32]) -> Prefix {
        self.shared.warm.prefix(namespace, tokens)
    }

    /// As a [`Warm`]'s, with this head's own events not yet back from the stream answered
    /// first, as the newest memtable.
    fn warmest_prefix(&self, prefix: &Prefix) -> Result<Option<Hit>> {
        self.shared.warm.in_owner()?;
        let own = self.own_view(prefix);
        self.shared.warm.warmest_with(prefix, own.as_ref().map(|o| o as &dyn Layer))
    }

    /// As a [`Warm`]'s, with this head's own events not yet back from the stream (listed first
    /// among equal lengths: they are the newest).
    fn warm_nodes_prefix(&self, prefix: &Prefix) -> Result<Vec<Hit>> {
        self.shared.warm.in_owner()?;
        let own = self.own_view(prefix);
        self.shared.warm.warm_nodes_with(prefix, own.as_ref().map(|o| o as &dyn Layer))
    }
}

impl SharedWarm {
    /// The head's own unapplied events as the read path's newest memtable for `prefix`, if it
    /// has any: copied under their lock, which is released before the file is read (a `ran`
    /// and the link's settling wait on it).
    fn own_view(&self, prefix: &Prefix) -> Option<OwnView> {
        let pending = self.shared.pending();
        #[cfg(test)]
        let _held = crate::index::view_read::probe::held();
        (!pending.is_empty()).then(|| pending.view_of(prefix.keys()))
    }
}

impl Drop for SharedWarm {
    fn drop(&mut self) {
        if self.shared.warm.in_owner().is_err() {
            // A fork's child: the link, its runtime and the file are the parent's (see `Warm`'s
            // drop); nothing is stopped or dropped here.
            std::mem::forget(Arc::clone(&self.shared));
            std::mem::forget(self.link.take());
            return;
        }
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::SharedWarm;
    use crate::index::view_read::probe;
    use crate::{ReadIndex, Sharing, Warm};

    use crate::share::test_nats as nats;

    /// A sharing head's answers read the file with no lock held: not the callers' lock, and
    /// not the lock of its own events not yet back from the stream (its `ran`s and the link's
    /// settling wait on that one). Conversations moving between nodes, four nodes a block,
    /// answered while their own events are in flight and after they are applied.
    #[test]
    fn a_sharing_head_reads_no_file_under_a_lock() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let server = nats::NatsServer::start(&dir.path().join("nats"));
        let mut builder = Warm::builder();
        builder.nodes_per_prefix(4).sync_window(Duration::from_millis(1));
        let head = SharedWarm::open(&builder, dir.path().join("h.redb"), Sharing::nats(&server.url(), "probe", "h"))?;
        head.wait_ready(Duration::from_secs(30))?;
        let prompt = |c: u32, turn: u32| -> Vec<u32> { (0..64 * (2 + turn)).map(|t| t * 7 + c * 100_003).collect() };
        let mut warm_answers = 0;
        for turn in 0..10u32 {
            for c in 0..6u32 {
                let tokens = prompt(c, turn);
                let nodes = head.warm_nodes("m", &tokens)?;
                let best = head.warmest("m", &tokens)?;
                warm_answers += usize::from(best.is_some()) + usize::from(!nodes.is_empty());
                head.ran("m", &tokens, &format!("n{}", (c + turn / 3) % 5))?;
            }
            if turn % 2 == 1 {
                head.sync()?;
            }
        }
        let (free, held) = probe::reads();
        assert!(warm_answers > 0, "the conversations were answered warm");
        assert!(free > 0, "the committed view was read");
        assert_eq!(held, 0, "reads of the file under a lock ({free} with none held)");
        head.close()?;
        Ok(())
    }
}
