//! A request's prompt in the engine's tokens: token ids as given; text and chats rendered and
//! tokenized as vLLM does (the model's folder through `Renderer`, or else an engine's
//! `/tokenize`). What cannot be rendered the same way is said, and routed on load alone.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::Head;
use super::proxy::post_json;

/// Which API a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

/// A prompt's tokens, or why there are none.
pub(crate) enum Tokens {
    /// The engine's tokens, and how long making them took (`None`: given as ids).
    Ids(Vec<u32>, Option<Duration>),
    /// Not rendered: why.
    Unrendered(String),
}

/// What to render: a completion's text, or a chat.
enum Source {
    Text { prompt: String, add_special_tokens: bool },
    Chat { messages: String, tools: Option<String>, add_generation_prompt: bool },
}

/// How long an engine's `/tokenize` may take.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// The request's prompt in the engine's tokens.
pub(crate) async fn tokens(head: &Arc<Head>, kind: Kind, body: &Value) -> Tokens {
    let source = match source(kind, body) {
        Ok(Ok(ids)) => return Tokens::Ids(ids, None),
        Ok(Err(source)) => source,
        Err(why) => return Tokens::Unrendered(why),
    };
    let started = Instant::now();
    let rendered = if head.renderer.is_some() {
        let head = Arc::clone(head);
        tokio::task::spawn_blocking(move || {
            let Some(r) = head.renderer.as_ref() else { return Err("no tokenizer".to_string()) };
            match &source {
                Source::Text { prompt, add_special_tokens } => r.completion(prompt, *add_special_tokens),
                Source::Chat { messages, tools, add_generation_prompt } => {
                    r.chat(messages, tools.as_deref(), *add_generation_prompt)
                }
            }
            .map_err(|e| format!("render: {e}"))
        })
        .await
        .unwrap_or_else(|e| Err(format!("render: {e}")))
    } else {
        engine_tokenize(head, &source).await
    };
    match rendered {
        Ok(ids) => Tokens::Ids(ids, Some(started.elapsed())),
        Err(why) => Tokens::Unrendered(why),
    }
}

/// The prompt as token ids (`Ok(Ok)`), as what to render (`Ok(Err)`), or why it cannot be
/// rendered as the engine will (`Err`).
fn source(kind: Kind, body: &Value) -> Result<Result<Vec<u32>, Source>, String> {
    let set = |key: &str| body.get(key).is_some_and(|v| !v.is_null());
    match kind {
        Kind::Completion => {
            if set("prompt_embeds") {
                return Err("prompt_embeds".into());
            }
            if set("truncate_prompt_tokens") {
                return Err("truncate_prompt_tokens".into());
            }
            let add_special_tokens = body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(true);
            let prompt = match body.get("prompt") {
                Some(Value::Array(items)) if items.len() == 1 => items.first(),
                other => other,
            };
            match prompt {
                Some(Value::String(text)) => Ok(Err(Source::Text { prompt: text.clone(), add_special_tokens })),
                Some(Value::Array(ids)) => ids
                    .iter()
                    .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .map(Ok)
                    .ok_or_else(|| "a batch of prompts".to_string()),
                _ => Err("no prompt".into()),
            }
        }
        Kind::Chat => {
            for key in ["chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs"] {
                if set(key) {
                    return Err(key.into());
                }
            }
            if body.get("continue_final_message").and_then(Value::as_bool) == Some(true) {
                return Err("continue_final_message".into());
            }
            if body.get("add_special_tokens").and_then(Value::as_bool) == Some(true) {
                return Err("add_special_tokens".into());
            }
            let Some(messages @ Value::Array(_)) = body.get("messages") else { return Err("no messages".into()) };
            Ok(Err(Source::Chat {
                messages: messages.to_string(),
                tools: body.get("tools").filter(|t| !t.is_null()).map(Value::to_string),
                add_generation_prompt: body.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true),
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
        Source::Chat { messages, tools, add_generation_prompt } => {
            let parse = |s: &str| serde_json::from_str::<Value>(s).unwrap_or(Value::Null);
            let mut r = json!({"model": head.model, "messages": parse(messages), "add_generation_prompt": add_generation_prompt});
            if let (Some(tools), Some(map)) = (tools, r.as_object_mut()) {
                map.insert("tools".into(), parse(tools));
            }
            r
        }
    };
    let (status, answer) = post_json(&engine.authority, "/tokenize", &request, TOKENIZE_TIMEOUT)
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
