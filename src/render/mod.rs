//! Prompts into the model's tokens, as vLLM makes them (feature `render`): a completion's text
//! through the model's `tokenizer.json`, a chat's messages through its chat template first. The
//! head routes on the same tokens the engine will hash.
//!
//! vLLM 0.33's rules, from its code: a completion is encoded with the tokenizer's special tokens
//! (`add_special_tokens`, default true: `entrypoints/openai/completion/protocol.py`); a chat is
//! rendered by the model's template (`messages`, `tools`, `add_generation_prompt`, and the
//! tokenizer's special tokens as variables) and the text encoded without them (the template
//! writes its own: `renderers/hf.py`, as `transformers`' `apply_chat_template`); a message
//! whose content is a list of text parts is their texts joined by newlines, and one without
//! content has the empty string (`renderers/chat_utils/chat_message.py`); a `developer` message
//! is a system message unless the template names that role (`renderers/hf.py`). The template runs as `transformers` runs it:
//! blocks trimmed, `raise_exception`, `strftime_now`, a `tojson` that writes as Python's
//! `json.dumps`, and Python's string and dict methods ([`template`]).

mod json;
mod pieces;
mod template;

use std::path::Path;

use minijinja::Value;
use minijinja::value::ValueKind;

use crate::error::{Error, Result};

/// A model's tokenizer and chat template, from its folder.
pub struct Renderer {
    tokenizer: tokenizers::Tokenizer,
    /// The tokenizer's encoding in pieces, with recent texts' pieces kept (`None`: a tokenizer
    /// that encodes whole).
    pieces: Option<pieces::Pieces>,
    /// The chat template, compiled (`None`: the model has none).
    template: Option<template::ChatTemplate>,
    /// Whether the template names the `developer` role (vLLM's test: the word in quotes);
    /// otherwise developer messages are rendered as system messages.
    developer_role: bool,
}

impl std::fmt::Debug for Renderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Renderer").field("chat_template", &self.template.is_some()).finish_non_exhaustive()
    }
}

impl Renderer {
    /// Reads a model's folder: `tokenizer.json`, and `tokenizer_config.json` for the special
    /// tokens and the chat template (its `chat_template`, a string or the list of named
    /// templates whose `default` is taken, or else `chat_template.jinja` beside it, as
    /// `transformers` 5 saves it).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a folder without a readable `tokenizer.json`, a
    /// `tokenizer_config.json` that is not JSON, or a template that does not compile.
    pub fn open(dir: impl AsRef<Path>) -> Result<Renderer> {
        let dir = dir.as_ref();
        let invalid =
            |what: String| Error::InvalidConfig { detail: format!("the tokenizer folder {}: {what}", dir.display()) };
        let text = std::fs::read_to_string(dir.join("tokenizer.json"))
            .map_err(|e| invalid(format!("tokenizer.json does not read ({e})")))?;
        let tokenizer: tokenizers::Tokenizer =
            text.parse().map_err(|e| invalid(format!("tokenizer.json does not load ({e})")))?;
        let pieces = serde_json::from_str(&text).ok().and_then(|json| pieces::Pieces::new(&tokenizer, &json));
        let config: serde_json::Value = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| invalid(format!("tokenizer_config.json: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(invalid(format!("tokenizer_config.json: {e}"))),
        };
        let source = match config.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(t.clone()),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(serde_json::Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(serde_json::Value::as_str))
                .map(str::to_string),
            _ => match std::fs::read_to_string(dir.join("chat_template.jinja")) {
                Ok(t) => Some(t),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(invalid(format!("chat_template.jinja: {e}"))),
            },
        };
        let developer_role =
            source.as_deref().is_some_and(|t| t.contains("\"developer\"") || t.contains("'developer'"));
        let template = source
            .map(|source| template::ChatTemplate::new(source, special_tokens(&config)))
            .transpose()
            .map_err(|e| invalid(format!("the chat template does not compile ({e})")))?;
        Ok(Renderer { tokenizer, pieces, template, developer_role })
    }

