//! The ZMQ side of one engine's KV event stream: a SUB socket for the live batches and, when the
//! engine has a replay endpoint, a DEALER to ask its ROUTER for the batches it still buffers.
//!
//! Synchronous, for one thread per engine: every call takes a timeout so that the thread can
//! check whether it should stop. This is transport only: what a gap or a restarted engine means
//! is for the caller to decide from the sequence numbers.
//!
//! Wire format (vLLM's `ZmqEventPublisher`, SGLang's copy of it): every live message is three
//! frames `[topic, seq, payload]`, `seq` an 8-byte big-endian counter. A replay request is
//! `[b"", from_seq]` (8 bytes big-endian) sent by a DEALER; the answer is one message
//! `[b"", topic, seq, payload]` per buffered batch with `seq >= from_seq` (senders before the
//! topic was added answer `[b"", seq, payload]`), then an end marker whose seq is `u64::MAX`
//! and whose payload is empty.

use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Receive queue bound of each socket, in messages. vLLM's PUB keeps up to 100,000 too; past
/// the sum ZMQ drops silently, which the caller sees as a gap in `seq`.
const RECEIVE_HWM: i32 = 100_000;

/// Largest frame accepted, in bytes; a peer sending more is disconnected by ZMQ, which then
/// never connects to it again by itself (a protocol error): the subscriber connects again
/// ([`Subscriber::dropped`]). Real batches are well under a megabyte.
pub(crate) const MAX_FRAME_BYTES: i64 = 256 << 20;

/// How long after a connection of the SUB socket (connecting) is lost ZMQ has to say it tries
/// again (it says so at once) before the subscriber takes the connection as dropped for good
/// and connects again itself.
const DROPPED_AFTER: Duration = Duration::from_millis(500);

/// Longest wait between two reconnection attempts to an engine that is down, in milliseconds
/// (ZMQ starts at 100 ms and doubles up to this).
const RECONNECT_MAX_MS: i32 = 5_000;

/// Interval of ZMTP heartbeats on live connections, in milliseconds, and how long a connection
/// may stay silent before ZMQ drops it (and a connecting socket reconnects): an engine host
/// that vanished without closing its TCP connections is noticed within this time.
const HEARTBEAT_MS: i32 = 5_000;

/// See [`HEARTBEAT_MS`].
const HEARTBEAT_TIMEOUT_MS: i32 = 30_000;

/// The seq of a replay's end marker (`-1` as 8 signed bytes).
const END_SEQ: u64 = u64::MAX;

/// Where one engine publishes, and how to attach to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// The engine's event endpoint, e.g. `tcp://10.0.0.7:5557`.
    pub events: String,
    /// The engine's replay (ROUTER) endpoint, if it has one, e.g. `tcp://10.0.0.7:5558`. The
    /// engine always binds it, so it is always connected to.
    pub replay: Option<String>,
    /// Receive only messages whose topic frame starts with this; `None` receives all.
    pub topic: Option<String>,
    /// Bind `events` instead of connecting to it: vLLM connects (rather than binds) when its
    /// endpoint names a host rather than `*`, and then the subscriber must listen.
    pub bind: bool,
}

/// One batch as received: its topic, sequence number and msgpack payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Message {
    /// The topic frame (empty from replays of senders that predate the topic frame).
    pub topic: Vec<u8>,
    /// The publisher's sequence number: 0 at engine start, +1 per batch.
    pub seq: u64,
    /// The batch, for [`super::decode::decode_batch`].
    pub payload: Vec<u8>,
}

/// The answer to a replay request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Replayed {
    /// The buffered batches from the requested seq on, in the order the engine sent them.
    pub messages: Vec<Message>,
    /// Whether the first replayed batch is the one asked for. False when the engine's buffer
    /// no longer reaches back that far (the batches before the first replayed one are lost) or
    /// when it holds nothing at or after the requested seq (`messages` is then empty).
    pub starts_at_requested: bool,
}

/// What went wrong on the ZMQ side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Error {
    /// A ZMQ call failed: a malformed endpoint, an address already in use, a closed context.
    Zmq {
        /// What was being done.
        op: &'static str,
        /// The endpoint concerned.
        endpoint: String,
        /// ZMQ's error.
        source: zmq::Error,
    },
    /// [`Subscriber::replay`] was called for an endpoint without a replay address.
    NoReplayEndpoint,
    /// The replay endpoint did not finish answering in time. The request's socket has been
    /// dropped, so a late answer cannot mix with the next request's.
    ReplayTimeout {
        /// The replay endpoint.
        endpoint: String,
        /// The timeout given.
        waited: Duration,
        /// Messages received before giving up (discarded).
        received: usize,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Zmq { op, endpoint, source } => write!(f, "ZMQ {op} on {endpoint} failed: {source}"),
            Error::NoReplayEndpoint => write!(f, "replay asked of an engine endpoint without a replay address"),
            Error::ReplayTimeout { endpoint, waited, received } => write!(
                f,
                "replay from {endpoint} not finished after {waited:?} ({received} messages received, discarded)"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Zmq { source, .. } => Some(source),
            Error::NoReplayEndpoint | Error::ReplayTimeout { .. } => None,
        }
    }
}

