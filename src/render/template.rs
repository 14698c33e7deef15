//! A chat template run as `transformers` runs it (`utils/chat_template_utils.py`): Jinja with
//! blocks trimmed and left-stripped, `raise_exception`, a `tojson` that writes as Python's
//! `json.dumps(ensure_ascii=False)`, loop controls, and Python's string, list and dict methods
//! (minijinja's Python compatibility). The tokenizer's special tokens are variables beside
//! `messages`, `tools` and `add_generation_prompt`.

use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, Value};

use super::{json, render};
use crate::error::Result;

/// The template's name in its environment.
const NAME: &str = "chat";

/// A compiled chat template and the variables every render gets.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    specials: Vec<(String, String)>,
}

impl ChatTemplate {
    /// Compiles `source`; `specials` are the tokenizer's special tokens (`bos_token`, ...).
    pub(super) fn new(source: String, specials: Vec<(String, String)>) -> std::result::Result<Self, minijinja::Error> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source)?;
        Ok(ChatTemplate { env, specials })
    }

    /// Renders `messages` (and `tools`).
    pub(super) fn render(&self, messages: Value, tools: Option<Value>, add_generation_prompt: bool) -> Result<String> {
        let mut vars: Vec<(String, Value)> =
            self.specials.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect();
        vars.push(("messages".into(), messages));
        vars.push(("tools".into(), tools.unwrap_or(Value::from(()))));
        vars.push(("add_generation_prompt".into(), Value::from(add_generation_prompt)));
        let template = self.env.get_template(NAME).map_err(|e| render(&format!("the chat template ({e})")))?;
        template.render(Value::from_iter(vars)).map_err(|e| render(&format!("the chat template failed ({e})")))
    }
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False, indent=...,
/// sort_keys=...)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let text = json::dumps(&value, indent, sort_keys.unwrap_or(false))
        .map_err(|what| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}")))?;
    Ok(Value::from_safe_string(text))
}
