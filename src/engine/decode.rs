//! Decoding of one KV event batch, the msgpack payload (third frame) that vLLM and SGLang
//! publish over ZMQ.
//!
//! A batch is the array `[ts, events, dp_rank]` (`dp_rank` may be missing in old senders). Each
//! event is either a map with a `"type"` key (vLLM since the array form was dropped, SGLang since
//! it followed) or the older tagged array `["BlockStored", block_hashes, parent_block_hash,
//! token_ids, block_size, lora_id, medium, lora_name, extra_keys, ...]` whose trailing defaults are
//! left out. Both forms are read; unknown map keys, extra array positions and unknown event types
//! are skipped, since engines add fields and events in minor releases.
//!
//! The decoder walks the bytes once (twice over a map event, to find its `"type"` wherever it
//! sits) without building a value tree. It never panics on any input, bounds the nesting depth
//! it follows (so no recursion or stack grows with the input) and never reserves room for more
//! elements than the remaining bytes could hold, whatever length a header declares.

use std::fmt;

use rmp::Marker;

/// Deepest nesting followed: the batch, its events list, an event, `extra_keys`, one block's
/// tuple and a multimodal pair need 6; the rest is room for fields added by future engines.
const MAX_DEPTH: usize = 32;

/// Shortest and longest byte-string block hash accepted (an xxh3-128 digest is 16 bytes, a
/// SHA-256 one 32).
const HASH_BYTES: std::ops::RangeInclusive<usize> = 8..=64;

/// One decoded batch: what an engine's scheduler step produced.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Batch {
    /// Wall-clock seconds at publish time (the engine's `time.time()`).
    pub ts: f64,
    /// The events of this build's known types, in the order sent.
    pub events: Vec<Event>,
    /// The data-parallel (or SGLang attention-DP) rank; `None` when the sender left it out or
    /// sent nil.
    pub dp_rank: Option<i64>,
    /// Events of a type this build does not know, skipped.
    pub unknown: usize,
}

/// One KV cache event of a known type.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Event {
    /// Blocks became full and were cached (`BlockStored`).
    Stored {
        /// The engine's block hashes, one per block, in prefix order.
        hashes: Vec<u64>,
        /// Hash of the cached block just before the first one; `None` when the run starts at
        /// block 0.
        parent: Option<u64>,
        /// The tokens of all the blocks, `hashes.len() * block_size` for a GPU store.
        tokens: Vec<u32>,
        /// Tokens per block as the engine counts them (not always `--block-size`).
        block_size: u32,
        /// Where the blocks live (`"GPU"`, `"CPU"`, `"STORAGE"`), if the engine said.
        medium: Option<String>,
        /// Deprecated LoRA adapter id.
        lora_id: Option<i64>,
        /// LoRA adapter name.
        lora_name: Option<String>,
        /// Per block, the extra keys that went into its hash (`None` for a plain text block);
        /// empty when the engine sent none.
        extra_keys: Vec<Option<Vec<Extra>>>,
        /// The KV cache group (`group_idx`), its kind (`kv_cache_spec_kind`) and sliding window
        /// (`kv_cache_spec_sliding_window`), if the engine said.
        group: GroupFields,
        /// `locality`: `"LOCAL"` or `"REMOTE"` relative to the publisher, if the engine said.
        locality: Option<String>,
        /// Whether some block's hash covers tokens past its end (`lookahead_token_ids` with a
        /// token in it).
        lookahead: bool,
    },
    /// Cached blocks were evicted (`BlockRemoved`).
    Removed {
        /// The engine's block hashes.
        hashes: Vec<u64>,
        /// Where the blocks lived, if the engine said.
        medium: Option<String>,
        /// The KV cache group they left (`group_idx`), if the engine said.
        group: Option<u32>,
        /// `locality`, if the engine said.
        locality: Option<String>,
    },
    /// The engine dropped its whole prefix cache (`AllBlocksCleared`).
    Cleared,
}

/// One item of a block's extra keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Extra {
    /// A string: a LoRA name, a cache salt, a multimodal identifier.
    Text(String),
    /// A byte string, such as a prompt-embeds digest.
    Bytes(Vec<u8>),
    /// Anything else (a multimodal `(identifier, offset)` tuple, a number), skipped.
    Other,
}

/// Why a payload could not be decoded, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DecodeError {
    /// Byte offset in the payload where the problem was found.
    pub offset: usize,
    /// What was wrong.
    pub kind: DecodeErrorKind,
}