/// The live and replay sockets of one engine endpoint.
pub(crate) struct Subscriber {
    /// What this subscriber was opened with.
    endpoint: Endpoint,
    /// The live SUB socket.
    sub: zmq::Socket,
    /// The replay DEALER, made on the first replay and dropped after a failed one.
    dealer: Option<zmq::Socket>,
    /// Messages (live or replayed) of the wrong shape, skipped.
    malformed: u64,
    /// The SUB socket's monitor: its connections made and lost (`None` once dropped).
    monitor: Option<zmq::Socket>,
    /// Connections of the SUB socket that are up (handshakes done, not yet disconnected), by
    /// the file descriptor libzmq's events name.
    peers: std::collections::HashSet<u32>,
    /// Connections made (TCP up) whose handshake is not done yet, oldest first (libzmq's
    /// handshake event names no file descriptor: it is the oldest's).
    handshaking: std::collections::VecDeque<u32>,
    /// Largest frame accepted, in bytes.
    max_frame: i64,
    /// When a connection was lost (connecting) without ZMQ saying it tries again since.
    lost_at: Option<Instant>,
    /// Connections ZMQ dropped for good and the subscriber made again ([`Self::dropped`]).
    dropped: u64,
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber")
            .field("endpoint", &self.endpoint)
            .field("replay_connected", &self.dealer.is_some())
            .field("malformed", &self.malformed)
            .finish()
    }
}

impl Subscriber {
    /// [`Self::open_with`] the default cap ([`MAX_FRAME_BYTES`]).
    ///
    /// # Errors
    /// As [`Self::open_with`].
    #[cfg(test)]
    pub(crate) fn open(endpoint: Endpoint) -> Result<Subscriber, Error> {
        Subscriber::open_with(endpoint, MAX_FRAME_BYTES)
    }

    /// Opens the SUB socket, accepting frames of up to `max_frame` bytes, subscribes to the
    /// topic prefix and connects to (or binds) the event endpoint. Connecting succeeds whether
    /// or not the engine is up yet: ZMQ keeps trying in the background, and reconnects
    /// (resubscribing) after an engine restart; a connection ZMQ drops for good is made again
    /// here ([`Self::dropped`]).
    ///
    /// # Errors
    /// [`Error::Zmq`] when the endpoint is malformed or cannot be bound.
    pub(crate) fn open_with(endpoint: Endpoint, max_frame: i64) -> Result<Subscriber, Error> {
        let fail = |op| {
            let events = endpoint.events.clone();
            move |source| Error::Zmq { op, endpoint: events, source }
        };
        let sub = context().socket(zmq::SUB).map_err(fail("socket"))?;
        configure(&sub, max_frame).map_err(fail("setsockopt"))?;
        sub.set_ipv6(needs_ipv6(&endpoint.events)).map_err(fail("setsockopt"))?;
        let prefix = endpoint.topic.as_deref().unwrap_or("");
        sub.set_subscribe(prefix.as_bytes()).map_err(fail("subscribe"))?;
        // The monitor is set before the socket connects, so that it sees the first handshake.
        static MONITORS: AtomicU64 = AtomicU64::new(0);
        let address = format!("inproc://superfluid-warm-monitor-{}", MONITORS.fetch_add(1, Ordering::Relaxed));
        let events = [
            zmq::SocketEvent::CONNECTED,
            zmq::SocketEvent::ACCEPTED,
            zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
            zmq::SocketEvent::DISCONNECTED,
            zmq::SocketEvent::CONNECT_RETRIED,
        ];
        let events = events.iter().fold(0, |all, e| all | e.to_raw()) as i32;
        sub.monitor(&address, events).map_err(fail("monitor"))?;
        let monitor = context().socket(zmq::PAIR).map_err(fail("socket"))?;
        monitor.set_linger(0).map_err(fail("setsockopt"))?;
        monitor.connect(&address).map_err(fail("connect"))?;
        if endpoint.bind {
            sub.bind(&endpoint.events).map_err(fail("bind"))?;
        } else {
            sub.connect(&endpoint.events).map_err(fail("connect"))?;
        }
        Ok(Subscriber {
            endpoint,
            sub,
            dealer: None,
            malformed: 0,
            monitor: Some(monitor),
            peers: Default::default(),
            handshaking: Default::default(),
            max_frame,
            lost_at: None,
            dropped: 0,
        })
    }

    #[cfg(test)]
    /// The address actually bound, in bind mode (with the port ZMQ chose for a `*` or `0`
    /// port); `None` in connect mode.
    pub(crate) fn bound_endpoint(&self) -> Option<String> {
        if !self.endpoint.bind {
            return None;
        }
        self.sub.get_last_endpoint().ok().and_then(Result::ok)
    }

    /// How many messages of the wrong shape (frame count, seq length) were received and
    /// skipped, live and replayed.
    pub(crate) fn malformed(&self) -> u64 {
        self.malformed
    }

