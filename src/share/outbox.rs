//! Events a head made and the stream has not yet acknowledged: bounded, oldest first.

use std::collections::VecDeque;

/// One event to publish.
#[derive(Clone)]
pub(crate) struct Out {
    pub local: u64,
    /// `Nats-Msg-Id`: a retried publish is stored once.
    pub id: String,
    pub payload: Vec<u8>,
}

/// The bounded queue of events to publish.
pub(crate) struct Outbox {
    queue: VecDeque<Out>,
    bound: usize,
    /// Events dropped because the queue was full (the server was unreachable too long).
    pub dropped: u64,
    /// Events the stream acknowledged.
    pub published: u64,
}

impl Outbox {
    pub(crate) fn new(bound: usize) -> Outbox {
        Outbox { queue: VecDeque::new(), bound: bound.max(1), dropped: 0, published: 0 }
    }

    /// Queues `out`; returns the local number of the event dropped to make room, if any.
    pub(crate) fn push(&mut self, out: Out) -> Option<u64> {
        let dropped = if self.queue.len() >= self.bound {
            self.dropped += 1;
            self.queue.pop_front().map(|o| o.local)
        } else {
            None
        };
        self.queue.push_back(out);
        dropped
    }

    /// The oldest `n` events, to publish (they stay until acknowledged).
    pub(crate) fn peek(&self, n: usize) -> Vec<Out> {
        self.queue.iter().take(n).cloned().collect()
    }

    /// The stream acknowledged event `local`.
    pub(crate) fn acked(&mut self, local: u64) {
        if let Some(i) = self.queue.iter().position(|o| o.local == local) {
            self.queue.remove(i);
            self.published += 1;
        }
    }

    /// Events numbered up to `local` still to publish.
    pub(crate) fn count_through(&self, local: u64) -> u64 {
        self.queue.iter().take_while(|o| o.local <= local).count() as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    fn out(local: u64) -> Out {
        Out { local, id: local.to_string(), payload: vec![] }
    }

    #[test]
    fn a_full_outbox_drops_its_oldest_and_counts_it() {
        let mut o = Outbox::new(2);
        assert_eq!(o.push(out(1)), None);
        assert_eq!(o.push(out(2)), None);
        assert_eq!(o.push(out(3)), Some(1));
        assert_eq!(o.peek(5).iter().map(|o| o.local).collect::<Vec<_>>(), vec![2, 3]);
        o.acked(3);
        o.acked(3);
        assert_eq!((o.len(), o.published, o.dropped), (1, 1, 1));
        assert_eq!((o.count_through(1), o.count_through(2), o.count_through(9)), (0, 1, 1));
    }
}
