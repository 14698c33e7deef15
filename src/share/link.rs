//! The head's link to the stream: a thread with a tokio runtime of its own that publishes the
//! head's events (oldest first, retried under the same `Nats-Msg-Id`) and applies the stream, in
//! order, to the head's `Warm`, each event's sequence committed with its effects; it acks only
//! what is durable.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind, RequestError, RequestErrorKind};
use async_nats::jetstream::stream::{Config as StreamConfig, RetentionPolicy, StorageType, Stream};
use async_nats::jetstream::{self, Context, ErrorCode};
use async_nats::{ConnectOptions, HeaderMap};
use futures_util::StreamExt;

use super::event::{Event, What};
use super::outbox::Outbox;
use super::own_events::OwnEvents;
use super::sharing::Sharing;
use crate::error::{Error, Result};
use crate::index::warm::{Waits, Warm};
use crate::keys::{Namespace, Prefix};
use crate::telemetry;

/// Events published at once before their acknowledgements are awaited.
const PUBLISH_WINDOW: usize = 256;
/// Events fetched from the consumer at once.
const FETCH: usize = 512;
/// How often the consumer acks what is durable and looks at the stream's age, busy or idle.
const TICK: Duration = Duration::from_millis(50);
/// Lag samples kept (the newest).
const LAG_SAMPLES: usize = 1 << 16;

/// What the head and its link share.
pub(crate) struct Shared {
    pub sharing: Sharing,
    /// This run of the head's process (events of an earlier run are another head's to it).
    pub boot: u64,
    pub warm: Warm,
    pub pending: Mutex<OwnEvents>,
    pub outbox: Mutex<Outbox>,
    /// Wakes the publisher.
    pub wake: tokio::sync::Notify,
    pub status: Mutex<Status>,
    /// Signalled (with `status`) when events are applied or published.
    pub progress: Condvar,
    pub stop: AtomicBool,
    /// The stream exists (a publish before would be refused).
    pub ready: AtomicBool,
}

/// What the link knows, for `stats` and for waiters.
#[derive(Default)]
pub(crate) struct Status {
    pub connected: bool,
    /// The stream sequence of the last event applied (queued into the `Warm`).
    pub applied: u64,
    /// The stream's last sequence, as last seen.
    pub stream_last: u64,
    /// Events in the stream after `applied`, as last seen.
    pub unapplied: u64,
    /// When the oldest of those was stored by the server.
    pub oldest_unapplied: Option<SystemTime>,
    pub applied_events: u64,
    /// Redelivered events at or below the position (never applied twice).
    pub skipped: u64,
    /// Events no head can apply (garbage, another version, a foreign hash scheme): every head
    /// skips them alike.
    pub rejected: u64,
    /// The last transient error (the link retries), and when it was noted.
    pub error: Option<String>,
    pub error_at: Option<Instant>,
    /// The link reads the stream through its consumer (it has connected and opened the stream).
    pub consuming: bool,
    /// Why the link stopped applying (it goes on publishing, unless `stream_gone`).
    pub halted: Option<String>,
    /// The stream this head applied was deleted: it publishes no more (a new stream of that
    /// name does not continue its file, and its events would mislead the heads of that one).
    pub stream_gone: bool,
    /// Per head run (name, boot): the local number of its last event applied here.
    pub from: HashMap<(String, u64), u64>,
    /// Publish-to-applied lags of other heads' events, in ns (the newest [`LAG_SAMPLES`]).
    pub lags_ns: VecDeque<u64>,
}