    /// Whether an engine is connected to the SUB socket now (a ZMTP handshake done and its
    /// connection not lost since), as of the last [`Self::next`].
    pub(crate) fn connected(&self) -> bool {
        !self.peers.is_empty()
    }

    /// Connections of the SUB socket that ZMQ dropped for good (a frame over the size cap, or
    /// one that broke the protocol: it then never connects again by itself) and the subscriber
    /// made again. What was sent on such a connection from its dropped frame on is lost.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Takes the monitor's events that have arrived: each connection made waits for its
    /// handshake, each handshake is a connection up, each disconnection one down. A connection
    /// (connecting) lost without ZMQ saying it tries again was dropped for good: it is made
    /// again here.
    fn watch(&mut self) {
        let Some(monitor) = self.monitor.as_ref() else { return };
        while let Ok(frames) = monitor.recv_multipart(zmq::DONTWAIT) {
            // libzmq's monitor message: the event (u16) and a value (u32), in the host's order,
            // then the peer's address. The value of a connection made or lost is its file
            // descriptor; a handshake's is 0.
            // (A failed handshake is disconnected too: only a connection that was up goes down.)
            let head = frames.first().and_then(|f| f.get(..6)).and_then(|b| <[u8; 6]>::try_from(b).ok());
            let Some([e0, e1, v0, v1, v2, v3]) = head else { continue };
            let (event, fd) = (u16::from_ne_bytes([e0, e1]), u32::from_ne_bytes([v0, v1, v2, v3]));
            if event == zmq::SocketEvent::CONNECTED.to_raw() || event == zmq::SocketEvent::ACCEPTED.to_raw() {
                self.handshaking.push_back(fd);
                self.lost_at = None;
            } else if event == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() {
                if let Some(fd) = self.handshaking.pop_front() {
                    self.peers.insert(fd);
                }
            } else if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
                self.peers.remove(&fd);
                self.handshaking.retain(|&h| h != fd);
                if !self.endpoint.bind {
                    self.lost_at = Some(Instant::now());
                }
            } else if event == zmq::SocketEvent::CONNECT_RETRIED.to_raw() {
                self.lost_at = None;
            }
        }
        if self.lost_at.is_some_and(|t| t.elapsed() >= DROPPED_AFTER) {
            self.lost_at = None;
            self.dropped = self.dropped.saturating_add(1);
            // Connected again from scratch; if this fails, the next loss tries again.
            let _ = self.sub.disconnect(&self.endpoint.events);
            let _ = self.sub.connect(&self.endpoint.events);
        }
    }

    /// Waits up to `timeout` for the next well-formed live message; `Ok(None)` when none came.
    /// Malformed messages are counted ([`Self::malformed`]) and skipped. A zero timeout only
    /// takes what has already arrived.
    ///
    /// # Errors
    /// [`Error::Zmq`] when the socket fails (not for an engine that is down).
    pub(crate) fn next(&mut self, timeout: Duration) -> Result<Option<Message>, Error> {
        let deadline = Deadline::after(timeout);
        self.watch();
        loop {
            let Some(frames) = receive(&self.sub, &deadline).map_err(|source| self.live_error("recv", source))? else {
                self.watch();
                return Ok(None);
            };
            match parse_live(frames) {
                Some(message) => return Ok(Some(message)),
                None => self.malformed = self.malformed.saturating_add(1),
            }
        }
    }

    /// Asks the engine's replay endpoint for its buffered batches from `from_seq` on, and waits
    /// up to `timeout` (in all) for the whole answer. Replies of the wrong shape are counted
    /// ([`Self::malformed`]) and skipped.
    ///
    /// The replay socket is kept for the next request after a complete answer and dropped after
    /// any failure, so that a late answer to this request never mixes with the next one's.
    ///
    /// # Errors
    /// [`Error::NoReplayEndpoint`] without a replay address, [`Error::ReplayTimeout`] when the
    /// end marker did not arrive in time (nothing answers, or too slowly), [`Error::Zmq`] when a
    /// socket fails.
    pub(crate) fn replay(&mut self, from_seq: u64, timeout: Duration) -> Result<Replayed, Error> {
        let Some(address) = self.endpoint.replay.clone() else {
            return Err(Error::NoReplayEndpoint);
        };
        let result = self.replay_from(&address, from_seq, timeout);
        if result.is_err() {
            self.dealer = None;
        }
        result
    }

    /// [`Self::replay`] against `address`, leaving the dropping of the socket to the caller.
    fn replay_from(&mut self, address: &str, from_seq: u64, timeout: Duration) -> Result<Replayed, Error> {
        let deadline = Deadline::after(timeout);
        let fail = |op| move |source| Error::Zmq { op, endpoint: address.to_owned(), source };
        let dealer = match self.dealer.take() {
            Some(dealer) => dealer,
            None => {
                let dealer = context().socket(zmq::DEALER).map_err(fail("socket"))?;
                configure(&dealer, self.max_frame).map_err(fail("setsockopt"))?;
                dealer.set_ipv6(needs_ipv6(address)).map_err(fail("setsockopt"))?;
                dealer.connect(address).map_err(fail("connect"))?;
                dealer
            }
        };
        let timed_out = |received| Error::ReplayTimeout { endpoint: address.to_owned(), waited: timeout, received };
        // A DEALER queues the request until the connection is up; the send only waits when that
        // queue is full, which a fresh socket's is not.
        dealer.set_sndtimeo(deadline.poll_ms().try_into().unwrap_or(i32::MAX)).map_err(fail("setsockopt"))?;
        let request: [&[u8]; 2] = [b"", &from_seq.to_be_bytes()];
        match dealer.send_multipart(request, 0) {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) => return Err(timed_out(0)),
            Err(source) => return Err(fail("send")(source)),
        }
        let mut messages: Vec<Message> = Vec::new();
        loop {
            let Some(frames) = receive(&dealer, &deadline).map_err(fail("recv"))? else {
                return Err(timed_out(messages.len()));
            };
            match parse_reply(frames) {
                Some(Reply::End) => break,
                Some(Reply::Batch(message)) => messages.push(message),
                None => self.malformed = self.malformed.saturating_add(1),
            }
        }
        self.dealer = Some(dealer);
        let starts_at_requested = messages.first().is_some_and(|first| first.seq == from_seq);
        Ok(Replayed { messages, starts_at_requested })
    }

    /// An [`Error::Zmq`] about the live socket.
    fn live_error(&self, op: &'static str, source: zmq::Error) -> Error {
        Error::Zmq { op, endpoint: self.endpoint.events.clone(), source }
    }
}

