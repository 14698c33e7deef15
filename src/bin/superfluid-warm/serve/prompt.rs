//! A request's prompt in the engine's tokens: token ids as given; text and chats rendered and
//! tokenized as vLLM does (the model's folder through `Renderer`, or else an engine's
//! `/tokenize`). What cannot be rendered the same way is said, and routed on load alone.
//!
//! The body is read once, borrowed: the fields the head needs, the prompt and the messages left
//! as the client's own JSON text (the renderer takes the messages as JSON). A completion's flat
//! list of token ids, most of its body, is read by a pass of its own, and serde reads the rest.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::Head;
use super::proxy::{Answer, Lookup, post_json};

/// Which API a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

/// What the head reads of an OpenAI request (the rest passes through untouched).
#[derive(Deserialize, Default)]
pub(crate) struct OpenAiRequest<'a> {
    #[serde(borrow)]
    pub(crate) model: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    pub(crate) messages: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    pub(crate) stream: Option<bool>,
    #[serde(borrow)]
    pub(crate) stream_options: Option<&'a RawValue>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    /// Fields that change the tokens in ways the head does not follow: present and not null,
    /// the prompt is routed on load alone.
    #[serde(borrow)]
    prompt_embeds: Option<&'a RawValue>,
    #[serde(borrow)]
    truncate_prompt_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    chat_template: Option<&'a RawValue>,
    #[serde(borrow)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow)]
    documents: Option<&'a RawValue>,
    #[serde(borrow)]
    mm_processor_kwargs: Option<&'a RawValue>,
    /// The top-level `prompt`, when it is a flat list of token ids, read apart from the rest
    /// ([`read_request`]); `prompt` is then none.
    #[serde(skip)]
    ids: Option<Vec<u32>>,
}

/// The body as an OpenAI request. A top-level `prompt` that is a flat list of token ids is read
/// in one pass of its own, and serde reads the body with `null` in the list's place (kept in
/// `apart`): serde would otherwise walk the list, most of a long prompt's body, only to find its
/// end, before the ids are read from its text.
///
/// # Errors
///
/// serde's, for the body as the client sent it.
pub(crate) fn read_request<'a>(bytes: &'a [u8], apart: &'a mut Vec<u8>) -> serde_json::Result<OpenAiRequest<'a>> {
    let Some((ids, rest)) = ids_apart(bytes) else { return serde_json::from_slice(bytes) };
    *apart = rest;
    let apart: &'a Vec<u8> = apart;
    match serde_json::from_slice::<OpenAiRequest<'a>>(apart) {
        Ok(mut request) => {
            request.ids = Some(ids);
            Ok(request)
        }
        // The error where the client's own body has it.
        Err(_) => serde_json::from_slice(bytes),
    }
}

/// A body whose top-level `prompt` is a flat list of token ids: the ids, and the body with
/// `null` in the list's place. `None` for any other body (a chat, a text prompt, a nested list,
/// a `prompt` named twice, JSON this walk does not follow): serde reads those whole. The walk
/// only finds the top level's keys and values; serde still reads every byte but the list's.
fn ids_apart(body: &[u8]) -> Option<(Vec<u32>, Vec<u8>)> {
    let mut at = space(body, 0);
    if body.get(at) != Some(&b'{') {
        return None;
    }
    at = space(body, at + 1);
    let mut found = None;
    loop {
        let key_end = string_end(body, at)?;
        let key = body.get(at..key_end)?;
        at = space(body, key_end);
        if body.get(at) != Some(&b':') {
            return None;
        }
        at = space(body, at + 1);
        let value_end = match key {
            b"\"prompt\"" if found.is_none() => {
                let (ids, end) = id_list(body, at)?;
                found = Some((ids, at, end));
                end
            }
            b"\"prompt\"" | b"\"messages\"" => return None,
            _ => value_end(body, at)?,
        };
        at = space(body, value_end);
        match body.get(at)? {
            b',' => at = space(body, at + 1),
            b'}' => break,
            _ => return None,
        }
    }
    if space(body, at + 1) != body.len() {
        return None;
    }
    let (ids, start, end) = found?;
    let mut rest = Vec::with_capacity(body.len().saturating_sub(end - start) + 4);
    rest.extend_from_slice(body.get(..start)?);
    rest.extend_from_slice(b"null");
    rest.extend_from_slice(body.get(end..)?);
    Some((ids, rest))
}