impl Shared {
    pub(crate) fn status(&self) -> MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn pending(&self) -> MutexGuard<'_, OwnEvents> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn outbox(&self) -> MutexGuard<'_, Outbox> {
        self.outbox.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn signal(&self) {
        drop(self.status());
        self.progress.notify_all();
    }

    fn note_error(&self, what: &str, e: impl std::fmt::Display) {
        telemetry::share_retry(&self.sharing.head, what, &e);
        let mut status = self.status();
        status.error = Some(format!("{what}: {e}"));
        status.error_at = Some(Instant::now());
    }

    /// Stops applying, for `why` (the head goes on routing and publishing), and wakes waiters.
    fn halt(&self, why: String) {
        telemetry::share_halted(&self.sharing.head, &why);
        self.status().halted = Some(why);
        self.progress.notify_all();
    }

    /// Halts for good: the stream this head applied was deleted (`why`); publishing stops too.
    fn lose_stream(&self, why: String) {
        self.status().stream_gone = true;
        self.halt(why);
    }

    /// Why this head's events may not be reaching the stream: why it halted, else the link's
    /// error noted since `since` (a condition that lasts is noted again at each retry), else
    /// that the client is not connected; `None` if nothing is known to be wrong.
    pub(crate) fn trouble(&self, since: Instant) -> Option<String> {
        let status = self.status();
        if let Some(halted) = &status.halted {
            return Some(halted.clone());
        }
        if let (Some(error), Some(at)) = (&status.error, status.error_at)
            && at >= since
        {
            return Some(error.clone());
        }
        (!status.connected).then(|| format!("not connected to the NATS server at {}", self.sharing.url))
    }
}

pub(crate) fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Starts the link thread.
///
/// # Errors
/// [`Error::Thread`] if it cannot be started.
pub(crate) fn spawn(shared: Arc<Shared>) -> Result<std::thread::JoinHandle<()>> {
    telemetry::share_started(&shared.sharing.head);
    std::thread::Builder::new()
        .name("superfluid-warm-share".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(r) => r,
                Err(e) => {
                    shared.halt(format!("cannot start the NATS runtime: {e}"));
                    return;
                }
            };
            runtime.block_on(run(&shared));
            // With the runtime gone no event of the client can come: the head is not connected.
            drop(runtime);
            telemetry::share_connection(&shared.sharing.head, &shared.sharing.url, false, false);
        })
        .map_err(|source| Error::Thread { source: Arc::new(source) })
}

/// The link: its figures sampled from the start (the buffer fills while the server is away),
/// and the connection with what it serves.
async fn run(shared: &Arc<Shared>) {
    tokio::join!(sample(shared), serve(shared));
}