/// A tcp address's host and port, as ZMQ reads them (`tcp://[source;]host:port`); `None` for
/// another transport.
pub(crate) fn host_port(address: &str) -> Option<(&str, &str)> {
    let rest = address.strip_prefix("tcp://")?;
    let rest = rest.rsplit_once(';').map_or(rest, |(_, r)| r);
    Some(rest.rsplit_once(':').unwrap_or((rest, "")))
}

/// Whether a socket for `address` needs IPv6 on (`ZMQ_IPV6`, off by default: libzmq then takes
/// `[::1]` for an interface's name): a tcp address whose host is an IPv6 address in brackets,
/// or a name that resolves to IPv6 addresses only. Not on for every address: a name such as
/// `localhost` could then resolve to `::1` while the engine listens on 127.0.0.1 only.
fn needs_ipv6(address: &str) -> bool {
    let Some((host, port)) = host_port(address) else { return false };
    if host.starts_with('[') {
        return true;
    }
    let port = port.parse::<u16>().unwrap_or(0);
    std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .map(|addrs| addrs.collect::<Vec<_>>())
        .is_ok_and(|addrs| !addrs.is_empty() && addrs.iter().all(std::net::SocketAddr::is_ipv6))
}

/// One ZMQ context (one I/O thread) for every subscriber of the process, made on first use.
fn context() -> zmq::Context {
    static CONTEXT: OnceLock<zmq::Context> = OnceLock::new();
    CONTEXT.get_or_init(zmq::Context::new).clone()
}

impl Drop for Subscriber {
    /// libzmq's monitor sends its events (the last ones come as the SUB socket closes, from its
    /// I/O thread) to its own PAIR socket with a blocking send; with our end of that pair closed,
    /// the send would block the context's I/O thread, and every socket of the process with it.
    /// So our end outlives the SUB socket: it is kept, connected, for the rest of the process
    /// (one socket a subscriber ever opened; what reaches it is a few events, far below its
    /// high-water mark), and what it has received is read off whenever another is kept.
    fn drop(&mut self) {
        static KEPT: std::sync::Mutex<Vec<zmq::Socket>> = std::sync::Mutex::new(Vec::new());
        if let (Some(monitor), Ok(mut kept)) = (self.monitor.take(), KEPT.lock()) {
            kept.push(monitor);
            for socket in kept.iter() {
                while socket.recv_multipart(zmq::DONTWAIT).is_ok() {}
            }
        }
    }
}

/// The options every socket gets: no lingering on close (unsent requests are worthless then),
/// frames of up to `max_frame` bytes, a bounded queue, capped reconnection backoff, heartbeats
/// to notice dead peers.
fn configure(socket: &zmq::Socket, max_frame: i64) -> zmq::Result<()> {
    socket.set_linger(0)?;
    socket.set_rcvhwm(RECEIVE_HWM)?;
    socket.set_maxmsgsize(max_frame)?;
    socket.set_reconnect_ivl_max(RECONNECT_MAX_MS)?;
    socket.set_heartbeat_ivl(HEARTBEAT_MS)?;
    socket.set_heartbeat_timeout(HEARTBEAT_TIMEOUT_MS)?;
    Ok(())
}

/// A point in time a wait must not pass.
struct Deadline(Option<Instant>);

impl Deadline {
    /// `timeout` from now (never, if that is past what `Instant` can hold).
    fn after(timeout: Duration) -> Deadline {
        Deadline(Instant::now().checked_add(timeout))
    }

    /// Time left, zero once passed.
    fn remaining(&self) -> Duration {
        match self.0 {
            Some(at) => at.saturating_duration_since(Instant::now()),
            None => Duration::MAX,
        }
    }

