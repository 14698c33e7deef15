//! Values written as Python's `json.dumps(value, ensure_ascii=False)` writes them (what a chat
//! template's `tojson` gives under `transformers`): `", "` and `": "` between items, or with an
//! indent a newline and that many spaces a level and `","` and `": "`; strings with only `"`,
//! `\` and control characters escaped; floats as Python's `repr`; keys in insertion order
//! unless sorted.

use minijinja::Value;
use minijinja::value::ValueKind;

/// `value` as JSON text; `Err` names what Python's `json` would refuse.
pub(super) fn dumps(value: &Value, indent: Option<usize>, sort_keys: bool) -> Result<String, String> {
    let mut out = String::new();
    write(&mut out, value, indent, sort_keys, 0)?;
    Ok(out)
}

fn write(out: &mut String, value: &Value, indent: Option<usize>, sort_keys: bool, depth: usize) -> Result<(), String> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => number(out, value)?,
        ValueKind::String => string(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
            open_close(out, ('[', ']'), items.len(), indent, depth, |out, i| {
                let item = items.get(i).cloned().unwrap_or_default();
                write(out, &item, indent, sort_keys, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
            if sort_keys {
                keys.sort();
            }
            open_close(out, ('{', '}'), keys.len(), indent, depth, |out, i| {
                let key = keys.get(i).cloned().unwrap_or_default();
                match key.as_str() {
                    Some(k) => string(out, k),
                    None => string(out, &key.to_string()),
                }
                out.push_str(": ");
                let item = value.get_item(&key).map_err(|e| e.to_string())?;
                write(out, &item, indent, sort_keys, depth + 1)
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
    indent: Option<usize>,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), String>,
) -> Result<(), String> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..n {
        match indent {
            Some(w) => {
                if i > 0 {
                    out.push(',');
                }
                out.push('\n');
                out.push_str(&" ".repeat(w * (depth + 1)));
            }
            None if i > 0 => out.push_str(", "),
            None => {}
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

fn string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
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
        assert_eq!(
            dumps(&v, None, false).as_deref(),
            Ok(r#"{"b": [1, 2.5, true, null], "a": "x\"y\n\u0001é😀", "c": {}}"#)
        );
        assert_eq!(
            dumps(&v, None, true).as_deref(),
            Ok(r#"{"a": "x\"y\n\u0001é😀", "b": [1, 2.5, true, null], "c": {}}"#)
        );
        let nested: Value = serde_json::from_str(r#"{"k": [1, {"x": []}]}"#).expect("JSON");
        assert_eq!(
            dumps(&nested, Some(2), false).as_deref(),
            Ok("{\n  \"k\": [\n    1,\n    {\n      \"x\": []\n    }\n  ]\n}")
        );
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