/// Records the link's buffer 20 times a second until the head stops.
async fn sample(shared: &Shared) {
    let (head, mut dropped) = (&shared.sharing.head, 0);
    while !shared.stop.load(Ordering::Acquire) {
        let (buffered, now_dropped) = {
            let outbox = shared.outbox();
            (outbox.len(), outbox.dropped)
        };
        telemetry::share_outbox(head, buffered, now_dropped.saturating_sub(dropped));
        dropped = now_dropped;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn serve(shared: &Arc<Shared>) {
    let url = &shared.sharing.url;
    // The first connection is retried here rather than by the client, so that each failure's
    // reason (connection refused, a timeout, an authorization) is noted for `stats` and waiters;
    // once connected, the client reconnects by itself. A stop ends the attempts.
    let mut attempts: u64 = 0;
    let client = loop {
        // The client says when its connection goes and comes back (however briefly): each is
        // logged and counted once.
        let (head, events_url) = (shared.sharing.head.clone(), url.clone());
        let options = ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .reconnect_delay_callback(|attempts| Duration::from_millis((50 * attempts as u64).min(1000)))
            .name(format!("superfluid-warm {}", shared.sharing.head))
            .event_callback(move |event| {
                match event {
                    async_nats::Event::Connected => telemetry::share_connection(&head, &events_url, true, false),
                    async_nats::Event::Disconnected => telemetry::share_connection(&head, &events_url, false, true),
                    _ => {}
                }
                std::future::ready(())
            });
        tokio::select! {
            connected = options.connect(url.as_str()) => match connected {
                Ok(client) => break client,
                Err(e) => {
                    if attempts == 0 {
                        telemetry::share_unreachable(&shared.sharing.head, url, &e);
                    }
                    let at = telemetry::redacted(url);
                    shared.note_error(&format!("connecting to {at} (is nats-server -js running there?)"), e);
                    shared.signal();
                    attempts += 1;
                }
            },
            _ = stopped(shared) => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis((50 * attempts).min(1000))) => {}
            _ = stopped(shared) => return,
        }
    };
    let js = jetstream::new(client.clone());
    let connected = {
        let shared = Arc::clone(shared);
        let client = client.clone();
        async move {
            while !shared.stop.load(Ordering::Acquire) {
                shared.status().connected = client.connection_state() == async_nats::connection::State::Connected;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    // Each loop ends at a stop, but an await on an unreachable server may not: a stop cuts
    // them short (the publisher after its drain time). Nothing depends on their last acks.
    let drain = shared.sharing.publish_timeout + Duration::from_millis(100);
    let publishing = async {
        tokio::select! {
            _ = publish_loop(shared, &js) => {}
            _ = async { stopped(shared).await; tokio::time::sleep(drain).await } => {}
        }
    };
    let consuming = async {
        tokio::select! {
            _ = consume_loop(shared, &js) => {}
            _ = stopped(shared) => {}
        }
    };
    tokio::join!(publishing, consuming, connected);
    let _ = tokio::time::timeout(Duration::from_millis(200), client.flush()).await;
}

/// Returns once the head is stopping.
async fn stopped(shared: &Shared) {
    while !shared.stop.load(Ordering::Acquire) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes the outbox oldest first, a window at a time; what is not acknowledged is sent again
/// under the same message id (the stream stores it once). On stop, it drains what it can within
/// the publish timeout.
async fn publish_loop(shared: &Shared, js: &Context) {
    let subject = shared.sharing.subject();
    let mut stopping: Option<Instant> = None;
    loop {
        if shared.stop.load(Ordering::Acquire) {
            let since = *stopping.get_or_insert_with(Instant::now);
            if shared.outbox().len() == 0 || since.elapsed() > shared.sharing.publish_timeout {
                return;
            }
        }
        if shared.status().stream_gone {
            if stopping.is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let window = match shared.ready.load(Ordering::Acquire) {
            true => shared.outbox().peek(PUBLISH_WINDOW),
            false => Vec::new(),
        };
        if window.is_empty() {
            tokio::select! {
                _ = shared.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
            continue;
        }
        let mut acks = Vec::with_capacity(window.len());
        for out in &window {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", out.id.as_str());
            match js.publish_with_headers(subject.clone(), headers, out.payload.clone().into()).await {
                Ok(ack) => acks.push((out.local, ack)),
                Err(e) => {
                    shared.note_error("publishing", e);
                    break;
                }
            }
        }
        let mut all = acks.len() == window.len();
        for (local, ack) in acks {
            match tokio::time::timeout(shared.sharing.publish_timeout, ack).await {
                Ok(Ok(_)) => {
                    shared.outbox().acked(local);
                    // A head that cannot apply the stream never sees its own events again.
                    if shared.status().halted.is_some() {
                        shared.pending().settle(local);
                    }
                }
                Ok(Err(e)) => {
                    shared.note_error("publishing", e);
                    all = false;
                    break;
                }
                Err(_) => {
                    shared.note_error("publishing", "no acknowledgement in time");
                    all = false;
                    break;
                }
            }
        }
        shared.signal();
        if !all {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The stream's settings for a stream this head creates.
fn stream_config(sharing: &Sharing) -> StreamConfig {
    StreamConfig {
        name: sharing.stream.clone(),
        subjects: vec![sharing.subject()],
        storage: StorageType::File,
        retention: RetentionPolicy::Limits,
        max_age: sharing.max_age,
        max_bytes: sharing.max_bytes,
        duplicate_window: sharing.max_age.min(Duration::from_secs(120)),
        ..Default::default()
    }
}

/// Applies the stream from the position on, recreating the head's durable consumer from the
/// position after any failure (the file's position, not the server's, says what was applied).
async fn consume_loop(shared: &Shared, js: &Context) {
    let mut applied = shared.warm.durable_position();
    shared.status().applied = applied;
    // Delivered events waiting for a durable commit before they are acked.
    let mut to_ack: VecDeque<(u64, jetstream::Message)> = VecDeque::new();
    // When the stream this head applies was created (ns since the epoch), once it has opened it.
    let mut created: Option<i128> = None;
    'connect: while !shared.stop.load(Ordering::Acquire) {
        if shared.status().halted.is_some() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let mut stream = match open_stream(shared, js, created, applied).await {
            Ok(s) => s,
            Err(Opening::Retry(e)) => {
                shared.note_error("opening the stream", e);
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Err(Opening::Gone(why)) => {
                shared.lose_stream(why);
                continue;
            }
        };
        // The stream's identity: one deleted and created again (by this server after it lost its
        // store, or by another head) no longer holds what this head applied.
        let Some(this) = creation_time(stream.cached_info()) else {
            shared.note_error("opening the stream", "the server is still creating it");
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if created.is_some_and(|c| c != this) {
            shared.lose_stream(deleted(&shared.sharing, applied, "and created again"));
            continue;
        }
        created = Some(this);
        shared.ready.store(true, Ordering::Release);
        match stream.info().await {
            Ok(info) => {
                let (first, last) = (info.state.first_sequence, info.state.last_sequence);
                shared.status().stream_last = last;
                if applied > last {
                    shared.halt(format!(
                        "this file has applied the stream up to {applied}, but stream {} ends at {last}: it belongs to \
                         another stream (or one that was deleted); start this head from a new file or a copy of another head's",
                        shared.sharing.stream
                    ));
                    continue;
                }
                if last > applied && first > applied + 1 {
                    shared.halt(gap(&shared.sharing, applied, first));
                    continue;
                }
            }
            Err(e) => {
                shared.note_error("reading the stream", e);
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        }
        let name = shared.sharing.consumer();
        let _ = stream.delete_consumer(&name).await;
        let config = pull::Config {
            durable_name: Some(name),
            deliver_policy: if applied == 0 {
                DeliverPolicy::All
            } else {
                DeliverPolicy::ByStartSequence { start_sequence: applied + 1 }
            },
            ack_policy: AckPolicy::All,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: -1,
            ..Default::default()
        };
        let consumer = match stream.create_consumer(config).await {
            Ok(c) => c,
            Err(e) => {
                shared.note_error("creating the consumer", e);
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        to_ack.clear();
        let mut messages = match consumer
            .stream()
            .max_messages_per_batch(FETCH)
            .expires(Duration::from_secs(5))
            .heartbeat(Duration::from_secs(1))
            .messages()
            .await
        {
            Ok(m) => m,
            Err(e) => {
                shared.note_error("fetching", e);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        shared.status().consuming = true;
        shared.signal();
        let mut last_tick = Instant::now();
        while !shared.stop.load(Ordering::Acquire) {
            let next = tokio::time::timeout(TICK, messages.next()).await;
            if next.is_err() || last_tick.elapsed() >= TICK {
                // Idle, or a tick's worth of events: the counts, the age, the acks.
                last_tick = Instant::now();
                if shared.status().unapplied > 0 && shared.status().oldest_unapplied.is_none() {
                    oldest_unapplied(shared, &stream, applied).await;
                }
                ack_durable(shared, &mut to_ack).await;
            }
            let message = match next {
                Err(_) => continue,
                Ok(None) => continue 'connect,
                Ok(Some(Err(e))) => {
                    shared.note_error("fetching", e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue 'connect;
                }
                Ok(Some(Ok(m))) => m,
            };
            let Ok((seq, pending)) = message.info().map(|i| (i.stream_sequence, i.pending)) else {
                shared.note_error("delivery", "a message without its stream sequence; resuming from the position");
                continue 'connect;
            };
            if seq <= applied {
                shared.status().skipped += 1;
                continue;
            }
            if seq != applied + 1 {
                // A delivery lost on the way (a connection that broke after the server sent it:
                // the server awaits its ack), not necessarily a gap in the stream: from the
                // position again, where the stream's own bounds tell a real gap.
                shared.note_error("delivery", format!("got event {seq} after {applied}; resuming from the position"));
                continue 'connect;
            }
            match apply(shared, seq, &message.payload) {
                Ok(()) => {
                    applied = seq;
                    to_ack.push_back((seq, message));
                    let mut status = shared.status();
                    status.applied = seq;
                    status.unapplied = pending;
                    status.stream_last = status.stream_last.max(seq + pending);
                    if pending == 0 {
                        status.oldest_unapplied = None;
                    }
                    drop(status);
                    shared.progress.notify_all();
                }
                Err(e) if e.needs_reopen() => {
                    // redb takes no more writes through this handle: retrying cannot help.
                    shared.halt(format!("applying event {seq}: {e}"));
                    continue 'connect;
                }
                Err(e) => {
                    // Not the event's fault (a failed commit): from the position again.
                    shared.note_error("applying", e);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue 'connect;
                }
            }
        }
    }
    ack_durable(shared, &mut to_ack).await;
}

/// Why the stream could not be opened: worth retrying, or never (the link halts).
enum Opening {
    Retry(String),
    /// The stream this head applied was deleted.
    Gone(String),
}

/// Opens the stream: creates it if it does not exist, the first time (`created` is `None`);
/// after that only opens it, since one that is gone was deleted under this head (the server
/// lost its store, or someone deleted the stream) and a new one would not hold what it applied.
async fn open_stream(shared: &Shared, js: &Context, created: Option<i128>, applied: u64) -> Result<Stream, Opening> {
    let sharing = &shared.sharing;
    if created.is_none() {
        return js.get_or_create_stream(stream_config(sharing)).await.map_err(|e| match e.kind() {
            CreateStreamErrorKind::JetStreamUnavailable => Opening::Retry(no_jetstream(sharing)),
            _ => Opening::Retry(e.to_string()),
        });
    }
    js.get_stream(&sharing.stream).await.map_err(|e| match e.kind() {
        GetStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND => {
            Opening::Gone(deleted(sharing, applied, "(stream not found)"))
        }
        GetStreamErrorKind::Request
            if std::error::Error::source(&e)
                .and_then(|s| s.downcast_ref::<RequestError>())
                .is_some_and(|r| r.kind() == RequestErrorKind::NoResponders) =>
        {
            Opening::Retry(no_jetstream(sharing))
        }
        _ => Opening::Retry(e.to_string()),
    })
}

/// When the stream was created (ns since the epoch): its identity across reconnections. `None`
/// while the server is still creating it: nats-server lists a new stream before it sets its
/// creation time, and a head that asks in between (another head creating the stream at the same
/// moment) is told Go's zero time, year 1, which no later answer repeats.
fn creation_time(info: &jetstream::stream::Info) -> Option<i128> {
    Some(info.created.unix_timestamp_nanos()).filter(|&ns| ns > 0)
}

/// A server that answers requests but not JetStream's.
fn no_jetstream(sharing: &Sharing) -> String {
    format!(
        "JetStream is not enabled on the NATS server at {}: start nats-server with -js (or enable JetStream for this account)",
        sharing.url
    )
}

/// The stream this head applied was deleted from under it (`how`: and created again, or not
/// found).
fn deleted(sharing: &Sharing, applied: u64, how: &str) -> String {
    format!(
        "stream {} was deleted {how} while this head applied it (up to event {applied}): the server lost its store or \
         someone deleted the stream, and a new stream of that name does not continue this file; stop the heads, delete \
         their files and start them again from new files",
        sharing.stream
    )
}

fn gap(sharing: &Sharing, applied: u64, first: u64) -> String {
    format!(
        "stream {} no longer holds events {}..{} that this head has not applied (its retention dropped them): \
         start this head from a copy of another head's file, which carries its position",
        sharing.stream,
        applied + 1,
        first - 1
    )
}

async fn oldest_unapplied(shared: &Shared, stream: &Stream, applied: u64) {
    if let Ok(m) = stream.get_raw_message(applied + 1).await {
        let at = UNIX_EPOCH + Duration::from_nanos(u64::try_from(m.time.unix_timestamp_nanos()).unwrap_or(0));
        shared.status().oldest_unapplied = Some(at);
    }
}

/// Acks (all up to) the newest delivered event the file holds durably.
async fn ack_durable(shared: &Shared, to_ack: &mut VecDeque<(u64, jetstream::Message)>) {
    let durable = shared.warm.durable_position();
    let mut newest = None;
    while to_ack.front().is_some_and(|&(seq, _)| seq <= durable) {
        newest = to_ack.pop_front();
    }
    if let Some((_, message)) = newest
        && let Err(e) = message.ack().await
    {
        shared.note_error("acknowledging", e);
    }
}

/// Applies the event at stream sequence `seq` to the head's `Warm`. An event no head can apply is
/// counted and skipped alike by every head.
///
/// # Errors
/// What the `Warm` reports for a valid event (a failed commit): the caller retries from the
/// position.
fn apply(shared: &Shared, seq: u64, payload: &[u8]) -> Result<()> {
    let Some(event) = Event::decode(payload) else {
        shared.status().rejected += 1;
        return Ok(());
    };
    let warm = &shared.warm;
    let done = match &event.what {
        What::Ran { model, tenant, namespace, scheme, node, keys } => {
            match Namespace::received(model, *tenant, *namespace).filter(|_| scheme == warm.scheme().name()) {
                Some(ns) => {
                    warm.ran_at(&Prefix::from_keys(warm.scheme(), ns, keys.clone()), node, seq, Waits::Yes).map(drop)
                }
                None => Err(Error::InvalidConfig { detail: "a foreign namespace or hash scheme".into() }),
            }
        }
        What::Forget { node } => warm.forget_at(node, seq),
        What::Capacity { node, blocks } => warm.set_node_capacity_at(node, *blocks, seq),
        What::Engine { node, batch } => match batch.batch() {
            Some(batch) => warm.engine_batch_at(node, &batch, seq),
            None => Err(Error::InvalidConfig { detail: "an engine batch under a namespace this build refuses".into() }),
        },
    };
    let origin = &event.origin;
    let own = origin.head == shared.sharing.head && origin.boot == shared.boot;
    match done {
        Ok(()) => {}
        Err(Error::InvalidName { .. } | Error::InvalidConfig { .. }) => {
            shared.status().rejected += 1;
        }
        Err(e) => return Err(e),
    }
    if own {
        shared.pending().settle(origin.local);
    }
    let mut status = shared.status();
    // The position with the event's origin, in one critical section: a head that waited for the
    // event (`wait_for`) sees it applied.
    status.applied = status.applied.max(seq);
    status.applied_events += 1;
    let from = status.from.entry((origin.head.clone(), origin.boot)).or_default();
    *from = (*from).max(origin.local);
    let mut lag = None;
    if origin.head != shared.sharing.head {
        if status.lags_ns.len() == LAG_SAMPLES {
            status.lags_ns.pop_front();
        }
        let ns = unix_ns(SystemTime::now()).saturating_sub(origin.at_unix_ns);
        status.lags_ns.push_back(ns);
        lag = Some(Duration::from_nanos(ns));
    }
    drop(status);
    telemetry::share_applied(&shared.sharing.head, lag);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream's info as nats-server answers it, created at `created` (RFC 3339).
    fn info(created: &str) -> jetstream::stream::Info {
        let json = format!(
            r#"{{"config":{{"name":"s","subjects":["s.events"],"retention":"limits","max_consumers":-1,
            "max_msgs":-1,"max_bytes":-1,"max_age":0,"max_msg_size":-1,"storage":"file","num_replicas":1,
            "discard":"old"}},"created":"{created}","state":{{"messages":0,"bytes":0,"first_seq":0,
            "first_ts":"0001-01-01T00:00:00Z","last_seq":0,"last_ts":"0001-01-01T00:00:00Z","consumer_count":0}}}}"#
        );
        serde_json::from_str(&json).expect("a stream info")
    }

    #[test]
    fn a_stream_still_being_created_has_no_identity_yet() {
        assert_eq!(creation_time(&info("0001-01-01T00:00:00Z")), None);
        let made = creation_time(&info("2026-12-07T13:31:40.123456789Z"));
        assert_eq!(made, Some(1_796_650_300_123_456_789));
        assert_ne!(made, creation_time(&info("2026-12-07T13:31:40.123456790Z")), "ns tell two streams apart");
    }
}