    /// Time left in whole milliseconds for `zmq_poll`, rounded up so that a sub-millisecond
    /// remainder waits instead of spinning; -1 (forever) for an unbounded deadline.
    fn poll_ms(&self) -> i64 {
        if self.0.is_none() {
            return -1;
        }
        let left = self.remaining();
        let ms = left.as_millis().saturating_add(u128::from(!left.subsec_nanos().is_multiple_of(1_000_000)));
        i64::try_from(ms).unwrap_or(i64::MAX)
    }
}

/// Receives one whole message from `socket`, waiting until `deadline`; `None` when nothing
/// arrived in time. Interrupted waits are resumed.
fn receive(socket: &zmq::Socket, deadline: &Deadline) -> zmq::Result<Option<Vec<Vec<u8>>>> {
    loop {
        match socket.recv_multipart(zmq::DONTWAIT) {
            Ok(frames) => return Ok(Some(frames)),
            Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => {}
            Err(error) => return Err(error),
        }
        if deadline.remaining().is_zero() {
            return Ok(None);
        }
        match socket.poll(zmq::POLLIN, deadline.poll_ms()) {
            Ok(_) | Err(zmq::Error::EINTR) => {}
            Err(error) => return Err(error),
        }
    }
}

/// The 8-byte big-endian seq frame, `None` for any other length.
fn parse_seq(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

/// A live message: exactly `[topic, seq, payload]`.
fn parse_live(frames: Vec<Vec<u8>>) -> Option<Message> {
    let [topic, seq, payload] = <[Vec<u8>; 3]>::try_from(frames).ok()?;
    Some(Message { topic, seq: parse_seq(&seq)?, payload })
}

/// One message of a replay answer.
enum Reply {
    /// A buffered batch.
    Batch(Message),
    /// The end marker.
    End,
}

/// A replay reply: `[b"", topic, seq, payload]`, or `[b"", seq, payload]` from senders that
/// predate the topic frame; seq `u64::MAX` with an empty payload is the end marker.
fn parse_reply(frames: Vec<Vec<u8>>) -> Option<Reply> {
    let mut frames = frames.into_iter();
    if !frames.next()?.is_empty() {
        return None;
    }
    let (topic, seq, payload) = match (frames.next(), frames.next(), frames.next(), frames.next()) {
        (Some(topic), Some(seq), Some(payload), None) => (topic, seq, payload),
        (Some(seq), Some(payload), None, None) => (Vec::new(), seq, payload),
        _ => return None,
    };
    let seq = parse_seq(&seq)?;
    if seq == END_SEQ && payload.is_empty() {
        return Some(Reply::End);
    }
    Some(Reply::Batch(Message { topic, seq, payload }))
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::mpsc;
    use std::thread::{self, JoinHandle};

    use super::*;
    use crate::engine::decode::decode_batch;

    /// How long any wait that should succeed may take on a loaded machine.
    const PATIENCE: Duration = Duration::from_secs(10);

    /// Seqs of the messages published until a subscriber has joined; skipped afterwards.
    const PROBE: u64 = 1 << 40;

    /// The topic vLLM would send with `"topic": "kv@engine-0@mooncake"`.
    const TOPIC: &[u8] = b"kv@engine-0@mooncake";

    /// A payload vLLM's own classes and encoder made.
    fn vllm_payload() -> Vec<u8> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv-events/v033_batch_mixed.msgpack");
        std::fs::read(path).expect("fixture")
    }

    fn endpoint(events: &str) -> Endpoint {
        Endpoint { events: events.to_owned(), replay: None, topic: None, bind: false }
    }

    /// A socket of the test's own (the engine's side), bound to a free loopback port.
    fn bound(ctx: &zmq::Context, kind: zmq::SocketType) -> (zmq::Socket, String) {
        let socket = ctx.socket(kind).expect("socket");
        socket.set_linger(0).expect("linger");
        socket.bind("tcp://127.0.0.1:*").expect("bind");
        let address = socket.get_last_endpoint().expect("endpoint").expect("utf-8 endpoint");
        (socket, address)
    }

    fn publish(publisher: &zmq::Socket, topic: &[u8], seq: u64, payload: &[u8]) {
        publisher.send_multipart([topic, &seq.to_be_bytes(), payload], 0).expect("publish");
    }

    /// Publishes probes until the subscriber gets one (PUB/SUB drops everything sent before a
    /// subscription has reached the publisher).
    fn join(publisher: &zmq::Socket, sub: &mut Subscriber, topic: &[u8]) {
        let deadline = Instant::now() + PATIENCE;
        for probe in PROBE.. {
            assert!(Instant::now() < deadline, "the subscriber never joined");
            publish(publisher, topic, probe, b"probe");
            if let Some(m) = sub.next(Duration::from_millis(50)).expect("next") {
                assert!(m.seq >= PROBE, "only probes so far");
                return;
            }
        }
    }

    /// The next message that is not a leftover probe.
    fn next_real(sub: &mut Subscriber) -> Message {
        loop {
            let m = sub.next(PATIENCE).expect("next").expect("a message within the patience");
            if m.seq < PROBE {
                return m;
            }
        }
    }

    #[test]
    fn receives_in_connect_mode() {
        let ctx = zmq::Context::new();
        let (publisher, address) = bound(&ctx, zmq::PUB);
        let mut sub = Subscriber::open(endpoint(&address)).expect("open");
        assert_eq!(sub.bound_endpoint(), None);
        join(&publisher, &mut sub, TOPIC);
        let payload = vllm_payload();
        for seq in 0..5 {
            publish(&publisher, TOPIC, seq, &payload);
        }
        for seq in 0..5 {
            let m = next_real(&mut sub);
            assert_eq!((m.topic.as_slice(), m.seq, &m.payload), (TOPIC, seq, &payload));
        }
        let batch = decode_batch(&payload).expect("vLLM's payload decodes");
        assert_eq!(batch.dp_rank, Some(3));
        assert_eq!(sub.next(Duration::ZERO).expect("next"), None, "nothing else was sent");
        assert_eq!(sub.malformed(), 0);
    }

    #[test]
    fn receives_in_bind_mode() {
        let ctx = zmq::Context::new();
        let mut sub = Subscriber::open(Endpoint { bind: true, ..endpoint("tcp://127.0.0.1:*") }).expect("open");
        let address = sub.bound_endpoint().expect("bound address");
        assert!(address.starts_with("tcp://127.0.0.1:") && !address.ends_with(":*"), "{address}");
        let publisher = ctx.socket(zmq::PUB).expect("socket");
        publisher.set_linger(0).expect("linger");
        publisher.connect(&address).expect("the engine connects");
        join(&publisher, &mut sub, b"");
        publish(&publisher, b"", 0, b"batch");
        let m = next_real(&mut sub);
        assert_eq!((m.topic, m.seq, m.payload), (Vec::new(), 0, b"batch".to_vec()));
    }

    /// IPv6 addresses (`tcp://[::1]:P`), connecting and bound: libzmq needs IPv6 on the socket
    /// (without it, a connect hears nothing and a bind fails "No such device").
    #[test]
    fn receives_over_ipv6_connecting_and_bound() {
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::PUB).expect("socket");
        publisher.set_linger(0).expect("linger");
        publisher.set_ipv6(true).expect("ipv6");
        publisher.bind("tcp://[::1]:*").expect("bind on ::1");
        let address = publisher.get_last_endpoint().expect("endpoint").expect("utf-8 endpoint");
        let mut sub = Subscriber::open(endpoint(&address)).expect("open");
        join(&publisher, &mut sub, b"");
        publish(&publisher, b"", 0, b"batch");
        assert_eq!(next_real(&mut sub).seq, 0);
        let port = std::net::TcpListener::bind("[::1]:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let mut sub =
            Subscriber::open(Endpoint { bind: true, ..endpoint(&format!("tcp://[::1]:{port}")) }).expect("bind");
        let publisher = ctx.socket(zmq::PUB).expect("socket");
        publisher.set_linger(0).expect("linger");
        publisher.set_ipv6(true).expect("ipv6");
        publisher.connect(&format!("tcp://[::1]:{port}")).expect("the engine connects");
        join(&publisher, &mut sub, b"");
        publish(&publisher, b"", 7, b"batch");
        assert_eq!(next_real(&mut sub).seq, 7);
        assert!(needs_ipv6("tcp://[::1]:5557") && !needs_ipv6("tcp://127.0.0.1:5557") && !needs_ipv6("ipc:///x"));
    }

    /// A frame over the size cap: ZMQ drops the connection and would never make it again; the
    /// subscriber sees it lost, says so, connects again, and hears what comes next. An engine
    /// that goes away is not such a drop (ZMQ connects again by itself).
    #[test]
    fn a_frame_over_the_cap_drops_the_connection_and_it_is_made_again() {
        let ctx = zmq::Context::new();
        let (publisher, address) = bound(&ctx, zmq::PUB);
        let mut sub = Subscriber::open_with(endpoint(&address), 1000).expect("open");
        join(&publisher, &mut sub, b"");
        assert!(sub.connected());
        publish(&publisher, b"", 0, &[7; 5000]);
        let deadline = Instant::now() + PATIENCE;
        while sub.dropped() == 0 {
            assert!(Instant::now() < deadline, "the drop was never seen");
            assert_eq!(sub.next(Duration::from_millis(50)).expect("next"), None, "nothing over the cap");
        }
        join(&publisher, &mut sub, b"");
        publish(&publisher, b"", 1, b"after");
        assert_eq!(next_real(&mut sub).seq, 1);
        assert!(sub.connected() && sub.dropped() == 1);
        // The engine goes away: not connected, and not a drop.
        drop(publisher);
        let deadline = Instant::now() + PATIENCE;
        while sub.connected() {
            assert!(Instant::now() < deadline, "still connected to an engine that went away");
            sub.next(Duration::from_millis(50)).expect("next");
        }
        sub.next(DROPPED_AFTER * 2).expect("next");
        assert_eq!(sub.dropped(), 1, "ZMQ connects again by itself");
    }

    #[test]
    fn topic_prefix_filters() {
        let ctx = zmq::Context::new();
        let (publisher, address) = bound(&ctx, zmq::PUB);
        let mut sub =
            Subscriber::open(Endpoint { topic: Some("kv@engine-0@".into()), ..endpoint(&address) }).expect("open");
        join(&publisher, &mut sub, TOPIC);
        publish(&publisher, b"kv@engine-1@mooncake", 1, b"other engine");
        publish(&publisher, b"kv@engine-0", 2, b"shorter than the prefix");
        publish(&publisher, TOPIC, 3, b"ours");
        let m = next_real(&mut sub);
        assert_eq!((m.topic.as_slice(), m.seq), (TOPIC, 3), "the others were filtered out before it");
    }

    #[test]
    fn malformed_messages_are_counted_and_skipped() {
        let ctx = zmq::Context::new();
        let (publisher, address) = bound(&ctx, zmq::PUB);
        let mut sub = Subscriber::open(endpoint(&address)).expect("open");
        join(&publisher, &mut sub, b"");
        let seq = 9u64.to_be_bytes();
        let bad: [&[&[u8]]; 4] = [&[b"t", &seq], &[b"t", &seq[..7], b"p"], &[b"t", &seq, b"p", b"extra"], &[b"t"]];
        for frames in bad {
            publisher.send_multipart(frames, 0).expect("send");
        }
        publish(&publisher, b"t", 10, b"good");
        let m = next_real(&mut sub);
        assert_eq!((m.seq, m.payload), (10, b"good".to_vec()));
        assert_eq!(sub.malformed(), 4);
    }

    #[test]
    fn connects_before_the_engine_is_up_and_after_it_restarts() {
        let ctx = zmq::Context::new();
        let (engine, address) = bound(&ctx, zmq::PUB);
        drop(engine);
        let mut sub = Subscriber::open(Endpoint { topic: Some("kv@".into()), ..endpoint(&address) }).expect("open");
        for restart in 0..2 {
            let publisher = ctx.socket(zmq::PUB).expect("socket");
            publisher.set_linger(0).expect("linger");
            // ZMQ closes a dropped socket's listener in the background: retry until it is gone.
            let deadline = Instant::now() + PATIENCE;
            while let Err(error) = publisher.bind(&address) {
                assert!(Instant::now() < deadline, "the port never came free: {error}");
                thread::sleep(Duration::from_millis(20));
            }
            join(&publisher, &mut sub, TOPIC);
            publish(&publisher, TOPIC, 0, b"after start");
            assert_eq!(next_real(&mut sub).payload, b"after start", "start {restart}");
        }
    }

    /// A ROUTER of the test's own on a free port, run by `serve` on a thread.
    fn router(serve: impl FnOnce(zmq::Socket) + Send + 'static) -> (String, JoinHandle<()>) {
        let ctx = zmq::Context::new();
        let (socket, address) = bound(&ctx, zmq::ROUTER);
        socket.set_rcvtimeo(30_000).expect("rcvtimeo");
        let handle = thread::spawn(move || {
            let _ctx = ctx;
            serve(socket);
        });
        (address, handle)
    }

    /// Reads one replay request as vLLM does: `[identity, b"", start_seq]`.
    fn request(router: &zmq::Socket) -> (Vec<u8>, u64) {
        let frames = router.recv_multipart(0).expect("a replay request");
        let [id, empty, start] = <[Vec<u8>; 3]>::try_from(frames).expect("three frames");
        assert!(empty.is_empty());
        (id, u64::from_be_bytes(start.try_into().expect("8-byte start")))
    }

    /// Answers as vLLM 0.33 does (with the topic frame) or as older senders do (without).
    fn answer(router: &zmq::Socket, id: &[u8], buffer: &[(u64, Vec<u8>)], start: u64, with_topic: bool) {
        for (seq, payload) in buffer.iter().filter(|(seq, _)| *seq >= start) {
            let seq = seq.to_be_bytes();
            let frames: Vec<&[u8]> =
                if with_topic { vec![id, b"", TOPIC, &seq, payload] } else { vec![id, b"", &seq, payload] };
            router.send_multipart(frames, 0).expect("answer");
        }
        let end = END_SEQ.to_be_bytes();
        let frames: Vec<&[u8]> = if with_topic { vec![id, b"", b"", &end, b""] } else { vec![id, b"", &end, b""] };
        router.send_multipart(frames, 0).expect("end marker");
    }

    fn buffer(seqs: std::ops::Range<u64>) -> Vec<(u64, Vec<u8>)> {
        seqs.map(|seq| (seq, format!("batch {seq}").into_bytes())).collect()
    }

    fn with_replay(address: &str) -> Endpoint {
        // The live side is never used by the replay tests: any valid address will do.
        Endpoint { replay: Some(address.to_owned()), ..endpoint("tcp://127.0.0.1:9") }
    }

    fn seqs(replayed: &Replayed) -> Vec<u64> {
        replayed.messages.iter().map(|m| m.seq).collect()
    }

    #[test]
    fn replay_happy_path_and_reuse() {
        let (address, handle) = router(|router| {
            let buffered = buffer(0..10);
            for _ in 0..2 {
                let (id, start) = request(&router);
                answer(&router, &id, &buffered, start, true);
            }
        });
        let mut sub = Subscriber::open(with_replay(&address)).expect("open");
        let replayed = sub.replay(5, PATIENCE).expect("replay");
        assert_eq!(seqs(&replayed), vec![5, 6, 7, 8, 9]);
        assert!(replayed.starts_at_requested);
        let first = replayed.messages.first().expect("a first message");
        assert_eq!((first.topic.as_slice(), first.payload.as_slice()), (TOPIC, b"batch 5".as_slice()));
        let again = sub.replay(9, PATIENCE).expect("second replay on the same socket");
        assert_eq!((seqs(&again), again.starts_at_requested), (vec![9], true));
        handle.join().expect("router");
        assert_eq!(sub.malformed(), 0);
    }

    #[test]
    fn replay_starting_later_than_asked_or_empty() {
        let (address, handle) = router(|router| {
            let buffered = buffer(10..15);
            for _ in 0..2 {
                let (id, start) = request(&router);
                answer(&router, &id, &buffered, start, true);
            }
        });
        let mut sub = Subscriber::open(with_replay(&address)).expect("open");
        let replayed = sub.replay(3, PATIENCE).expect("replay");
        assert_eq!((seqs(&replayed), replayed.starts_at_requested), (vec![10, 11, 12, 13, 14], false));
        let empty = sub.replay(15, PATIENCE).expect("replay");
        assert_eq!((seqs(&empty), empty.starts_at_requested), (vec![], false));
        handle.join().expect("router");
    }

    #[test]
    fn replay_of_old_senders_without_topic_and_malformed_replies() {
        let (address, handle) = router(|router| {
            let (id, start) = request(&router);
            router.send_multipart([&id[..], b"", b"short", b"x"], 0).expect("malformed reply");
            router.send_multipart([&id[..], b"not empty", &7u64.to_be_bytes(), b"x"], 0).expect("malformed reply");
            answer(&router, &id, &buffer(0..4), start, false);
        });
        let mut sub = Subscriber::open(with_replay(&address)).expect("open");
        let replayed = sub.replay(2, PATIENCE).expect("replay");
        assert_eq!((seqs(&replayed), replayed.starts_at_requested), (vec![2, 3], true));
        assert!(replayed.messages.iter().all(|m| m.topic.is_empty()));
        assert_eq!(sub.malformed(), 2);
        handle.join().expect("router");
    }

    #[test]
    fn replay_times_out_and_a_late_answer_never_mixes_with_the_next() {
        let (timed_out_tx, timed_out_rx) = mpsc::channel::<()>();
        let (address, handle) = router(move |router| {
            let buffered = buffer(0..20);
            let (late_id, late_start) = request(&router);
            // Answer the first request only once the subscriber has given up on it.
            timed_out_rx.recv().expect("the test's signal");
            answer(&router, &late_id, &buffered, late_start, true);
            let (id, start) = request(&router);
            answer(&router, &id, &buffered, start, true);
        });
        let mut sub = Subscriber::open(with_replay(&address)).expect("open");
        let started = Instant::now();
        match sub.replay(15, Duration::from_millis(300)) {
            Err(Error::ReplayTimeout { received: 0, .. }) => {}
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(started.elapsed() < PATIENCE, "the timeout is honoured");
        timed_out_tx.send(()).expect("signal");
        let replayed = sub.replay(3, PATIENCE).expect("second replay");
        assert_eq!(seqs(&replayed), (3..20).collect::<Vec<_>>(), "only the second request's answer");
        handle.join().expect("router");
    }

    #[test]
    fn replay_with_nothing_listening_times_out() {
        let ctx = zmq::Context::new();
        let (socket, address) = bound(&ctx, zmq::ROUTER);
        drop(socket);
        let mut sub = Subscriber::open(with_replay(&address)).expect("open");
        for _ in 0..2 {
            match sub.replay(0, Duration::from_millis(200)) {
                Err(Error::ReplayTimeout { endpoint, .. }) => assert_eq!(endpoint, address),
                other => panic!("expected a timeout, got {other:?}"),
            }
        }
    }

    #[test]
    fn replay_needs_an_address_and_bad_endpoints_are_errors() {
        let mut sub = Subscriber::open(endpoint("tcp://127.0.0.1:9")).expect("open");
        assert_eq!(sub.replay(0, PATIENCE), Err(Error::NoReplayEndpoint));
        match Subscriber::open(endpoint("not an endpoint")) {
            Err(Error::Zmq { op: "connect", .. }) => {}
            other => panic!("expected a connect error, got {other:?}"),
        }
        let taken = Subscriber::open(Endpoint { bind: true, ..endpoint("tcp://127.0.0.1:*") }).expect("open");
        let address = taken.bound_endpoint().expect("bound");
        let err = Subscriber::open(Endpoint { bind: true, ..endpoint(&address) }).expect_err("port in use");
        assert!(err.to_string().contains("bind"), "{err}");
    }
}