    /// A completion's prompt text as the engine tokenizes it (`add_special_tokens`: vLLM's
    /// request field, true unless the client says otherwise).
    ///
    /// # Errors
    /// [`Error::Render`] if the tokenizer fails on it.
    pub fn completion(&self, prompt: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.encode(prompt, add_special_tokens, &mut |_, _, _| {})
    }

    /// [`Renderer::completion`], telling `step` the ids so far, the bytes of the prompt they
    /// encode and the prompt's length as the encoding goes (for a tokenizer that encodes in
    /// pieces: before each piece tokenized but the first; the ids so far start the whole's), so
    /// that a caller can act on the start of a long prompt before the rest is tokenized.
    ///
    /// # Errors
    /// As [`Renderer::completion`].
    pub fn completion_in_steps(
        &self,
        prompt: &str,
        add_special_tokens: bool,
        step: &mut dyn FnMut(&[u32], usize, usize),
    ) -> Result<Vec<u32>> {
        self.encode(prompt, add_special_tokens, step)
    }

    /// A chat's messages (and tools), as JSON text of the request's arrays, rendered by the
    /// model's template and tokenized as the engine does. `add_generation_prompt` as the
    /// request sets it (vLLM's default: true).
    ///
    /// # Errors
    /// [`Error::Render`]: no chat template, messages that are not an array of objects, content
    /// parts that are not text, a template that fails on them.
    pub fn chat(&self, messages: &str, tools: Option<&str>, add_generation_prompt: bool) -> Result<Vec<u32>> {
        self.chat_in_steps(messages, tools, add_generation_prompt, &mut |_, _, _| {})
    }

    /// [`Renderer::chat`], telling `step` the ids so far, the bytes of the rendered text they
    /// encode and its length, as [`Renderer::completion_in_steps`] does.
    ///
    /// # Errors
    /// As [`Renderer::chat`].
    pub fn chat_in_steps(
        &self,
        messages: &str,
        tools: Option<&str>,
        add_generation_prompt: bool,
        step: &mut dyn FnMut(&[u32], usize, usize),
    ) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, tools, add_generation_prompt)?;
        self.encode(&text, false, step)
    }

    /// The text a chat's template renders (see [`Renderer::chat`]).
    ///
    /// # Errors
    /// As [`Renderer::chat`].
    pub fn render_chat(&self, messages: &str, tools: Option<&str>, add_generation_prompt: bool) -> Result<String> {
        let template = self.template.as_ref().ok_or_else(|| render("the model has no chat template"))?;
        let messages: Value =
            serde_json::from_str(messages).map_err(|e| render(&format!("the messages are not JSON ({e})")))?;
        let mut messages = text_contents(messages)?;
        if !self.developer_role {
            messages = developer_as_system(messages);
        }
        let tools: Option<Value> = tools
            .map(serde_json::from_str)
            .transpose()
            .map_err(|e| render(&format!("the tools are not JSON ({e})")))?;
        template.render(messages, tools, add_generation_prompt)
    }

    /// Whether texts are encoded in pieces, and how many pieces were found kept from earlier
    /// texts (not tokenized again); `None` for a tokenizer that encodes whole.
    pub fn pieces_reused(&self) -> Option<u64> {
        self.pieces.as_ref().map(pieces::Pieces::reused)
    }

    fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
        step: &mut dyn FnMut(&[u32], usize, usize),
    ) -> Result<Vec<u32>> {
        let failed = |e: tokenizers::Error| render(&format!("the tokenizer failed ({e})"));
        match &self.pieces {
            Some(pieces) => pieces.encode(&self.tokenizer, text, add_special_tokens, step).map_err(failed),
            None => Ok(self.tokenizer.encode_fast(text, add_special_tokens).map_err(failed)?.get_ids().to_vec()),
        }
    }
}

fn render(detail: &str) -> Error {
    Error::Render { detail: detail.to_string() }
}

/// The tokenizer's special tokens as the template sees them (`bos_token`, `eos_token`, ...):
/// each a string, or an added token's `content`.
fn special_tokens(config: &serde_json::Value) -> Vec<(String, String)> {
    let names = ["bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"];
    names
        .iter()
        .filter_map(|&name| {
            let token = match config.get(name)? {
                serde_json::Value::String(s) => s.clone(),
                other => other.get("content")?.as_str()?.to_string(),
            };
            Some((name.to_string(), token))
        })
        .collect()
}