/// The first byte at or after `at` that is not JSON whitespace (or the end).
fn space(body: &[u8], mut at: usize) -> usize {
    while matches!(body.get(at), Some(b' ' | b'\n' | b'\r' | b'\t')) {
        at += 1;
    }
    at
}

/// Past the end of the JSON string that starts at `at`.
fn string_end(body: &[u8], at: usize) -> Option<usize> {
    if body.get(at) != Some(&b'"') {
        return None;
    }
    let mut i = at + 1;
    loop {
        match body.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => i += 2,
            c if *c < 0x20 => return None,
            _ => i += 1,
        }
    }
}

/// Past the end of the JSON value that starts at `at` (its nesting followed, not checked:
/// serde reads it after).
fn value_end(body: &[u8], at: usize) -> Option<usize> {
    match body.get(at)? {
        b'"' => string_end(body, at),
        b'{' | b'[' => {
            let (mut i, mut depth) = (at, 0usize);
            loop {
                match body.get(i)? {
                    b'"' => {
                        i = string_end(body, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            let mut i = at;
            while body.get(i).is_some_and(|b| !matches!(b, b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')) {
                i += 1;
            }
            (i > at).then_some(i)
        }
    }
}

/// The JSON list of token ids that starts at `at` (`[]` included), and past its end; `None`
/// unless every element is an integer that fits a token id.
fn id_list(body: &[u8], at: usize) -> Option<(Vec<u32>, usize)> {
    if body.get(at) != Some(&b'[') {
        return None;
    }
    // About 6 bytes an id; a long body with a short list first reserves no more than 4 MiB.
    let mut out = Vec::with_capacity((body.len().saturating_sub(at) / 5 + 1).min(1 << 20));
    let mut i = space(body, at + 1);
    if body.get(i) == Some(&b']') {
        return Some((out, i + 1));
    }
    loop {
        let (start, mut value) = (i, 0u64);
        while let Some(digit) = body.get(i).map(|b| b.wrapping_sub(b'0')).filter(|d| *d < 10) {
            value = value * 10 + u64::from(digit);
            i += 1;
            if i - start > 10 {
                return None;
            }
        }
        // JSON's integers: at least one digit, no leading zero, no fraction or exponent.
        let leading_zero = body.get(start) == Some(&b'0') && i - start > 1;
        if i == start || leading_zero || matches!(body.get(i), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        out.push(u32::try_from(value).ok()?);
        i = space(body, i);
        match body.get(i)? {
            b',' => i = space(body, i + 1),
            b']' => return Some((out, i + 1)),
            _ => return None,
        }
    }
}

/// A completion's `prompt`, read in one pass: token ids, a text, or what the head does not follow
/// (a batch of several prompts, or not a prompt at all).
#[derive(Debug, PartialEq)]
enum Prompt {
    Ids(Vec<u32>),
    Text(String),
    Other,
}

/// A flat list of token ids from its JSON text (serde's, so valid JSON); `None` for anything
/// else, which serde reads.
fn ids(raw: &str) -> Option<Vec<u32>> {
    let text = raw.trim().as_bytes();
    id_list(text, 0).filter(|(_, end)| *end == text.len()).map(|(ids, _)| ids)
}

/// One element of a prompt list.
enum Element {
    Id(u32),
    Text(String),
    Ids(Vec<u32>),
    Other,
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Prompt, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Prompt;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a prompt")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(v.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let (mut ids, mut whole, mut count, mut other) = (Vec::new(), None, 0usize, false);
                while let Some(element) = seq.next_element::<Element>()? {
                    count += 1;
                    match element {
                        Element::Id(id) => ids.push(id),
                        Element::Text(t) => whole = Some(Prompt::Text(t)),
                        Element::Ids(i) => whole = Some(Prompt::Ids(i)),
                        Element::Other => other = true,
                    }
                }
                Ok(match (whole, count, other) {
                    (_, _, true) => Prompt::Other,
                    (None, _, false) => Prompt::Ids(ids),
                    (Some(one), 1, false) => one,
                    (Some(_), _, false) => Prompt::Other,
                })
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Prompt, A::Error> {
                while map.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {}
                Ok(Prompt::Other)
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
        }
        d.deserialize_any(Visit)
    }
}

impl<'de> Deserialize<'de> for Element {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Element, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Element;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a token id, a text or a list of token ids")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Element, E> {
                Ok(u32::try_from(v).map_or(Element::Other, Element::Id))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Element, E> {
                Ok(u32::try_from(v).map_or(Element::Other, Element::Id))
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Element, E> {
                Ok(Element::Text(v.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Element, A::Error> {
                let (mut ids, mut other) = (Vec::new(), false);
                while let Some(element) = seq.next_element::<Element>()? {
                    match element {
                        Element::Id(id) => ids.push(id),
                        _ => other = true,
                    }
                }
                Ok(if other { Element::Other } else { Element::Ids(ids) })
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Element, A::Error> {
                while map.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {}
                Ok(Element::Other)
            }
        }
        d.deserialize_any(Visit)
    }
}

/// A prompt's tokens, or why there are none.
pub(crate) enum Tokens {
    /// The engine's tokens: how many, how long making them took (`None`: given as ids), and
    /// the index's answer for them, asked for or to ask.
    Ids { count: usize, took: Option<Duration>, lookup: Lookup },
    /// Not rendered: why.
    Unrendered(String),
}

/// What to render: a completion's text, or a chat (`engine_only`: with fields of vLLM's that
/// the head's renderer does not follow, which an engine's `/tokenize` does: the chat template's
/// own arguments, a final message to continue, a template of the request's own).
enum Source {
    Text { prompt: String, add_special_tokens: bool },
    Chat { messages: String, tools: Option<String>, add_generation_prompt: bool, engine_only: Option<Value> },
}

/// How long an engine's `/tokenize` may take.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// The request's prompt in the engine's tokens, and the index's answer for them. Renders take
/// the cores in turns, shortest remaining first (`turns.rs`). A prompt not routed on its start
/// is rendered and looked up on the request's own thread, its worker's other tasks handed to
/// another thread meanwhile (`block_in_place`): no thread to wake before the request goes on.
/// Otherwise it is rendered on the blocking pool, where the same task goes on to ask the index
/// and sends the count and the answer in one message (one wake-up of the request's task), awaited
/// for the head's deadline from the render's end, which the render task notes before it asks.
/// Either way an answer that took longer than the deadline is not used: the request goes by load
/// with the count alone.
///
/// With `early` (a request the head proxies), a long prompt is routed on its start: as its
/// pieces are tokenized, the index is asked about the tokens so far (from [`FIRST_LOOK`] tokens
/// on; then two blocks on, four, eight: a next turn settles two blocks past the history its
/// engine holds), and once that answer settles (`Prefix::settles`) it is the answer; the
/// count is then estimated from the bytes, and the rest's prefix comes after, to be claimed
/// (`Lookup::Rendered`'s second field).
pub(crate) async fn tokens(head: &Arc<Head>, kind: Kind, request: &mut OpenAiRequest<'_>, early: bool) -> Tokens {
    let source = match source(kind, request) {
        Ok(Ok(ids)) => return Tokens::Ids { count: ids.len(), took: None, lookup: Lookup::Ids(ids) },
        Ok(Err(source)) => source,
        Err(why) => return Tokens::Unrendered(why),
    };
    let engine_only = matches!(&source, Source::Chat { engine_only: Some(_), .. });
    if head.renderer.is_none() || engine_only {
        let started = Instant::now();
        return match engine_tokenize(head, &source).await {
            Ok(ids) => Tokens::Ids { count: ids.len(), took: Some(started.elapsed()), lookup: Lookup::Ids(ids) },
            Err(why) => Tokens::Unrendered(why),
        };
    }
    // The text's length, for its place in the turns: a chat's messages as sent (its rendered
    // text is about as long).
    let text_bytes = match &source {
        Source::Text { prompt, .. } => prompt.len(),
        Source::Chat { messages, .. } => messages.len(),
    };
    // Not to be routed on its start, while the index answers in time: here. A hand-over to the
    // blocking pool and back would wake two idle cores, which costs more than the lookup.
    let here = (!early || text_bytes < EARLY_BYTES) && head.lookup_inline();
    if let Some(r) = head.renderer.as_ref().filter(|_| here) {
        return tokio::task::block_in_place(|| rendered_here(head, r, &source, text_bytes));
    }
    let (done, finished) = tokio::sync::oneshot::channel::<Result<Finished, String>>();
    let (rest_sender, rest) = tokio::sync::oneshot::channel();
    let rendered: Arc<OnceLock<Rendered>> = Arc::default();
    let (h, noted) = (Arc::clone(head), Arc::clone(&rendered));
    drop(tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let Some(r) = h.renderer.as_ref() else { return };
        // Taken by whichever is sent first: an answer for the prompt's start, or the one for
        // the whole prompt.
        let mut done = Some(done);
        let (mut next, mut stride) = (FIRST_LOOK, SETTLE_TOKENS);
        let mut turn = h.turns.arrive(text_bytes);
        let mut step = |ids: &[u32], bytes: usize, of: usize| {
            turn.next_piece(of.saturating_sub(bytes));
            if !early || ids.len() < next || done.is_none() {
                return;
            }
            // An engine's warm prefix reaches within two blocks of the tokens so far: the answer
            // may settle as soon as two more blocks are tokenized (a conversation's next turn,
            // past the history its engine holds); each look that does not settle waits twice as
            // long for the next, so a prompt held to its end is looked up a few times, not at
            // every piece.
            next = ids.len() + stride;
            stride = stride.saturating_mul(2);
            let (answer, _) = h.lookup_here(ids);
            if !answer.1.as_ref().is_ok_and(|hits| answer.0.settles(hits)) {
                return;
            }
            let count = (ids.len() as f64 * of as f64 / bytes.max(1) as f64).round() as usize;
            let rendered = Rendered { count, took: started.elapsed(), at: Instant::now() };
            turn.sent();
            if let Some(done) = done.take() {
                let _ = done.send(Ok(Finished { rendered, answer, looked: Duration::ZERO, on_start: true }));
            }
        };
        let ids = render(r, &source, &mut step);
        // The core goes to the next render before the lookup.
        drop(turn);
        match (ids, done) {
            // Routed on its start: the whole prefix, to be claimed.
            (Ok(ids), None) => drop(rest_sender.send((h.index.read().prefix(&h.namespace, &ids), ids.len()))),
            (Ok(ids), Some(done)) => {
                let rendered = Rendered { count: ids.len(), took: started.elapsed(), at: Instant::now() };
                let _ = noted.set(rendered);
                let (answer, looked) = h.lookup_here(&ids);
                let _ = done.send(Ok(Finished { rendered, answer, looked, on_start: false }));
            }
            (Err(e), Some(done)) => drop(done.send(Err(format!("render: {e}")))),
            (Err(_), None) => {}
        }
    }));
    let mut finished = finished;
    let message = loop {
        // Until the render ends, a look every deadline (at least every millisecond); after it,
        // until the deadline from its end.
        let wait = match rendered.get() {
            Some(r) => head.deadline.saturating_sub(r.at.elapsed()),
            None => head.deadline.max(Duration::from_millis(1)),
        };
        match tokio::time::timeout(wait, &mut finished).await {
            Ok(message) => break message,
            Err(_) => {
                if let Some(r) = rendered.get().filter(|r| r.at.elapsed() >= head.deadline) {
                    let late = Lookup::Rendered(Err(r.at.elapsed()), None);
                    return Tokens::Ids { count: r.count, took: Some(r.took), lookup: late };
                }
            }
        }
    };
    match message {
        Ok(Ok(Finished { rendered, answer, looked, on_start })) => {
            // The whole prompt's prefix comes only after an answer for its start (asked before
            // the render ended: no deadline to meet).
            let rest = on_start.then_some(rest);
            let waited = rendered.at.elapsed();
            let looked = head.in_time(answer, looked, waited);
            Tokens::Ids { count: rendered.count, took: Some(rendered.took), lookup: Lookup::Rendered(looked, rest) }
        }
        Ok(Err(why)) => Tokens::Unrendered(why),
        Err(_) => Tokens::Unrendered("render: the task ended".into()),
    }
}

/// The prompt's tokens by the head's renderer, `step` told of each piece as
/// [`superfluid_warm::Renderer::chat_in_steps`] tells it.
fn render(
    r: &superfluid_warm::Renderer,
    source: &Source,
    step: &mut dyn FnMut(&[u32], usize, usize),
) -> superfluid_warm::Result<Vec<u32>> {
    match source {
        Source::Text { prompt, add_special_tokens } => r.completion_in_steps(prompt, *add_special_tokens, step),
        Source::Chat { messages, tools, add_generation_prompt, .. } => {
            r.chat_in_steps(messages, tools.as_deref(), *add_generation_prompt, step)
        }
    }
}

/// The prompt rendered whole, in its turn, and looked up, all on this thread; an answer that
/// took longer than the deadline is not used.
fn rendered_here(head: &Head, r: &superfluid_warm::Renderer, source: &Source, text_bytes: usize) -> Tokens {
    let started = Instant::now();
    let mut turn = head.turns.arrive(text_bytes);
    let ids = render(r, source, &mut |_, bytes, of| turn.next_piece(of.saturating_sub(bytes)));
    // The core goes to the next render before the lookup.
    drop(turn);
    let ids = match ids {
        Ok(ids) => ids,
        Err(e) => return Tokens::Unrendered(format!("render: {e}")),
    };
    let took = started.elapsed();
    let (answer, looked) = head.lookup_here(&ids);
    let looked = head.in_time(answer, looked, looked);
    Tokens::Ids { count: ids.len(), took: Some(took), lookup: Lookup::Rendered(looked, None) }
}

/// Bytes of text under which a prompt is not routed on its start: it rarely reaches
/// [`FIRST_LOOK`] tokens (English runs about 4 bytes a token), and one that does is routed a
/// render later.
const EARLY_BYTES: usize = 4 * FIRST_LOOK;

/// A render's end: the prompt's token count (estimated when it was routed on its start), how
/// long rendering took, and when it ended.
#[derive(Clone, Copy)]
struct Rendered {
    count: usize,
    took: Duration,
    at: Instant,
}

/// What the render task sends: its end, the index's answer and how long asking took (an answer
/// that took longer than the deadline is not used, however soon it is read), and whether that
/// answer is for the prompt's start.
struct Finished {
    rendered: Rendered,
    answer: Answer,
    looked: Duration,
    on_start: bool,
}

/// Tokens of a prompt's start at which the head first asks the index whether the start settles
/// the answer (`tokens`'s `early`): a few pieces in, and a lookup of its tokens costs ~1% of
/// tokenizing them.
const FIRST_LOOK: usize = 1024;

/// Tokens past a look that did not settle the answer before the next: the two blocks by which
/// a warm prefix must end before the tokens so far for the answer to settle.
const SETTLE_TOKENS: usize = 2 * superfluid_warm::BLOCK_TOKENS;

/// Whether a field is there and not null.
fn set(field: Option<&RawValue>) -> bool {
    field.is_some_and(|v| v.get() != "null")
}

/// The prompt as token ids (`Ok(Ok)`), as what to render (`Ok(Err)`), or why it cannot be
/// rendered as the engine will (`Err`).
fn source(kind: Kind, r: &mut OpenAiRequest<'_>) -> Result<Result<Vec<u32>, Source>, String> {
    match kind {
        Kind::Completion => {
            if set(r.prompt_embeds) {
                return Err("prompt_embeds".into());
            }
            if set(r.truncate_prompt_tokens) {
                return Err("truncate_prompt_tokens".into());
            }
            if let Some(ids) = r.ids.take() {
                return Ok(Ok(ids));
            }
            let prompt = match r.prompt.map(RawValue::get) {
                None | Some("null") => None,
                Some(raw) => {
                    Some(ids(raw).map_or_else(|| serde_json::from_str(raw).unwrap_or(Prompt::Other), Prompt::Ids))
                }
            };
            match prompt {
                None => Err("no prompt".into()),
                Some(Prompt::Ids(ids)) => Ok(Ok(ids)),
                Some(Prompt::Text(text)) => {
                    Ok(Err(Source::Text { prompt: text, add_special_tokens: r.add_special_tokens.unwrap_or(true) }))
                }
                Some(Prompt::Other) => Err("a batch of prompts, or not a prompt".into()),
            }
        }
        Kind::Chat => {
            if set(r.mm_processor_kwargs) {
                return Err("mm_processor_kwargs".into());
            }
            let messages = r.messages.map(RawValue::get).filter(|m| m.trim_start().starts_with('['));
            let messages = messages.ok_or("no messages")?;
            // What only the engine's own rendering follows, passed to its `/tokenize` as sent.
            let mut engine_only = serde_json::Map::new();
            let raw = [
                ("chat_template", r.chat_template),
                ("chat_template_kwargs", r.chat_template_kwargs),
                ("documents", r.documents),
            ];
            for (name, value) in raw {
                if let Some(v) = value.filter(|v| set(Some(v))) {
                    engine_only.insert(name.into(), serde_json::from_str(v.get()).unwrap_or(Value::Null));
                }
            }
            if r.continue_final_message == Some(true) {
                engine_only.insert("continue_final_message".into(), Value::Bool(true));
            }
            if r.add_special_tokens == Some(true) {
                engine_only.insert("add_special_tokens".into(), Value::Bool(true));
            }
            Ok(Err(Source::Chat {
                messages: messages.to_string(),
                tools: r.tools.filter(|t| set(Some(t))).map(|t| t.get().to_string()),
                add_generation_prompt: r.add_generation_prompt.unwrap_or(true),
                engine_only: (!engine_only.is_empty()).then_some(Value::Object(engine_only)),
            }))
        }
    }
}

/// The tokens by an engine's `/tokenize` (the first in the choice), as vLLM serves it.
async fn engine_tokenize(head: &Arc<Head>, source: &Source) -> Result<Vec<u32>, String> {
    let engine = head.engines.iter().find(|e| !e.ejected.load(Relaxed)).ok_or("no engine to tokenize")?;
    let request = match source {
        Source::Text { prompt, add_special_tokens } => {
            json!({"model": head.model, "prompt": prompt, "add_special_tokens": add_special_tokens})
        }
        Source::Chat { messages, tools, add_generation_prompt, engine_only } => {
            let parse = |s: &str| serde_json::from_str::<Value>(s).unwrap_or(Value::Null);
            let mut r = json!({"model": head.model, "messages": parse(messages), "add_generation_prompt": add_generation_prompt});
            if let Some(map) = r.as_object_mut() {
                if let Some(tools) = tools {
                    map.insert("tools".into(), parse(tools));
                }
                if let Some(Value::Object(fields)) = engine_only {
                    map.extend(fields.clone());
                }
            }
            r
        }
    };
    let (status, answer) = post_json(engine, "/tokenize", &request, TOKENIZE_TIMEOUT)
        .await
        .map_err(|e| format!("{}'s /tokenize: {e}", engine.name))?;
    if status != 200 {
        return Err(format!("{}'s /tokenize answered {status}", engine.name));
    }
    answer
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|ids| ids.iter().map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok())).collect())
        .ok_or_else(|| format!("{}'s /tokenize gave no tokens", engine.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    type Read = Result<Result<Vec<u32>, String>, String>;

    /// What a reading of a body made: its source, model and stream flag; or serde's error.
    type Made = Result<(Read, Option<String>, Option<bool>), String>;

    fn said(read: Result<Result<Vec<u32>, Source>, String>) -> Read {
        read.map(|s| {
            s.map_err(|s| match s {
                Source::Text { prompt, add_special_tokens } => format!("text {add_special_tokens} {prompt}"),
                Source::Chat { messages, tools, add_generation_prompt, engine_only: None } => {
                    format!("chat {add_generation_prompt} {messages} {tools:?}")
                }
                Source::Chat { engine_only: Some(fields), .. } => format!("engine {fields}"),
            })
        })
    }

    /// The body read as the head reads it (a list of ids apart), and by serde alone, the
    /// oracle: a completion's prompt read by serde's [`Prompt`], not by [`id_list`]. What each
    /// makes of it (the source, the model, the stream flag), or its error.
    fn both(kind: Kind, body: &[u8]) -> (Made, Made) {
        let mut apart = Vec::new();
        let head = read_request(body, &mut apart)
            .map(|mut r| (said(source(kind, &mut r)), r.model.as_deref().map(str::to_string), r.stream));
        let whole = serde_json::from_slice::<OpenAiRequest<'_>>(body).map(|mut r| {
            let plain = !set(r.prompt_embeds) && !set(r.truncate_prompt_tokens);
            let read = match (kind, r.prompt.map(RawValue::get)) {
                (Kind::Completion, None | Some("null")) if plain => Err("no prompt".to_string()),
                (Kind::Completion, Some(raw)) if plain => match serde_json::from_str(raw).unwrap_or(Prompt::Other) {
                    Prompt::Ids(ids) => Ok(Ok(ids)),
                    Prompt::Text(t) => Ok(Err(format!("text {} {t}", r.add_special_tokens.unwrap_or(true)))),
                    Prompt::Other => Err("a batch of prompts, or not a prompt".to_string()),
                },
                _ => said(source(kind, &mut r)),
            };
            (read, r.model.as_deref().map(str::to_string), r.stream)
        });
        (head.map_err(|e| e.to_string()), whole.map_err(|e| e.to_string()))
    }

    fn of(kind: Kind, body: &str) -> Read {
        let (head, whole) = both(kind, body.as_bytes());
        assert_eq!(head, whole, "{body}");
        head.expect("a request").0
    }

    #[test]
    fn a_list_of_ids_read_apart_reads_as_serde_reads_the_body_whole() {
        let bodies = [
            r#"{"model":"m","prompt":[1,2,3]}"#,
            " { \"prompt\" : [ 1 ,\t2\r\n] , \"model\" : \"m\" , \"stream\":true } ",
            r#"{"prompt":[01]}"#,
            r#"{"prompt":[1,]}"#,
            r#"{"prompt":[,1]}"#,
            r#"{"prompt":[1 2]}"#,
            r#"{"prompt":[1],"prompt":[2]}"#,
            r#"{"pro\u006dpt":[1],"prompt":[2]}"#,
            r#"{"x":"\"prompt\":[9]","prompt":[1]}"#,
            r#"{"x":{"prompt":[9]},"prompt":[1]}"#,
            r#"{"x":[{"a":"]}\\"}],"prompt":[1],"y":"\\"}"#,
            r#"{"prompt":[1e3]}"#,
            r#"{"prompt":[1.0]}"#,
            r#"{"prompt":[-1]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":[4294967295,0]}"#,
            r#"{"prompt":[99999999999]}"#,
            r#"{"prompt":[18446744073709551617]}"#,
            r#"{"prompt":[00]}"#,
            r#"{"prompt":[-0]}"#,
            r#"{"prompt":[1E3]}"#,
            r#"{"prompt":[1],"pro\u006dpt":[2]}"#,
            r#"{"prompt":[1]} x"#,
            r#"{"prompt":[1]"#,
            r#"{"prompt":[1"#,
            r#"{"prompt" [1]}"#,
            r#"{"prompt":[1],}"#,
            r#"{"messages":[],"prompt":[1]}"#,
            r#"{"prompt":[1],"messages":[]}"#,
            r#"{"prompt":[1],"prompt_embeds":"x"}"#,
            r#"{"prompt":[1],"truncate_prompt_tokens":3}"#,
            r#"{"prompt":[]}"#,
            r#"{"prompt":[ ]}"#,
            r#"{"prompt":[[1,2]]}"#,
            r#"{"prompt":"text"}"#,
            r#"{"prompt":null}"#,
            r#"{"prompt":[1],"model":null,"n":1e2,"a":true,"b":false,"c":null,"d":-0.5}"#,
            r#"{"prompt":[1],"model":"é ✓ 🙂"}"#,
            "{\"prompt\":[1],\"x\":\"a\tb\"}",
            r#"{"prompt":[1],"model":7}"#,
            r#"{}"#,
            r#"[]"#,
            r#"{"prompt":[1]}{"#,
            r#"{"x":[}],"prompt":[1]}"#,
            r#"{"x":tru,"prompt":[1]}"#,
            "",
        ];
        let mut apart_read = 0;
        for body in bodies {
            let (head, whole) = both(Kind::Completion, body.as_bytes());
            // The same reading, or the same error where the client's body has it.
            assert_eq!(head, whole, "{body}");
            apart_read += usize::from(ids_apart(body.as_bytes()).is_some());
        }
        // The walk took the list apart where it could, and left the rest to serde.
        assert_eq!(apart_read, 16);
        assert_eq!(
            ids_apart(br#" {"prompt" : [5, 6] ,"m":1} "#),
            Some((vec![5, 6], br#" {"prompt" : null ,"m":1} "#.to_vec()))
        );

        // Lists of every length of id, spaced every way, among other fields.
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        let spaces = ["", " ", "\n", "\t ", "\r\n"];
        for _ in 0..300 {
            let n = next(40);
            let mut list = String::from("[");
            let mut ids = Vec::new();
            for i in 0..n {
                let id = match next(4) {
                    0 => next(10) as u32,
                    1 => next(200_000) as u32,
                    2 => u32::MAX - next(3) as u32,
                    _ => next(1 << 31) as u32,
                };
                ids.push(id);
                if i > 0 {
                    list.push(',');
                }
                list.push_str(spaces[next(5) as usize]);
                list.push_str(&id.to_string());
                list.push_str(spaces[next(5) as usize]);
            }
            list.push(']');
            let extra = [r#""max_tokens":7"#, r#""stop":["]","}"]"#, r#""user":"a\"b""#, r#""logit_bias":{"1":-1}"#];
            let before = extra[next(4) as usize];
            let after = extra[next(4) as usize];
            let body = format!(r#"{{{before},"model":"m","prompt":{list},{after}}}"#);
            let (head, whole) = both(Kind::Completion, body.as_bytes());
            assert_eq!(head, whole, "{body}");
            assert_eq!(head.map(|h| h.0), Ok(Ok(Ok(ids))), "{body}");
        }
    }

    #[test]
    fn prompts_are_read_as_vllm_reads_them_and_what_is_not_followed_is_named() {
        use Kind::{Chat, Completion};
        assert_eq!(of(Completion, r#"{"prompt":[1,2,3]}"#), Ok(Ok(vec![1, 2, 3])));
        assert_eq!(of(Completion, r#"{"prompt":[[4,5]]}"#), Ok(Ok(vec![4, 5])));
        assert_eq!(of(Completion, r#"{"prompt":"hi"}"#), Ok(Err("text true hi".into())));
        assert_eq!(of(Completion, r#"{"prompt":["hi"],"add_special_tokens":false}"#), Ok(Err("text false hi".into())));
        assert!(of(Completion, r#"{"prompt":["a","b"]}"#).is_err_and(|e| e.contains("batch")));
        assert!(of(Completion, r#"{"prompt":[[1],[2]]}"#).is_err_and(|e| e.contains("batch")));
        assert!(of(Completion, r#"{"prompt":[1,-2]}"#).is_err_and(|e| e.contains("batch")));
        assert!(of(Completion, r#"{"prompt":[1,"a"]}"#).is_err_and(|e| e.contains("batch")));
        assert!(of(Completion, r#"{"prompt":{"a":[1]}}"#).is_err_and(|e| e.contains("batch")));
        assert_eq!(of(Completion, r#"{"prompt":[]}"#), Ok(Ok(vec![])));
        assert_eq!(
            of(
                Completion,
                r#"{"prompt": [ 7 ,8,
 4294967295 ] }"#
            ),
            Ok(Ok(vec![7, 8, u32::MAX]))
        );
        assert!(of(Completion, r#"{"prompt":[4294967296]}"#).is_err_and(|e| e.contains("batch")));
        assert!(of(Completion, r#"{"prompt":[1.5]}"#).is_err_and(|e| e.contains("batch")));
        assert!(of(Completion, r#"{"prompt":null}"#).is_err_and(|e| e == "no prompt"));
        assert!(of(Completion, r#"{"prompt":[1],"prompt_embeds":"x"}"#).is_err_and(|e| e == "prompt_embeds"));
        assert_eq!(of(Completion, r#"{"prompt":[1],"prompt_embeds":null}"#), Ok(Ok(vec![1])));
        assert!(of(Completion, r#"{}"#).is_err_and(|e| e == "no prompt"));
        let chat = r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#;
        assert_eq!(
            of(Chat, chat),
            Ok(Err(r#"chat true [{"role":"user","content":"x"}] Some("[{\"type\":\"function\"}]")"#.into()))
        );
        let no_prompt = r#"{"messages":[],"add_generation_prompt":false,"tools":null}"#;
        assert_eq!(of(Chat, no_prompt), Ok(Err("chat false [] None".into())));
        // What only the engine's rendering follows goes to its /tokenize, as sent.
        for (fields, body) in [
            (r#"{"chat_template":"{{x}}"}"#, r#"{"messages":[],"chat_template":"{{x}}"}"#),
            (r#"{"continue_final_message":true}"#, r#"{"messages":[],"continue_final_message":true}"#),
            (r#"{"add_special_tokens":true}"#, r#"{"messages":[],"add_special_tokens":true}"#),
            (
                r#"{"chat_template_kwargs":{"enable_thinking":false}}"#,
                r#"{"messages":[],"chat_template_kwargs":{"enable_thinking":false}}"#,
            ),
        ] {
            assert_eq!(of(Chat, body), Ok(Err(format!("engine {fields}"))), "{body}");
        }
        assert_eq!(of(Chat, r#"{"messages":"hi"}"#), Err("no messages".into()));
        assert_eq!(of(Chat, r#"{"messages":[],"mm_processor_kwargs":{}}"#), Err("mm_processor_kwargs".into()));
    }
}
