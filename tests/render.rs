//! Prompts into tokens as `transformers` makes them, the way vLLM uses it: three model folders
//! (`tests/fixtures/render`: tokenizers trained there, the chat templates of ChatML models, of
//! Llama 3 as transformers 5 saves it beside the config, and of Qwen 2.5 with tools) and 1,050
//! prompts and conversations with the ids Python's `transformers` 5.25 gave them
//! (`make_fixtures.py` there): Unicode, emoji, long prompts, empty messages, text that looks
//! like special tokens or template syntax. Each is rendered twice, the second time from the
//! pieces of text the renderer kept (`render/pieces.rs`).

use std::path::Path;

use serde_json::Value;
use superfluid_warm::{Error, Renderer};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/render");

/// (prompts, those whose ids differ, a few of them), each prompt rendered twice: the second time
/// from the pieces the renderer kept of the first.
fn parity(model: &str) -> (usize, usize, Vec<String>) {
    let dir = Path::new(DIR).join(model);
    let renderer = Renderer::open(&dir).expect("the model's folder");
    let text = std::fs::read_to_string(dir.join("prompts.jsonl")).expect("the prompts");
    let (mut n, mut differ, mut shown) = (0, 0, Vec::new());
    for line in text.lines().chain(text.lines()) {
        let v: Value = serde_json::from_str(line).expect("a JSON line");
        let want: Vec<u32> = serde_json::from_value(v["ids"].clone()).expect("ids");
        let got = match v.get("completion") {
            Some(prompt) => renderer.completion(prompt.as_str().expect("a prompt"), true),
            None => renderer.chat(v["messages"].as_str().expect("messages"), v["tools"].as_str(), true),
        };
        n += 1;
        if got.as_ref().ok() != Some(&want) {
            differ += 1;
            if shown.len() < 3 {
                let rendered = v["messages"].as_str().map(|m| renderer.render_chat(m, v["tools"].as_str(), true));
                shown.push(format!("{line:.300}\n  got {got:?}\n  rendered {rendered:?}"));
            }
        }
    }
    // Every prompt over a piece long was cut, and the second pass found its pieces kept.
    let long = text.lines().filter(|l| l.len() > 4096).count() as u64;
    let reused = renderer.pieces_reused().expect("byte-level BPE encodes in pieces");
    assert!(long > 20 && reused >= long, "{model}: {reused} pieces reused, {long} long prompts");
    (n, differ, shown)
}

#[test]
fn completions_and_chats_give_the_ids_transformers_gives() {
    for model in ["chatml", "llama3", "qwen25"] {
        let (n, differ, shown) = parity(model);
        assert_eq!(n, 700, "{model}: the fixture's prompts, twice");
        assert!(differ == 0, "{model}: {differ} of {n} differ:\n{}", shown.join("\n"));
    }
}

/// Content as a list of text parts is their texts joined by newlines (vLLM's rule); a part that
/// is not text, messages that are not an array, or a template's own exception are typed errors.
#[test]
fn text_parts_are_joined_and_what_cannot_be_rendered_is_a_typed_error() {
    let renderer = Renderer::open(Path::new(DIR).join("chatml")).expect("the model's folder");
    let parts = r#"[{"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]}]"#;
    let joined = r#"[{"role": "user", "content": "a b\nc"}]"#;
    assert_eq!(renderer.chat(parts, None, true).ok(), Some(renderer.chat(joined, None, true).expect("renders")));
    let image = r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]"#;
    for bad in [image, "{}", "not json"] {
        assert!(matches!(renderer.chat(bad, None, true), Err(Error::Render { .. })), "{bad}");
    }
    let llama = Renderer::open(Path::new(DIR).join("llama3")).expect("the model's folder");
    assert_eq!(
        llama.render_chat(r#"[{"role": "user", "content": " hi "}]"#, None, false).ok().as_deref(),
        Some("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
    );
    let dir = tempfile::tempdir().expect("a folder");
    assert!(matches!(Renderer::open(dir.path()), Err(Error::InvalidConfig { .. })), "no tokenizer.json");
    // A template's own exception, and `strftime_now` (UTC), as transformers runs them.
    std::fs::copy(Path::new(DIR).join("chatml/tokenizer.json"), dir.path().join("tokenizer.json")).expect("copy");
    let config = |template: &str| {
        let text = serde_json::json!({"chat_template": template}).to_string();
        std::fs::write(dir.path().join("tokenizer_config.json"), text).expect("write");
        Renderer::open(dir.path()).expect("the model's folder")
    };
    let raising = config("{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}ok");
    assert_eq!(raising.render_chat(r#"[{"role": "user", "content": "a"}]"#, None, true).ok().as_deref(), Some("ok"));
    let two = r#"[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]"#;
    assert!(
        matches!(raising.render_chat(two, None, true), Err(Error::Render { detail }) if detail.contains("one message only"))
    );
    let dated = config("{{ strftime_now('%Y') }}");
    let year: u32 = dated.render_chat("[]", None, true).expect("renders").parse().expect("a year");
    assert!((2026..2200).contains(&year), "{year}");
    let bad = config("{{ strftime_now('%Z') }}");
    assert!(matches!(bad.render_chat("[]", None, true), Err(Error::Render { .. })));
}

/// vLLM's rules before the template: a message without content (or null) has the empty string,
/// and a `developer` message is a system message, merged with the others into one at the start,
/// unless the template names the `developer` role.
#[test]
fn missing_content_and_the_developer_role_render_as_vllm_renders_them() -> Result<(), Error> {
    let chatml = Renderer::open(Path::new(DIR).join("chatml"))?;
    let render = |r: &Renderer, messages: &str| r.render_chat(messages, None, true);
    assert_eq!(
        render(&chatml, r#"[{"role":"user","content":"a"},{"role":"assistant","content":null},{"role":"assistant"}]"#)?,
        render(
            &chatml,
            r#"[{"role":"user","content":"a"},{"role":"assistant","content":""},{"role":"assistant","content":""}]"#
        )?
    );
    assert_eq!(
        render(&chatml, r#"[{"role":"developer","content":"be brief","tools":[]},{"role":"user","content":"u"}]"#)?,
        render(&chatml, r#"[{"role":"system","content":"be brief"},{"role":"user","content":"u"}]"#)?
    );
    assert_eq!(
        render(
            &chatml,
            r#"[{"role":"system","content":"s"},{"role":"user","content":"u"},{"role":"developer","content":"d"},{"role":"system","content":""}]"#
        )?,
        render(&chatml, r#"[{"role":"system","content":"s\n\nd"},{"role":"user","content":"u"}]"#)?
    );
    // A template that names the role keeps it.
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::copy(Path::new(DIR).join("chatml/tokenizer.json"), dir.path().join("tokenizer.json")).expect("copy");
    let template =
        "{% for m in messages %}{% if m.role == 'developer' %}DEV:{% endif %}{{ m.role }}={{ m.content }};{% endfor %}";
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template}).to_string(),
    )
    .expect("write");
    let named = Renderer::open(dir.path())?;
    assert_eq!(render(&named, r#"[{"role":"developer","content":"d"},{"role":"user"}]"#)?, "DEV:developer=d;user=;");
    Ok(())
}