/// What was wrong with a payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum DecodeErrorKind {
    /// The payload ends inside a value.
    Truncated,
    /// The byte 0xc1, which msgpack never uses.
    ReservedMarker,
    /// A value of the wrong msgpack type.
    Unexpected {
        /// The field or part being read.
        what: &'static str,
        /// The type it should have.
        expected: &'static str,
        /// The type found.
        found: &'static str,
    },
    /// A number outside the range of its field.
    OutOfRange {
        /// The field being read.
        what: &'static str,
    },
    /// A byte-string hash shorter or longer than any digest.
    HashLength {
        /// Its length in bytes.
        len: usize,
    },
    /// A string that is not UTF-8.
    InvalidUtf8 {
        /// The field being read.
        what: &'static str,
    },
    /// A required field is absent.
    Missing {
        /// The field.
        what: &'static str,
    },
    /// Arrays and maps nested deeper than the decoder follows.
    TooDeep,
    /// Bytes left over after the batch.
    TrailingBytes {
        /// How many.
        count: usize,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid KV event batch at byte {}: ", self.offset)?;
        match &self.kind {
            DecodeErrorKind::Truncated => write!(f, "the payload ends inside a value"),
            DecodeErrorKind::ReservedMarker => write!(f, "reserved msgpack marker 0xc1"),
            DecodeErrorKind::Unexpected { what, expected, found } => {
                write!(f, "{what}: expected {expected}, found {found}")
            }
            DecodeErrorKind::OutOfRange { what } => write!(f, "{what}: number out of range"),
            DecodeErrorKind::HashLength { len } => {
                write!(f, "block hash of {len} bytes (expected {} to {})", HASH_BYTES.start(), HASH_BYTES.end())
            }
            DecodeErrorKind::InvalidUtf8 { what } => write!(f, "{what}: string is not UTF-8"),
            DecodeErrorKind::Missing { what } => write!(f, "{what} is missing"),
            DecodeErrorKind::TooDeep => write!(f, "nested deeper than {MAX_DEPTH} levels"),
            DecodeErrorKind::TrailingBytes { count } => write!(f, "{count} bytes after the batch"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// Decodes one payload frame into a [`Batch`].
///
/// # Errors
/// A [`DecodeError`] when the payload is not a well-formed batch: truncated or trailing bytes,
/// wrong types, hashes or token ids out of range, missing required fields, or nesting deeper than
/// [`MAX_DEPTH`]. A batch is taken whole or not at all.
pub(crate) fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut r = WireCursor { buf: payload, pos: 0 };
    let start = r.pos;
    let len = match r.head()? {
        Head::Array(n) => n,
        other => return Err(r.unexpected_at(start, "batch", "array", &other)),
    };
    if len < 2 {
        return Err(r.error(DecodeErrorKind::Missing { what: "batch events" }));
    }
    let ts = r.f64("batch ts")?;
    let count = r.array_len("batch events", false)?;
    let mut events = Vec::with_capacity(r.capacity(count, 1));
    let mut unknown = 0;
    for _ in 0..count {
        match r.event()? {
            Some(event) => events.push(event),
            None => unknown += 1,
        }
    }
    let dp_rank = if len >= 3 { r.opt_i64("batch dp_rank")? } else { None };
    for _ in 3..len {
        r.skip(2)?;
    }
    if r.remaining() > 0 {
        return Err(r.error(DecodeErrorKind::TrailingBytes { count: r.remaining() }));
    }
    Ok(Batch { ts, events, dp_rank, unknown })
}

/// A msgpack value's header: scalars whole, strings and byte strings as borrowed slices,
/// arrays and maps as their declared length (their contents follow in the input).
#[derive(Debug)]
enum Head<'a> {
    /// nil.
    Nil,
    /// true or false.
    Bool,
    /// A non-negative integer.
    Uint(u64),
    /// A negative integer.
    Neg(i64),
    /// A float32 or float64, widened.
    Float(f64),
    /// A string's bytes (not yet checked for UTF-8).
    Str(&'a [u8]),
    /// A byte string.
    Bin(&'a [u8]),
    /// An extension value (type and data are of no use here).
    Ext,
    /// An array of this many values.
    Array(u32),
    /// A map of this many key-value pairs.
    Map(u32),
}

impl Head<'_> {
    /// The msgpack type's name, for error messages.
    fn name(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool => "bool",
            Head::Uint(_) => "unsigned int",
            Head::Neg(_) => "negative int",
            Head::Float(_) => "float",
            Head::Str(_) => "string",
            Head::Bin(_) => "bin",
            Head::Ext => "ext",
            Head::Array(_) => "array",
            Head::Map(_) => "map",
        }
    }
}

/// The fields of a `BlockStored` as they are found, in either form.
#[derive(Default)]
struct StoredFields {
    /// `block_hashes`.
    hashes: Option<Vec<u64>>,
    /// `parent_block_hash`.
    parent: Option<u64>,
    /// `token_ids`.
    tokens: Option<Vec<u32>>,
    /// `block_size`.
    block_size: Option<u32>,
    /// `medium`.
    medium: Option<String>,
    /// `lora_id`.
    lora_id: Option<i64>,
    /// `lora_name`.
    lora_name: Option<String>,
    /// `extra_keys`.
    extra_keys: Vec<Option<Vec<Extra>>>,
    /// `group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`.
    group: GroupFields,
    /// `locality`.
    locality: Option<String>,
    /// `lookahead_token_ids` (whether any token).
    lookahead: bool,
}

/// A store's KV cache group fields, as sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GroupFields {
    /// `group_idx`.
    pub index: Option<u32>,
    /// `kv_cache_spec_kind` (`"full_attention"`, `"sliding_window"`, `"mamba"`, ...).
    pub kind: Option<String>,
    /// `kv_cache_spec_sliding_window`, in tokens.
    pub window: Option<u32>,
}

/// The known event types, from the tag.
#[derive(Clone, Copy)]
enum Kind {
    /// `BlockStored`.
    Stored,
    /// `BlockRemoved`.
    Removed,
    /// `AllBlocksCleared`.
    Cleared,
}

impl Kind {
    /// The type for a tag, `None` for one this build does not know.
    fn from_tag(tag: &[u8]) -> Option<Kind> {
        match tag {
            b"BlockStored" => Some(Kind::Stored),
            b"BlockRemoved" => Some(Kind::Removed),
            b"AllBlocksCleared" => Some(Kind::Cleared),
            _ => None,
        }
    }
}

/// Depth of an event's own array or map (batch 1, events list 2).
const EVENT_DEPTH: usize = 3;

/// A cursor over the payload.
struct WireCursor<'a> {
    /// The whole payload.
    buf: &'a [u8],
    /// Offset of the next unread byte.
    pos: usize,
}

impl<'a> WireCursor<'a> {
    /// Bytes not read yet.
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// An error at the current position.
    fn error(&self, kind: DecodeErrorKind) -> DecodeError {
        DecodeError { offset: self.pos, kind }
    }

    /// A wrong-type error for the value whose header started at `offset`.
    fn unexpected_at(
        &self,
        offset: usize,
        what: &'static str,
        expected: &'static str,
        found: &Head<'_>,
    ) -> DecodeError {
        DecodeError { offset, kind: DecodeErrorKind::Unexpected { what, expected, found: found.name() } }
    }

    /// How many of `declared` elements to reserve room for: no more than the remaining bytes
    /// could hold at `min_bytes` each, so a lying length header allocates nothing extra.
    fn capacity(&self, declared: u32, min_bytes: usize) -> usize {
        let fit = self.remaining() / min_bytes.max(1);
        usize::try_from(declared).map_or(fit, |n| n.min(fit))
    }

