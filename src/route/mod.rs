//! Where a request goes (`serve`, `/v1/route`, or a head of the caller's own): per engine, the
//! prompt tokens it would not have to prefill and the work already queued on it, in one cost.
//! Knows no storage and no HTTP: the warm tokens come from the index's answer ([`crate::Hit`]),
//! the load from whoever counts requests.

pub(crate) mod choice;
pub(crate) mod load;
pub(crate) mod tally;
