//! Values written as Python's `json.dumps` writes them (what a chat template's `tojson` gives
//! under `transformers`, whose default is `ensure_ascii=False`): `", "` and `": "` between
//! items, or with an indent a newline and that many spaces a level and `","` and `": "`, unless
//! other separators are given; strings with `"`, `\` and control characters escaped (with
//! `ensure_ascii`, every character past ASCII too, as `\uXXXX`, surrogate pairs past U+FFFF);
//! floats as Python's `repr`; keys in insertion order unless sorted, a key that is not a string
//! written as Python makes it one.

use minijinja::Value;
use minijinja::value::ValueKind;

/// `json.dumps`' arguments.
#[derive(Clone, Debug, Default)]
pub(super) struct Options {
    pub indent: Option<usize>,
    /// (between items, between a key and its value).
    pub separators: Option<(String, String)>,
    pub ensure_ascii: bool,
    pub sort_keys: bool,
}

/// `value` as JSON text; `Err` names what Python's `json` would refuse.
pub(super) fn dumps(value: &Value, options: &Options) -> Result<String, String> {
    let mut out = String::new();
    write(&mut out, value, options, 0)?;
    Ok(out)
}

fn write(out: &mut String, value: &Value, options: &Options, depth: usize) -> Result<(), String> {
    let key_sep = options.separators.as_ref().map_or(": ", |s| s.1.as_str());
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => number(out, value)?,
        ValueKind::String => string(out, value.as_str().unwrap_or_default(), options.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
            open_close(out, ('[', ']'), items.len(), options, depth, |out, i| {
                let item = items.get(i).cloned().unwrap_or_default();
                write(out, &item, options, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
            if options.sort_keys {
                keys.sort();
            }
            open_close(out, ('{', '}'), keys.len(), options, depth, |out, i| {
                let key = keys.get(i).cloned().unwrap_or_default();
                // As Python makes a key of a value that is not a string.
                let text = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
                    ValueKind::Number => {
                        let mut n = String::new();
                        number(&mut n, &key)?;
                        n
                    }
                    other => return Err(format!("a key of kind {other:?} is not JSON serializable")),
                };
                string(out, &text, options.ensure_ascii);
                out.push_str(key_sep);
                let item = value.get_item(&key).map_err(|e| e.to_string())?;
                write(out, &item, options, depth + 1)
            })?;
        }
        other => return Err(format!("a value of kind {other:?} is not JSON serializable")),
    }
    Ok(())
}

/// Writes `n` items between `open` and `close`, as Python lays them out.
fn open_close(
    out: &mut String,
    (open, close): (char, char),
    n: usize,
    options: &Options,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), String>,
) -> Result<(), String> {
    let indent = options.indent;
    let item_sep = options.separators.as_ref().map_or(if indent.is_some() { "," } else { ", " }, |s| s.0.as_str());
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..n {
        if i > 0 {
            out.push_str(item_sep);
        }
        if let Some(w) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(w * (depth + 1)));
        }
        item(out, i)?;
    }
    if let Some(w) = indent {
        out.push('\n');
        out.push_str(&" ".repeat(w * depth));
    }
    out.push(close);
    Ok(())
}

fn string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        if ensure_ascii && !c.is_ascii() {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
            continue;
        }
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// An integer as its digits; a float as Python's `repr` (`1.0`, `0.1`, `1e+16`, `1e-05`), and
/// `NaN`, `Infinity`, `-Infinity` as `json.dumps` allows them.
fn number(out: &mut String, value: &Value) -> Result<(), String> {
    if value.is_integer() {
        out.push_str(&value.to_string());
        return Ok(());
    }
    let x = f64::try_from(value.clone()).map_err(|e| e.to_string())?;
    out.push_str(&py_float(x));
    Ok(())
}

fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // The shortest digits that read back as `x`, and their exponent.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        // Positional, as Python writes this range, with a fraction always.
        let s = format!("{x}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_written_as_pythons_json_dumps_writes_them() {
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, true, null], "a": "x\"y\n\u0001é😀", "c": {}}"#).expect("JSON");
        let plain = Options::default();
        assert_eq!(dumps(&v, &plain).as_deref(), Ok(r#"{"b": [1, 2.5, true, null], "a": "x\"y\n\u0001é😀", "c": {}}"#));
        let sorted = Options { sort_keys: true, ..Options::default() };
        assert_eq!(
            dumps(&v, &sorted).as_deref(),
            Ok(r#"{"a": "x\"y\n\u0001é😀", "b": [1, 2.5, true, null], "c": {}}"#)
        );
        let ascii = Options { ensure_ascii: true, ..Options::default() };
        assert_eq!(dumps(&Value::from("é😀"), &ascii).as_deref(), Ok(r#""\u00e9\ud83d\ude00""#));
        let nested: Value = serde_json::from_str(r#"{"k": [1, {"x": []}]}"#).expect("JSON");
        let indented = Options { indent: Some(2), ..Options::default() };
        assert_eq!(
            dumps(&nested, &indented).as_deref(),
            Ok("{\n  \"k\": [\n    1,\n    {\n      \"x\": []\n    }\n  ]\n}")
        );
        let compact = Options { separators: Some((",".into(), ":".into())), ..Options::default() };
        assert_eq!(dumps(&nested, &compact).as_deref(), Ok(r#"{"k":[1,{"x":[]}]}"#));
        let keys = Value::from_iter([
            (Value::from(()), Value::from(1)),
            (Value::from(true), Value::from(2)),
            (Value::from(3), Value::from(3)),
        ]);
        assert_eq!(dumps(&keys, &plain).as_deref(), Ok(r#"{"null": 1, "true": 2, "3": 3}"#));
        for (x, python) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1e-5, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (123.456, "123.456"),
        ] {
            assert_eq!(py_float(x), python, "{x}");
        }
    }
}
