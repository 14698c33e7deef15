//! `Load`: what an engine is busy with, as the head that sends it requests sees it.

/// An engine's load, as the head sees it: what it sent and has not seen finish.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Load {
    /// Requests sent and not finished (prefilling, queued or decoding).
    pub in_flight: u32,
    /// Prompt tokens of those requests whose first token has not come back, less what the
    /// head predicted the engine held of them (a head may also take off what it estimates the
    /// engine has done of the oldest): the prefill work queued ahead of a new request.
    pub prefill_tokens: u64,
    /// Requests past their first token and still generating.
    pub decoding: u32,
}

impl Load {
    /// A load of `in_flight` requests, `prefill_tokens` uncached prompt tokens not yet
    /// prefilled, and `decoding` streams generating.
    pub fn new(in_flight: u32, prefill_tokens: u64, decoding: u32) -> Load {
        Load { in_flight, prefill_tokens, decoding }
    }
}
