//! `Sharing`: which stream a head shares through, and as whom.

use std::sync::Arc;
use std::time::Duration;

use async_nats::ServerAddr;

use crate::error::{Error, Result};

/// Most events a head buffers while the server is unreachable (by default): past it the oldest
/// are dropped, and counted.
pub const DEFAULT_BUFFER_EVENTS: usize = 65_536;

/// How a head shares its `ran`s and forgets with other heads: one NATS JetStream stream, each
/// head consuming it with its own durable consumer. See `ARCHITECTURE.md`, "Sharing".
#[derive(Clone, Debug)]
pub struct Sharing {
    pub(crate) url: String,
    pub(crate) stream: String,
    pub(crate) head: String,
    pub(crate) max_age: Duration,
    pub(crate) max_bytes: i64,
    pub(crate) buffer_events: usize,
    pub(crate) publish_timeout: Duration,
}

impl Sharing {
    /// Shares through stream `stream` of the NATS server at `url` (`nats://127.0.0.1:4222`; the
    /// scheme and host are required, checked by [`crate::SharedWarm::open`]), as
    /// head `head`: a name of its own among the heads sharing the stream, kept across restarts
    /// (it names the head's durable consumer). The stream is created if it does not exist, with
    /// file storage and limits retention: 24 hours and 1 GiB by default.
    pub fn nats(url: &str, stream: &str, head: &str) -> Sharing {
        Sharing {
            url: url.to_string(),
            stream: stream.to_string(),
            head: head.to_string(),
            max_age: Duration::from_secs(24 * 3600),
            max_bytes: 1 << 30,
            buffer_events: DEFAULT_BUFFER_EVENTS,
            publish_timeout: Duration::from_secs(5),
        }
    }

    /// How long the stream keeps an event (a stream that exists keeps its own setting). A head
    /// whose position is older must start from a copy of another head's file.
    pub fn max_age(mut self, age: Duration) -> Sharing {
        self.max_age = age;
        self
    }

    /// Most bytes the stream keeps (a stream that exists keeps its own setting).
    pub fn max_bytes(mut self, bytes: u64) -> Sharing {
        self.max_bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self
    }

    /// Most events buffered while the server is unreachable (at least 1); past it the oldest
    /// are dropped, and counted in [`crate::ShareStats::dropped`].
    pub fn buffer_events(mut self, events: usize) -> Sharing {
        self.buffer_events = events.max(1);
        self
    }

    /// How long [`crate::SharedWarm::sync`] waits for the head's events to be in the stream.
    pub fn publish_timeout(mut self, timeout: Duration) -> Sharing {
        self.publish_timeout = timeout;
        self
    }

    /// The subject events are published on.
    pub(crate) fn subject(&self) -> String {
        format!("{}.events", self.stream)
    }

    /// The head's durable consumer.
    pub(crate) fn consumer(&self) -> String {
        format!("warm-{}", self.head)
    }

    /// # Errors
    /// [`Error::Sharing`] for a server URL that is not one NATS server's, or a stream or head
    /// name NATS would refuse.
    pub(crate) fn validate(&self) -> Result<()> {
        check_url(&self.url)?;
        let token = |what: &str, s: &str| {
            let ok = !s.is_empty()
                && s.len() <= 200
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if ok {
                Ok(())
            } else {
                Err(Error::Sharing {
                    detail: format!("the {what} name {s:?} must be 1 to 200 ASCII letters, digits, '-' or '_'"),
                    source: None,
                })
            }
        };
        token("stream", &self.stream)?;
        token("head", &self.head)
    }
}

/// What a server URL looks like, for the errors that refuse one.
const URL_FORM: &str =
    "give one NATS server as nats://host:port, e.g. nats://127.0.0.1:4222 (or tls://, ws://, wss://)";

/// Refuses a server URL the client would take for something else or could never connect to: the
/// scheme is required (async-nats would read "garbage" as the host `garbage`), and so is a host.
///
/// # Errors
/// [`Error::Sharing`] naming the URL and what a valid one looks like.
fn check_url(url: &str) -> Result<()> {
    let refuse = |why: String, source: Option<std::io::Error>| Error::Sharing {
        detail: format!("the server URL {url:?} {why}: {URL_FORM}"),
        source: source.map(|e| Arc::new(e) as Arc<dyn std::error::Error + Send + Sync>),
    };
    if !url.contains("://") {
        return Err(refuse("has no scheme".into(), None));
    }
    let addr: ServerAddr = url.parse().map_err(|e| refuse("is not a NATS server URL".into(), Some(e)))?;
    if addr.host().is_empty() {
        return Err(refuse("names no host".into(), None));
    }
    Ok(())
}
