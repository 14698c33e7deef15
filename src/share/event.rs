//! The events heads share: a `ran`, a forget or a node's cache size, with where it came from. Encoded by the one
//! codec module (bincode, like the cold records); see `docs/design.md`, "Shared events".

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::keys::BlockKey;
use crate::store::codec;

/// The version of the event encoding; an event of another version is skipped by every head.
pub(crate) const EVENT_VERSION: u32 = 1;

/// Largest event accepted (a prompt of 2^16 blocks is 1 MiB of keys).
pub(crate) const MAX_EVENT_BYTES: usize = 2 << 20;

/// One shared change.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Event {
    pub version: u32,
    pub origin: Origin,
    pub what: What,
}

/// Which head made an event: its name, which run of its process (`boot`), the event's number
/// in that run, and when (ns since the Unix epoch, the head's clock: for the lag only).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Origin {
    pub head: String,
    pub boot: u64,
    pub local: u64,
    pub at_unix_ns: u64,
}

/// What changed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) enum What {
    /// `node` ran a prompt whose block keys are `keys`, in a namespace (model, whether it is a
    /// tenant's, public id), hashed in scheme `scheme`.
    Ran { model: String, tenant: bool, namespace: [u8; 8], scheme: String, node: String, keys: Vec<BlockKey> },
    /// `forget_node(node)`.
    Forget { node: String },
    /// `set_node_capacity(node, blocks)`: the size of that name's KV cache, in blocks (`None`:
    /// the head's default). Last, so that a head of an earlier build skips only these (it cannot
    /// decode them) and counts them.
    Capacity { node: String, blocks: Option<u64> },
}

impl Event {
    /// # Errors
    /// [`crate::Error::Codec`].
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        codec::encode("shared event", self)
    }

    /// `None` for bytes that are not a whole event of this version (or too many).
    pub(crate) fn decode(bytes: &[u8]) -> Option<Event> {
        if bytes.len() > MAX_EVENT_BYTES {
            return None;
        }
        codec::decode::<Event>("shared event", bytes).ok().filter(|e| e.version == EVENT_VERSION)
    }

    /// The header that makes a retried publish stored once (`Nats-Msg-Id`).
    pub(crate) fn message_id(&self) -> String {
        format!("{}.{:016x}.{}", self.origin.head, self.origin.boot, self.origin.local)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    fn ran() -> Event {
        Event {
            version: EVENT_VERSION,
            origin: Origin { head: "a".into(), boot: 7, local: 3, at_unix_ns: 11 },
            what: What::Ran {
                model: "m".into(),
                tenant: false,
                namespace: [1; 8],
                scheme: "s".into(),
                node: "n".into(),
                keys: vec![[2; 16], [3; 16]],
            },
        }
    }

    #[test]
    fn an_event_comes_back_as_it_went_and_garbage_is_refused() -> Result<()> {
        let bytes = ran().encode()?;
        assert_eq!(Event::decode(&bytes), Some(ran()));
        assert_eq!(Event::decode(&bytes[..bytes.len() - 1]), None, "a cut event");
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Event::decode(&longer), None, "trailing bytes");
        let mut other = ran();
        other.version = EVENT_VERSION + 1;
        assert_eq!(Event::decode(&other.encode()?), None, "another version");
        assert_eq!(Event::decode(&vec![0xff; MAX_EVENT_BYTES + 1]), None);
        assert_eq!(ran().message_id(), "a.0000000000000007.3");
        Ok(())
    }

    /// The events of 0.6.0, which had no `Capacity`.
    #[derive(Debug, Deserialize, PartialEq, Eq)]
    struct EarlierEvent {
        version: u32,
        origin: Origin,
        what: EarlierWhat,
    }

    #[derive(Debug, Deserialize, PartialEq, Eq)]
    enum EarlierWhat {
        Ran { model: String, tenant: bool, namespace: [u8; 8], scheme: String, node: String, keys: Vec<BlockKey> },
        Forget { node: String },
    }

    #[test]
    fn a_cache_size_event_comes_back_and_a_head_of_the_earlier_build_skips_only_it() -> Result<()> {
        let mut sized = ran();
        sized.what = What::Capacity { node: "n".into(), blocks: Some(4096) };
        let bytes = sized.encode()?;
        assert_eq!(Event::decode(&bytes), Some(sized.clone()));
        let earlier = |e: &Event| e.encode().and_then(|b| codec::decode::<EarlierEvent>("earlier event", &b));
        assert!(earlier(&sized).is_err(), "the earlier build cannot decode it, and skips it");
        let mut forget = ran();
        forget.what = What::Forget { node: "n".into() };
        let got = earlier(&forget)?;
        assert_eq!(
            (got.version, got.origin, got.what),
            (EVENT_VERSION, forget.origin, EarlierWhat::Forget { node: "n".into() })
        );
        assert!(
            matches!(earlier(&ran())?.what, EarlierWhat::Ran { ref node, ref keys, .. } if node == "n" && keys.len() == 2)
        );
        Ok(())
    }
}