    /// The next `n` bytes.
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.error(DecodeErrorKind::Truncated))?;
        let bytes = self.buf.get(self.pos..end).ok_or_else(|| self.error(DecodeErrorKind::Truncated))?;
        self.pos = end;
        Ok(bytes)
    }

    /// The next `N` bytes as an array.
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let at = self.pos;
        <[u8; N]>::try_from(self.take(N)?).map_err(|_| DecodeError { offset: at, kind: DecodeErrorKind::Truncated })
    }

    /// A big-endian length of `N` bytes (1, 2 or 4).
    fn len<const N: usize>(&mut self) -> Result<u32, DecodeError> {
        let bytes = self.array::<N>()?;
        Ok(bytes.iter().fold(0u32, |acc, &b| (acc << 8) | u32::from(b)))
    }

    /// The next `n` bytes, `n` as read from a length header.
    fn take_u32(&mut self, n: u32) -> Result<&'a [u8], DecodeError> {
        let n = usize::try_from(n).map_err(|_| self.error(DecodeErrorKind::Truncated))?;
        self.take(n)
    }

    /// Reads one value's header (see [`Head`]).
    fn head(&mut self) -> Result<Head<'a>, DecodeError> {
        let [byte] = self.array::<1>()?;
        Ok(match Marker::from_u8(byte) {
            Marker::FixPos(v) => Head::Uint(u64::from(v)),
            Marker::FixNeg(v) => Head::Neg(i64::from(v)),
            Marker::Null => Head::Nil,
            Marker::True | Marker::False => Head::Bool,
            Marker::U8 => Head::Uint(u64::from(u8::from_be_bytes(self.array()?))),
            Marker::U16 => Head::Uint(u64::from(u16::from_be_bytes(self.array()?))),
            Marker::U32 => Head::Uint(u64::from(u32::from_be_bytes(self.array()?))),
            Marker::U64 => Head::Uint(u64::from_be_bytes(self.array()?)),
            Marker::I8 => Self::int(i64::from(i8::from_be_bytes(self.array()?))),
            Marker::I16 => Self::int(i64::from(i16::from_be_bytes(self.array()?))),
            Marker::I32 => Self::int(i64::from(i32::from_be_bytes(self.array()?))),
            Marker::I64 => Self::int(i64::from_be_bytes(self.array()?)),
            Marker::F32 => Head::Float(f64::from(f32::from_be_bytes(self.array()?))),
            Marker::F64 => Head::Float(f64::from_be_bytes(self.array()?)),
            Marker::FixStr(n) => Head::Str(self.take(usize::from(n))?),
            Marker::Str8 => {
                let n = self.len::<1>()?;
                Head::Str(self.take_u32(n)?)
            }
            Marker::Str16 => {
                let n = self.len::<2>()?;
                Head::Str(self.take_u32(n)?)
            }
            Marker::Str32 => {
                let n = self.len::<4>()?;
                Head::Str(self.take_u32(n)?)
            }
            Marker::Bin8 => {
                let n = self.len::<1>()?;
                Head::Bin(self.take_u32(n)?)
            }
            Marker::Bin16 => {
                let n = self.len::<2>()?;
                Head::Bin(self.take_u32(n)?)
            }
            Marker::Bin32 => {
                let n = self.len::<4>()?;
                Head::Bin(self.take_u32(n)?)
            }
            Marker::FixArray(n) => Head::Array(u32::from(n)),
            Marker::Array16 => Head::Array(self.len::<2>()?),
            Marker::Array32 => Head::Array(self.len::<4>()?),
            Marker::FixMap(n) => Head::Map(u32::from(n)),
            Marker::Map16 => Head::Map(self.len::<2>()?),
            Marker::Map32 => Head::Map(self.len::<4>()?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.len::<1>()?;
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = self.len::<2>()?;
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.len::<4>()?;
                self.ext(n)?
            }
            Marker::Reserved => {
                self.pos = self.pos.saturating_sub(1);
                return Err(self.error(DecodeErrorKind::ReservedMarker));
            }
        })
    }

    /// A signed msgpack int: senders may use a signed type for a non-negative value.
    fn int(v: i64) -> Head<'a> {
        u64::try_from(v).map_or(Head::Neg(v), Head::Uint)
    }

    /// Skips an extension value's type byte and `n` data bytes.
    fn ext(&mut self, n: u32) -> Result<Head<'a>, DecodeError> {
        self.take(1)?;
        self.take_u32(n)?;
        Ok(Head::Ext)
    }

    /// Skips one whole value sitting at nesting depth `depth`.
    fn skip(&mut self, depth: usize) -> Result<(), DecodeError> {
        let head = self.head()?;
        self.skip_contents(&head, depth)
    }

    /// Skips the contents of a value whose header was just read, at nesting depth `depth`.
    /// Iterative: a stack of "values left" per open level, bounded by [`MAX_DEPTH`].
    fn skip_contents(&mut self, head: &Head<'_>, depth: usize) -> Result<(), DecodeError> {
        let first = match *head {
            Head::Array(n) => u64::from(n),
            Head::Map(n) => 2 * u64::from(n),
            _ => return Ok(()),
        };
        if first == 0 {
            return Ok(());
        }
        if depth >= MAX_DEPTH {
            return Err(self.error(DecodeErrorKind::TooDeep));
        }
        let mut open: Vec<u64> = Vec::with_capacity(MAX_DEPTH.saturating_sub(depth));
        let mut left = first;
        loop {
            if left == 0 {
                match open.pop() {
                    Some(outer) => {
                        left = outer;
                        continue;
                    }
                    None => return Ok(()),
                }
            }
            left -= 1;
            let inner = match self.head()? {
                Head::Array(n) => u64::from(n),
                Head::Map(n) => 2 * u64::from(n),
                _ => continue,
            };
            if inner > 0 {
                if depth + open.len() + 1 >= MAX_DEPTH {
                    return Err(self.error(DecodeErrorKind::TooDeep));
                }
                open.push(left);
                left = inner;
            }
        }
    }

    /// An array's length; nil reads as empty when `nil_is_empty`.
    fn array_len(&mut self, what: &'static str, nil_is_empty: bool) -> Result<u32, DecodeError> {
        let at = self.pos;
        match self.head()? {
            Head::Array(n) => Ok(n),
            Head::Nil if nil_is_empty => Ok(0),
            other => Err(self.unexpected_at(at, what, "array", &other)),
        }
    }

    /// A float (or an integer, read as a float).
    fn f64(&mut self, what: &'static str) -> Result<f64, DecodeError> {
        let at = self.pos;
        match self.head()? {
            Head::Float(v) => Ok(v),
            Head::Uint(v) => Ok(v as f64),
            Head::Neg(v) => Ok(v as f64),
            other => Err(self.unexpected_at(at, what, "float", &other)),
        }
    }

    /// A signed integer or nil.
    fn opt_i64(&mut self, what: &'static str) -> Result<Option<i64>, DecodeError> {
        let at = self.pos;
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Neg(v) => Ok(Some(v)),
            Head::Uint(v) => i64::try_from(v)
                .map(Some)
                .map_err(|_| DecodeError { offset: at, kind: DecodeErrorKind::OutOfRange { what } }),
            other => Err(self.unexpected_at(at, what, "int or nil", &other)),
        }
    }

    /// An unsigned integer that fits a `u32`.
    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let at = self.pos;
        match self.head()? {
            Head::Uint(v) => {
                u32::try_from(v).map_err(|_| DecodeError { offset: at, kind: DecodeErrorKind::OutOfRange { what } })
            }
            Head::Neg(_) => Err(DecodeError { offset: at, kind: DecodeErrorKind::OutOfRange { what } }),
            other => Err(self.unexpected_at(at, what, "unsigned int", &other)),
        }
    }

    /// An unsigned integer that fits a `u32`, or nil.
    fn opt_u32(&mut self, what: &'static str) -> Result<Option<u32>, DecodeError> {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Ok(None);
        }
        self.u32(what).map(Some)
    }

    /// `lookahead_token_ids` (nil, or one list of token ids per block): whether it holds a
    /// token.
    fn lookahead(&mut self) -> Result<bool, DecodeError> {
        let n = self.array_len("lookahead_token_ids", true)?;
        let mut any = false;
        for _ in 0..n {
            let tokens = self.array_len("lookahead_token_ids", true)?;
            for _ in 0..tokens {
                self.u32("lookahead token id")?;
                any = true;
            }
        }
        Ok(any)
    }

    /// A string or nil.
    fn opt_string(&mut self, what: &'static str) -> Result<Option<String>, DecodeError> {
        let at = self.pos;
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Str(bytes) => utf8(bytes, at, what).map(Some),
            other => Err(self.unexpected_at(at, what, "string or nil", &other)),
        }
    }

    /// A block hash: an unsigned int (vLLM), a negative int (SGLang's signed i64, kept as the
    /// same 64 bits) or a digest as bytes (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`),
    /// folded to the integer vLLM would otherwise have sent: `int.from_bytes(digest, "big")`
    /// masked to 64 bits, i.e. the last 8 bytes read big-endian.
    fn hash(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let at = self.pos;
        match self.head()? {
            Head::Uint(v) => Ok(v),
            Head::Neg(v) => Ok(u64::from_ne_bytes(v.to_ne_bytes())),
            Head::Bin(bytes) => fold_digest(bytes)
                .ok_or(DecodeError { offset: at, kind: DecodeErrorKind::HashLength { len: bytes.len() } }),
            other => Err(self.unexpected_at(at, what, "int or bin", &other)),
        }
    }

    /// A block hash or nil.
    fn opt_hash(&mut self, what: &'static str) -> Result<Option<u64>, DecodeError> {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Ok(None);
        }
        self.hash(what).map(Some)
    }

    /// A list of block hashes (nil reads as empty).
    fn hashes(&mut self, what: &'static str) -> Result<Vec<u64>, DecodeError> {
        let n = self.array_len(what, true)?;
        let mut out = Vec::with_capacity(self.capacity(n, 1));
        for _ in 0..n {
            out.push(self.hash(what)?);
        }
        Ok(out)
    }

    /// A list of token ids, each fitting a `u32` (nil reads as empty).
    fn tokens(&mut self) -> Result<Vec<u32>, DecodeError> {
        let n = self.array_len("token_ids", true)?;
        let mut out = Vec::with_capacity(self.capacity(n, 1));
        for _ in 0..n {
            out.push(self.u32("token id")?);
        }
        Ok(out)
    }

    /// `extra_keys`, a field value at nesting depth `depth`: nil, or one entry per block, each
    /// nil or a tuple of items. A block entry that is a single item instead of a tuple is read
    /// as a one-item tuple.
    fn extra_keys(&mut self, depth: usize) -> Result<Vec<Option<Vec<Extra>>>, DecodeError> {
        let n = self.array_len("extra_keys", true)?;
        let mut out = Vec::with_capacity(self.capacity(n, 1));
        for _ in 0..n {
            let at = self.pos;
            let entry = match self.head()? {
                Head::Nil => None,
                Head::Array(items) => {
                    let mut list = Vec::with_capacity(self.capacity(items, 1));
                    for _ in 0..items {
                        let item_at = self.pos;
                        let head = self.head()?;
                        list.push(self.extra(head, item_at, depth + 2)?);
                    }
                    Some(list)
                }
                other => Some(vec![self.extra(other, at, depth + 1)?]),
            };
            out.push(entry);
        }
        Ok(out)
    }

    /// One extra-key item from its header, read at byte `at` and nesting depth `depth` (its
    /// contents skipped unless it is text or bytes).
    fn extra(&mut self, head: Head<'a>, at: usize, depth: usize) -> Result<Extra, DecodeError> {
        Ok(match head {
            Head::Str(bytes) => Extra::Text(utf8(bytes, at, "extra key")?),
            Head::Bin(bytes) => Extra::Bytes(bytes.to_vec()),
            other => {
                self.skip_contents(&other, depth)?;
                Extra::Other
            }
        })
    }

    /// One event; `None` for an event of an unknown type (skipped).
    fn event(&mut self) -> Result<Option<Event>, DecodeError> {
        let at = self.pos;
        match self.head()? {
            Head::Map(n) => self.event_map(n),
            Head::Array(n) => self.event_array(n, at),
            other => Err(self.unexpected_at(at, "event", "map or array", &other)),
        }
    }

    /// A map-form event of `n` pairs: finds `"type"` first, wherever it is, then reads the
    /// fields that type knows and skips the rest.
    fn event_map(&mut self, n: u32) -> Result<Option<Event>, DecodeError> {
        let fields_at = self.pos;
        let mut kind = None;
        let mut tagged = false;
        for _ in 0..n {
            let key = self.head()?;
            if matches!(key, Head::Str(b"type")) {
                let at = self.pos;
                match self.head()? {
                    Head::Str(tag) => {
                        kind = Kind::from_tag(tag);
                        tagged = true;
                    }
                    other => return Err(self.unexpected_at(at, "event type", "string", &other)),
                }
            } else {
                self.skip_contents(&key, EVENT_DEPTH + 1)?;
                self.skip(EVENT_DEPTH + 1)?;
            }
        }
        if !tagged {
            return Err(self.error(DecodeErrorKind::Missing { what: "event type" }));
        }
        let Some(kind) = kind else { return Ok(None) };
        self.pos = fields_at;
        let mut stored = StoredFields::default();
        let mut removed_hashes = None;
        for _ in 0..n {
            let key = self.head()?;
            let Head::Str(name) = key else {
                self.skip_contents(&key, EVENT_DEPTH + 1)?;
                self.skip(EVENT_DEPTH + 1)?;
                continue;
            };
            match (kind, name) {
                (Kind::Stored, b"block_hashes") => stored.hashes = Some(self.hashes("block_hashes")?),
                (Kind::Stored, b"parent_block_hash") => stored.parent = self.opt_hash("parent_block_hash")?,
                (Kind::Stored, b"token_ids") => stored.tokens = Some(self.tokens()?),
                (Kind::Stored, b"block_size") => stored.block_size = Some(self.u32("block_size")?),
                (Kind::Stored, b"lora_id") => stored.lora_id = self.opt_i64("lora_id")?,
                (Kind::Stored, b"lora_name") => stored.lora_name = self.opt_string("lora_name")?,
                (Kind::Stored, b"extra_keys") => stored.extra_keys = self.extra_keys(EVENT_DEPTH + 1)?,
                (Kind::Stored, b"kv_cache_spec_kind") => stored.group.kind = self.opt_string("kv_cache_spec_kind")?,
                (Kind::Stored, b"kv_cache_spec_sliding_window") => {
                    stored.group.window = self.opt_u32("kv_cache_spec_sliding_window")?
                }
                (Kind::Stored, b"lookahead_token_ids") => stored.lookahead = self.lookahead()?,
                (Kind::Stored | Kind::Removed, b"medium") => stored.medium = self.opt_string("medium")?,
                (Kind::Stored | Kind::Removed, b"group_idx") => stored.group.index = self.opt_u32("group_idx")?,
                (Kind::Stored | Kind::Removed, b"locality") => stored.locality = self.opt_string("locality")?,
                (Kind::Removed, b"block_hashes") => removed_hashes = Some(self.hashes("block_hashes")?),
                _ => self.skip(EVENT_DEPTH + 1)?,
            }
        }
        self.finish(kind, stored, removed_hashes).map(Some)
    }

    /// An array-form event of `n` elements (the tag first), starting at byte `at`.
    fn event_array(&mut self, n: u32, at: usize) -> Result<Option<Event>, DecodeError> {
        if n == 0 {
            return Err(DecodeError { offset: at, kind: DecodeErrorKind::Missing { what: "event type" } });
        }
        let tag_at = self.pos;
        let kind = match self.head()? {
            Head::Str(tag) => Kind::from_tag(tag),
            other => return Err(self.unexpected_at(tag_at, "event type", "string", &other)),
        };
        let mut stored = StoredFields::default();
        let mut removed_hashes = None;
        // Positions after the tag, by the order of the fields in the engine's classes. The
        // array form ended before `locality` (vLLM sends maps since 0.26): later positions are
        // skipped as unknown.
        for index in 1..n {
            match (kind, index) {
                (Some(Kind::Stored), 1) => stored.hashes = Some(self.hashes("block_hashes")?),
                (Some(Kind::Stored), 2) => stored.parent = self.opt_hash("parent_block_hash")?,
                (Some(Kind::Stored), 3) => stored.tokens = Some(self.tokens()?),
                (Some(Kind::Stored), 4) => stored.block_size = Some(self.u32("block_size")?),
                (Some(Kind::Stored), 5) => stored.lora_id = self.opt_i64("lora_id")?,
                (Some(Kind::Stored), 6) => stored.medium = self.opt_string("medium")?,
                (Some(Kind::Stored), 7) => stored.lora_name = self.opt_string("lora_name")?,
                (Some(Kind::Stored), 8) => stored.extra_keys = self.extra_keys(EVENT_DEPTH + 1)?,
                (Some(Kind::Stored), 9) => stored.group.index = self.opt_u32("group_idx")?,
                (Some(Kind::Stored), 10) => stored.group.kind = self.opt_string("kv_cache_spec_kind")?,
                (Some(Kind::Stored), 11) => stored.group.window = self.opt_u32("kv_cache_spec_sliding_window")?,
                (Some(Kind::Removed), 1) => removed_hashes = Some(self.hashes("block_hashes")?),
                (Some(Kind::Removed), 2) => stored.medium = self.opt_string("medium")?,
                (Some(Kind::Removed), 3) => stored.group.index = self.opt_u32("group_idx")?,
                _ => self.skip(EVENT_DEPTH + 1)?,
            }
        }
        match kind {
            Some(kind) => self.finish(kind, stored, removed_hashes).map(Some),
            None => Ok(None),
        }
    }

    /// Builds the event from the fields found, refusing one without its required fields.
    fn finish(&self, kind: Kind, f: StoredFields, removed_hashes: Option<Vec<u64>>) -> Result<Event, DecodeError> {
        let missing = |what| self.error(DecodeErrorKind::Missing { what });
        Ok(match kind {
            Kind::Stored => Event::Stored {
                hashes: f.hashes.ok_or_else(|| missing("block_hashes"))?,
                parent: f.parent,
                tokens: f.tokens.ok_or_else(|| missing("token_ids"))?,
                block_size: f.block_size.ok_or_else(|| missing("block_size"))?,
                medium: f.medium,
                lora_id: f.lora_id,
                lora_name: f.lora_name,
                extra_keys: f.extra_keys,
                group: f.group,
                locality: f.locality,
                lookahead: f.lookahead,
            },
            Kind::Removed => Event::Removed {
                hashes: removed_hashes.ok_or_else(|| missing("block_hashes"))?,
                medium: f.medium,
                group: f.group.index,
                locality: f.locality,
            },
            Kind::Cleared => Event::Cleared,
        })
    }
}