/// The messages with each content made one string, as vLLM makes it: a list of parts their
/// texts joined by newlines, no content (or null) the empty string; a part that is not text
/// cannot be rendered here.
fn text_contents(messages: Value) -> Result<Value> {
    if messages.kind() != ValueKind::Seq {
        return Err(render("the messages are not an array"));
    }
    let list = messages.try_iter().map_err(|_| render("the messages are not an array"))?;
    let mut out = Vec::new();
    for message in list {
        if message.kind() != ValueKind::Map {
            return Err(render("a message is not an object"));
        }
        let content = message.get_attr("content").unwrap_or_default();
        let text = match content.kind() {
            ValueKind::String => {
                out.push(message);
                continue;
            }
            ValueKind::Undefined | ValueKind::None => String::new(),
            ValueKind::Seq => {
                let mut texts = Vec::new();
                for part in content.try_iter().map_err(|_| render("a message's content parts"))? {
                    let kind = part.get_attr("type").ok().and_then(|t| t.as_str().map(str::to_string));
                    match (kind.as_deref(), part.get_attr("text").ok().and_then(|t| t.as_str().map(str::to_string))) {
                        (Some("text"), Some(text)) => texts.push(text),
                        (kind, _) => {
                            return Err(render(&format!("a content part of type {kind:?} (only text is rendered)")));
                        }
                    }
                }
                texts.join("\n")
            }
            kind => return Err(render(&format!("a message's content of kind {kind}"))),
        };
        out.push(with_field(&message, "content", Some(Value::from(text)))?);
    }
    Ok(Value::from(out))
}

/// `message` with `key` set to `value` (added last if new), or removed (`None`).
fn with_field(message: &Value, key: &str, value: Option<Value>) -> Result<Value> {
    let mut fields: Vec<(Value, Value)> = Vec::new();
    let mut value = value;
    for k in message.try_iter().map_err(|_| render("a message is not an object"))? {
        if k.as_str() == Some(key) {
            if let Some(v) = value.take() {
                fields.push((k, v));
            }
        } else {
            let v = message.get_item(&k).unwrap_or_default();
            fields.push((k, v));
        }
    }
    if let Some(v) = value {
        fields.push((Value::from(key), v));
    }
    Ok(Value::from_iter(fields))
}

/// vLLM's rule for a template that does not name the `developer` role: each developer message
/// becomes a system message (its `tools` dropped); then, if a system message is not first or
/// there are several, their non-empty contents are joined by blank lines into one system
/// message at the start (`renderers/hf.py`).
fn developer_as_system(messages: Value) -> Value {
    let Ok(list) = messages.try_iter() else { return messages };
    let list: Vec<Value> = list.collect();
    let role = |m: &Value| m.get_attr("role").ok().and_then(|r| r.as_str().map(str::to_string));
    if !list.iter().any(|m| role(m).as_deref() == Some("developer")) {
        return messages;
    }
    let converted: Vec<Value> = list
        .iter()
        .map(|m| {
            if role(m).as_deref() != Some("developer") {
                return m.clone();
            }
            with_field(m, "role", Some(Value::from("system")))
                .and_then(|m| with_field(&m, "tools", None))
                .unwrap_or_else(|_| m.clone())
        })
        .collect();
    let systems: Vec<usize> =
        converted.iter().enumerate().filter(|(_, m)| role(m).as_deref() == Some("system")).map(|(i, _)| i).collect();
    let needs = systems.len() > 1 || systems.first().is_some_and(|&i| i > 0);
    if !needs {
        return Value::from(converted);
    }
    let contents: Vec<String> = systems
        .iter()
        .filter_map(|&i| converted.get(i)?.get_attr("content").ok()?.as_str().map(str::to_string))
        .filter(|c| !c.is_empty())
        .collect();
    let merged = Value::from_iter([("role", Value::from("system")), ("content", Value::from(contents.join("\n\n")))]);
    let rest = converted.into_iter().filter(|m| role(m).as_deref() != Some("system"));
    Value::from(std::iter::once(merged).chain(rest).collect::<Vec<_>>())
}