/// The string in `bytes`, or an error naming `what` at byte `at`.
fn utf8(bytes: &[u8], at: usize, what: &'static str) -> Result<String, DecodeError> {
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .map_err(|_| DecodeError { offset: at, kind: DecodeErrorKind::InvalidUtf8 { what } })
}

/// The u64 vLLM sends for a digest in int mode (its last 8 bytes, big-endian), or `None` for
/// a length outside [`HASH_BYTES`].
fn fold_digest(digest: &[u8]) -> Option<u64> {
    if !HASH_BYTES.contains(&digest.len()) {
        return None;
    }
    let tail = digest.get(digest.len().checked_sub(8)?..)?;
    <[u8; 8]>::try_from(tail).ok().map(u64::from_be_bytes)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use std::path::{Path, PathBuf};

    use serde_json::Value;

    use super::*;

    /// A msgpack writer for hand-built payloads (rmp's encoder, the smallest widths unless a
    /// method says otherwise).
    #[derive(Default)]
    struct W(Vec<u8>);

    impl W {
        fn arr(&mut self, n: u32) -> &mut Self {
            rmp::encode::write_array_len(&mut self.0, n).expect("array header");
            self
        }
        fn map(&mut self, n: u32) -> &mut Self {
            rmp::encode::write_map_len(&mut self.0, n).expect("map header");
            self
        }
        fn str(&mut self, s: &str) -> &mut Self {
            rmp::encode::write_str(&mut self.0, s).expect("str");
            self
        }
        fn uint(&mut self, v: u64) -> &mut Self {
            rmp::encode::write_uint(&mut self.0, v).expect("uint");
            self
        }
        fn int(&mut self, v: i64) -> &mut Self {
            rmp::encode::write_sint(&mut self.0, v).expect("sint");
            self
        }
        /// Always the 9-byte int64 form (`d3`), as SGLang sends every hash.
        fn i64(&mut self, v: i64) -> &mut Self {
            rmp::encode::write_i64(&mut self.0, v).expect("i64");
            self
        }
        fn f64(&mut self, v: f64) -> &mut Self {
            rmp::encode::write_f64(&mut self.0, v).expect("f64");
            self
        }
        fn nil(&mut self) -> &mut Self {
            rmp::encode::write_nil(&mut self.0).expect("nil");
            self
        }
        fn bin(&mut self, b: &[u8]) -> &mut Self {
            rmp::encode::write_bin(&mut self.0, b).expect("bin");
            self
        }
        fn raw(&mut self, b: &[u8]) -> &mut Self {
            self.0.extend_from_slice(b);
            self
        }
        fn take(&mut self) -> Vec<u8> {
            std::mem::take(&mut self.0)
        }
    }

    /// `[ts, [events...], dp_rank]` around already-encoded events.
    fn batch(events: &[Vec<u8>]) -> Vec<u8> {
        let mut w = W::default();
        w.arr(3).f64(1.5).arr(u32::try_from(events.len()).expect("few events"));
        for e in events {
            w.raw(e);
        }
        w.uint(0).take()
    }

    fn kind(payload: &[u8]) -> DecodeErrorKind {
        decode_batch(payload).expect_err("must be refused").kind
    }

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, block_size: u32) -> Event {
        Event::Stored {
            hashes,
            parent,
            tokens,
            block_size,
            medium: None,
            lora_id: None,
            lora_name: None,
            extra_keys: Vec::new(),
            group: GroupFields::default(),
            locality: None,
            lookahead: false,
        }
    }

    #[test]
    fn map_event_with_type_last_and_unknown_keys() {
        let mut w = W::default();
        w.map(11);
        w.str("future").map(2).str("a").arr(2).f64(0.5).bin(&[0]).str("b").map(0);
        w.str("block_hashes").arr(2).uint(1).uint(u64::MAX);
        w.str("token_ids").arr(4).uint(0).uint(7).uint(u64::from(u32::MAX)).uint(65_536);
        w.str("parent_block_hash").uint(9);
        w.str("block_size").uint(2);
        w.str("lora_id").uint(3);
        w.str("medium").str("GPU");
        w.str("lora_name").str("adapter");
        w.str("extra_keys").arr(2).nil().arr(1).str("adapter");
        w.str("group_idx").uint(0);
        w.str("type").str("BlockStored");
        let got = decode_batch(&batch(&[w.take()])).expect("decodes");
        assert_eq!(
            got.events,
            vec![Event::Stored {
                hashes: vec![1, u64::MAX],
                parent: Some(9),
                tokens: vec![0, 7, u32::MAX, 65_536],
                block_size: 2,
                medium: Some("GPU".into()),
                lora_id: Some(3),
                lora_name: Some("adapter".into()),
                extra_keys: vec![None, Some(vec![Extra::Text("adapter".into())])],
                group: GroupFields { index: Some(0), ..GroupFields::default() },
                locality: None,
                lookahead: false,
            }]
        );
        assert_eq!((got.ts, got.dp_rank, got.unknown), (1.5, Some(0), 0));
    }

    #[test]
    fn array_events_short_and_long() {
        let mut w = W::default();
        let short_store = w.arr(5).str("BlockStored").arr(1).uint(4).nil().arr(1).uint(8).uint(1).take();
        let long_store = w
            .arr(14)
            .str("BlockStored")
            .arr(1)
            .uint(5)
            .uint(4)
            .arr(0)
            .uint(0)
            .int(-2)
            .str("CPU")
            .nil()
            .nil()
            .uint(0)
            .str("full_attention")
            .nil()
            .map(1)
            .str("x")
            .arr(1)
            .nil()
            .uint(1)
            .take();
        let old_removed = w.arr(2).str("BlockRemoved").arr(2).uint(4).uint(5).take();
        let removed = w.arr(4).str("BlockRemoved").arr(1).uint(4).str("GPU").nil().take();
        let cleared = w.arr(1).str("AllBlocksCleared").take();
        let got = decode_batch(&batch(&[short_store, long_store, old_removed, removed, cleared])).expect("decodes");
        let mut cpu = stored(vec![5], Some(4), vec![], 0);
        if let Event::Stored { medium, lora_id, group, .. } = &mut cpu {
            *medium = Some("CPU".into());
            *lora_id = Some(-2);
            *group = GroupFields { index: Some(0), kind: Some("full_attention".into()), window: None };
        }
        assert_eq!(
            got.events,
            vec![
                stored(vec![4], None, vec![8], 1),
                cpu,
                Event::Removed { hashes: vec![4, 5], medium: None, group: None, locality: None },
                Event::Removed { hashes: vec![4], medium: Some("GPU".into()), group: None, locality: None },
                Event::Cleared,
            ]
        );
    }

    #[test]
    fn array_store_without_its_required_fields_is_refused() {
        let mut w = W::default();
        let event = w.arr(4).str("BlockStored").arr(1).uint(4).nil().arr(0).take();
        assert_eq!(kind(&batch(&[event])), DecodeErrorKind::Missing { what: "block_size" });
        let event = w.arr(1).str("BlockRemoved").take();
        assert_eq!(kind(&batch(&[event])), DecodeErrorKind::Missing { what: "block_hashes" });
        let event = w.arr(0).take();
        assert_eq!(kind(&batch(&[event])), DecodeErrorKind::Missing { what: "event type" });
    }

    #[test]
    fn hashes_in_every_form() {
        let digest: Vec<u8> = (1..=32).collect();
        let xxh: Vec<u8> = (101..=116).collect();
        let mut w = W::default();
        w.map(2).str("type").str("BlockRemoved").str("block_hashes").arr(7);
        w.uint(0).raw(&[0xcf]).raw(&u64::MAX.to_be_bytes()).i64(-1).i64(i64::MIN).i64(7).bin(&digest).bin(&xxh);
        let got = decode_batch(&batch(&[w.take()])).expect("decodes");
        let last8 = |d: &[u8]| u64::from_be_bytes(d[d.len() - 8..].try_into().expect("8 bytes"));
        assert_eq!(
            got.events,
            vec![Event::Removed {
                hashes: vec![0, u64::MAX, u64::MAX, 1 << 63, 7, last8(&digest), last8(&xxh)],
                medium: None,
                group: None,
                locality: None,
            }]
        );
        assert_eq!(last8(&digest), 0x191a_1b1c_1d1e_1f20);
    }

    #[test]
    fn bad_hashes_are_refused() {
        let one = |hash: Vec<u8>| {
            let mut w = W::default();
            w.map(2).str("type").str("BlockRemoved").str("block_hashes").arr(1).raw(&hash);
            kind(&batch(&[w.take()]))
        };
        assert_eq!(one(W::default().bin(&[1; 7]).take()), DecodeErrorKind::HashLength { len: 7 });
        assert_eq!(one(W::default().bin(&[1; 65]).take()), DecodeErrorKind::HashLength { len: 65 });
        let wrong = |found| DecodeErrorKind::Unexpected { what: "block_hashes", expected: "int or bin", found };
        assert_eq!(one(W::default().f64(1.0).take()), wrong("float"));
        assert_eq!(one(W::default().str("1").take()), wrong("string"));
        assert_eq!(one(W::default().nil().take()), wrong("nil"));
    }

    #[test]
    fn token_ids_must_fit_u32() {
        for (token, ok) in [(u64::from(u32::MAX), true), (u64::from(u32::MAX) + 1, false)] {
            let mut w = W::default();
            let e = w.arr(5).str("BlockStored").arr(0).nil().arr(1).uint(token).uint(1).take();
            assert_eq!(decode_batch(&batch(&[e])).is_ok(), ok, "token {token}");
        }
        let mut w = W::default();
        let e = w.arr(5).str("BlockStored").arr(0).nil().arr(1).int(-1).uint(1).take();
        assert_eq!(kind(&batch(&[e])), DecodeErrorKind::OutOfRange { what: "token id" });
    }

    #[test]
    fn batch_shapes() {
        let mut w = W::default();
        let two = w.arr(2).f64(2.0).arr(0).take();
        let got = decode_batch(&two).expect("a sender that predates dp_rank");
        assert_eq!((got.ts, got.dp_rank, got.events.len()), (2.0, None, 0));
        let four = w.arr(4).uint(3).arr(0).int(-1).map(1).nil().arr(1).nil().take();
        let got = decode_batch(&four).expect("extra batch fields are skipped");
        assert_eq!((got.ts, got.dp_rank), (3.0, Some(-1)));
        let one = w.arr(1).f64(2.0).take();
        assert_eq!(kind(&one), DecodeErrorKind::Missing { what: "batch events" });
        let huge_rank = w.arr(3).f64(2.0).arr(0).uint(u64::MAX).take();
        assert_eq!(kind(&huge_rank), DecodeErrorKind::OutOfRange { what: "batch dp_rank" });
        let ts_str = w.arr(3).str("now").arr(0).uint(0).take();
        assert_eq!(kind(&ts_str), DecodeErrorKind::Unexpected { what: "batch ts", expected: "float", found: "string" });
        let mut trailing = batch(&[]);
        trailing.push(0xc0);
        assert_eq!(kind(&trailing), DecodeErrorKind::TrailingBytes { count: 1 });
    }

    #[test]
    fn unknown_event_types_are_counted_and_skipped() {
        let mut w = W::default();
        let new_map = w
            .map(3)
            .str("deep")
            .arr(1)
            .arr(1)
            .map(1)
            .str("k")
            .bin(&[1, 2])
            .str("type")
            .str("New")
            .str("n")
            .uint(1)
            .take();
        let new_array = w.arr(3).str("Newer").arr(2).uint(1).uint(2).str("x").take();
        let cleared = w.map(1).str("type").str("AllBlocksCleared").take();
        let got = decode_batch(&batch(&[new_map, cleared.clone(), new_array, cleared])).expect("decodes");
        assert_eq!((got.events, got.unknown), (vec![Event::Cleared, Event::Cleared], 2));
    }

    #[test]
    fn events_without_a_string_type_are_refused() {
        let mut w = W::default();
        let untyped = w.map(1).str("block_hashes").arr(0).take();
        assert_eq!(kind(&batch(&[untyped])), DecodeErrorKind::Missing { what: "event type" });
        let int_type = w.map(1).str("type").uint(1).take();
        assert_eq!(
            kind(&batch(&[int_type])),
            DecodeErrorKind::Unexpected { what: "event type", expected: "string", found: "unsigned int" }
        );
        let scalar = w.uint(1).take();
        assert_eq!(
            kind(&batch(&[scalar])),
            DecodeErrorKind::Unexpected { what: "event", expected: "map or array", found: "unsigned int" }
        );
    }

    #[test]
    fn extra_key_shapes() {
        let mut w = W::default();
        w.arr(9).str("BlockStored").arr(0).nil().arr(0).uint(16).nil().nil().nil();
        w.arr(4).nil().arr(4).str("lora").bin(&[9, 8]).arr(2).str("img").int(-3).uint(5).str("bare").arr(0);
        let got = decode_batch(&batch(&[w.take()])).expect("decodes");
        let Some(Event::Stored { extra_keys, .. }) = got.events.first() else { panic!("one store") };
        assert_eq!(
            extra_keys,
            &vec![
                None,
                Some(vec![Extra::Text("lora".into()), Extra::Bytes(vec![9, 8]), Extra::Other, Extra::Other]),
                Some(vec![Extra::Text("bare".into())]),
                Some(vec![]),
            ]
        );
    }

    /// A map-form `AllBlocksCleared` with an unknown field holding `levels` nested one-element
    /// arrays around a nil. The field value sits at depth 4 (batch, events, event, value).
    fn nested(levels: usize) -> Vec<u8> {
        let mut w = W::default();
        w.map(2).str("type").str("AllBlocksCleared").str("future");
        for _ in 0..levels {
            w.arr(1);
        }
        batch(&[w.nil().take()])
    }

    #[test]
    fn nesting_is_bounded_exactly_at_the_limit() {
        assert!(decode_batch(&nested(MAX_DEPTH - 4)).is_ok());
        assert_eq!(kind(&nested(MAX_DEPTH - 3)), DecodeErrorKind::TooDeep);
        assert_eq!(kind(&nested(1_000_000)), DecodeErrorKind::TooDeep);
    }

    #[test]
    fn declared_lengths_allocate_nothing_without_the_bytes() {
        let r = WireCursor { buf: &[0; 10], pos: 0 };
        assert_eq!(r.capacity(u32::MAX, 1), 10);
        assert_eq!(r.capacity(3, 1), 3);
        let mut w = W::default();
        for header in
            [&[0xdd, 0xff, 0xff, 0xff, 0xff][..], &[0xdb, 0xff, 0xff, 0xff, 0xff], &[0xc6, 0xff, 0xff, 0xff, 0xff]]
        {
            let events = w.arr(3).f64(1.0).raw(header).take();
            assert_eq!(kind(&events), DecodeErrorKind::Truncated, "{header:x?}");
        }
        let tokens = w.arr(5).str("BlockStored").arr(0).nil().raw(&[0xdd, 0xff, 0xff, 0xff, 0xff]).uint(1).take();
        assert_eq!(kind(&batch(&[tokens])), DecodeErrorKind::Truncated);
    }

    #[test]
    fn reserved_marker_and_bad_utf8_are_refused() {
        let mut w = W::default();
        let reserved = w.arr(3).f64(1.0).arr(1).raw(&[0xc1]).uint(0).take();
        let err = decode_batch(&reserved).expect_err("0xc1");
        assert_eq!((err.offset, err.kind), (11, DecodeErrorKind::ReservedMarker));
        let bad = w.arr(3).str("BlockRemoved").arr(0).raw(&[0xa2, 0xff, 0xfe]).take();
        assert_eq!(kind(&batch(&[bad])), DecodeErrorKind::InvalidUtf8 { what: "medium" });
    }

    #[test]
    fn errors_say_where_and_what() {
        let mut w = W::default();
        let e = w.arr(5).str("BlockStored").arr(0).nil().arr(1).int(-1).uint(1).take();
        let message = decode_batch(&batch(&[e])).expect_err("negative token").to_string();
        assert_eq!(message, "invalid KV event batch at byte 27: token id: number out of range");
    }

    // The fixtures: payloads made by vLLM's and SGLang's own classes and encoder.

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv-events")
    }

    fn expected_lines() -> Vec<Value> {
        let text = std::fs::read_to_string(fixtures().join("expected.jsonl")).expect("expected.jsonl");
        text.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
    }

    fn payload(file: &str) -> Vec<u8> {
        std::fs::read(fixtures().join(file)).expect("fixture file")
    }

    fn hash(v: &Value) -> u64 {
        v.as_str().expect("hashes are decimal strings").parse().expect("a u64")
    }

    fn opt_hash(v: &Value) -> Option<u64> {
        if v.is_null() { None } else { Some(hash(v)) }
    }

    fn opt_u32(v: &Value) -> Option<u32> {
        v.as_u64().map(|n| u32::try_from(n).expect("u32"))
    }

    fn opt_string(v: &Value) -> Option<String> {
        v.as_str().map(str::to_owned)
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
    }

    fn extra(v: &Value) -> Extra {
        match v {
            Value::String(s) => Extra::Text(s.clone()),
            Value::Object(o) if o.contains_key("$bin") => Extra::Bytes(hex(o["$bin"].as_str().expect("hex string"))),
            _ => Extra::Other,
        }
    }

    fn extra_keys(v: &Value) -> Vec<Option<Vec<Extra>>> {
        match v {
            Value::Null => Vec::new(),
            Value::Array(blocks) => blocks
                .iter()
                .map(|b| match b {
                    Value::Null => None,
                    Value::Array(items) => Some(items.iter().map(extra).collect()),
                    one => Some(vec![extra(one)]),
                })
                .collect(),
            other => panic!("extra_keys {other}"),
        }
    }

    /// A field of an expected event, at its top level or among its `other_fields`.
    fn field<'v>(v: &'v Value, name: &str) -> &'v Value {
        match &v[name] {
            Value::Null => &v["other_fields"][name],
            found => found,
        }
    }

    fn expected_event(v: &Value) -> Event {
        match v["type"].as_str().expect("type") {
            "BlockStored" => Event::Stored {
                hashes: v["block_hashes"].as_array().expect("hashes").iter().map(hash).collect(),
                parent: opt_hash(&v["parent_block_hash"]),
                tokens: v["token_ids"]
                    .as_array()
                    .expect("tokens")
                    .iter()
                    .map(|t| u32::try_from(t.as_u64().expect("token")).expect("u32 token"))
                    .collect(),
                block_size: u32::try_from(v["block_size"].as_u64().expect("block_size")).expect("u32"),
                medium: opt_string(&v["medium"]),
                lora_id: v["lora_id"].as_i64(),
                lora_name: opt_string(&v["lora_name"]),
                extra_keys: extra_keys(&v["extra_keys"]),
                group: GroupFields {
                    index: opt_u32(&v["group_idx"]),
                    kind: opt_string(field(v, "kv_cache_spec_kind")),
                    window: opt_u32(field(v, "kv_cache_spec_sliding_window")),
                },
                locality: opt_string(field(v, "locality")),
                lookahead: field(v, "lookahead_token_ids")
                    .as_array()
                    .is_some_and(|blocks| blocks.iter().any(|b| b.as_array().is_some_and(|t| !t.is_empty()))),
            },
            "BlockRemoved" => Event::Removed {
                hashes: v["block_hashes"].as_array().expect("hashes").iter().map(hash).collect(),
                medium: opt_string(&v["medium"]),
                group: opt_u32(&v["group_idx"]),
                locality: opt_string(field(v, "locality")),
            },
            "AllBlocksCleared" => Event::Cleared,
            other => panic!("unexpected type {other} in expected.jsonl"),
        }
    }

    #[test]
    fn every_fixture_decodes_as_expected() {
        let lines = expected_lines();
        let mut valid = 0;
        let mut garbage = 0;
        for line in &lines {
            let file = line["file"].as_str().expect("file");
            let bytes = payload(file);
            let result = decode_batch(&bytes);
            if line["error"].as_bool() == Some(true) {
                if file == "garbage_array2.msgpack" {
                    // Accepted on purpose: vLLM releases whose batch predates data_parallel_rank
                    // send exactly [ts, events] (the fixture's own note allows it).
                    let batch = result.expect("a two-element batch is accepted");
                    assert_eq!(batch.dp_rank, None, "{file}");
                } else {
                    let err = result.expect_err(file);
                    assert!(!err.to_string().is_empty());
                    garbage += 1;
                }
                continue;
            }
            let got = result.unwrap_or_else(|e| panic!("{file}: {e}"));
            let events: Vec<Event> = line["events"].as_array().expect("events").iter().map(expected_event).collect();
            let unknown = line.get("skipped_unknown_types").and_then(Value::as_array).map_or(0, Vec::len);
            let want =
                Batch { ts: line["ts"].as_f64().expect("ts"), events, dp_rank: line["dp_rank"].as_i64(), unknown };
            assert_eq!(got, want, "{file}");
            valid += 1;
        }
        assert!(valid >= 30 && garbage >= 13, "{valid} valid and {garbage} garbage fixtures");
        let mut files: Vec<String> = std::fs::read_dir(fixtures())
            .expect("fixture dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".msgpack"))
            .collect();
        files.sort();
        let mut listed: Vec<String> = lines.iter().map(|l| l["file"].as_str().expect("file").to_owned()).collect();
        listed.sort();
        assert_eq!(files, listed, "every payload has its expected line");
    }

    #[test]
    fn every_truncation_of_every_fixture_is_refused() {
        for line in expected_lines() {
            let file = line["file"].as_str().expect("file");
            let bytes = payload(file);
            if decode_batch(&bytes).is_err() {
                continue;
            }
            for len in 0..bytes.len() {
                assert!(decode_batch(&bytes[..len]).is_err(), "{file} cut at {len}");
            }
        }
    }

    #[test]
    fn corrupted_fixtures_never_panic() {
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for line in expected_lines() {
            let bytes = payload(line["file"].as_str().expect("file"));
            if bytes.is_empty() {
                continue;
            }
            for _ in 0..300 {
                let mut copy = bytes.clone();
                for _ in 0..1 + next() % 4 {
                    let at = usize::try_from(next() % copy.len() as u64).expect("index");
                    copy[at] = (next() & 0xff) as u8;
                }
                let _ = decode_batch(&copy);
            }
        }
    }
}
