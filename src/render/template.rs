//! A chat template run as `transformers` runs it (`utils/chat_template_utils.py`): Jinja with
//! blocks trimmed and left-stripped, `raise_exception`, `strftime_now` (the time in UTC, as an
//! engine in a container has it), a `tojson` that writes as Python's `json.dumps` (its
//! `indent`, `separators`, `ensure_ascii`, `sort_keys`), loop controls, and Python's string,
//! list and dict methods (minijinja's Python compatibility). The tokenizer's special tokens are
//! variables beside `messages`, `tools` and `add_generation_prompt`.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Rest};
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
        env.add_function("strftime_now", |format: String| {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            strftime(&format, now)
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

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, `indent` also the first positional argument.
fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let invalid = |what: String| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}"));
    let positional: Option<usize> = match args.first() {
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v.clone()).map_err(|e| invalid(e.to_string()))?),
        None => None,
    };
    if args.len() > 1 {
        return Err(invalid("at most one positional argument (indent)".into()));
    }
    let indent: Option<usize> = kwargs.get::<Option<usize>>("indent")?.or(positional);
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let options = json::Options {
        indent,
        separators: match separators.as_deref() {
            Some([item, key]) => Some((item.clone(), key.clone())),
            Some(_) => return Err(invalid("separators are (item, key)".into())),
            None => None,
        },
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let text = json::dumps(&value, &options).map_err(invalid)?;
    Ok(Value::from_safe_string(text))
}

/// Python's `time.strftime(format)` of `secs` since the epoch, in UTC, for the directives chat
/// templates use (`%d %m %Y %y %b %B %a %A %H %I %M %S %p %j %%`); another is an error.
fn strftime(format: &str, secs: u64) -> std::result::Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let days = secs / 86_400;
    let (year, month, day) = civil(days);
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    let month_name = MONTHS.get(usize::try_from(month).unwrap_or(0).saturating_sub(1)).copied().unwrap_or("");
    let day_name = DAYS.get(usize::try_from(days % 7).unwrap_or(0)).copied().unwrap_or("");
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(month_name.get(..3).unwrap_or(month_name)),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(day_name.get(..3).unwrap_or(day_name)),
            Some('A') => out.push_str(day_name),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: the directive %{} is not rendered",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// The (year, month, day) of `days` since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil(days: u64) -> (i64, u64, u64) {
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, u64::try_from(month).unwrap_or(1), u64::try_from(day).unwrap_or(1))
}

/// Days since 1970-01-01 of a date (`days_from_civil`).
fn days_from_civil(year: i64, month: u64, day: u64) -> u64 {
    let year = year - i64::from(month <= 2);
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let m = i64::try_from(month).unwrap_or(1);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::try_from(day).unwrap_or(1) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    u64::try_from(era * 146_097 + doe - 719_468).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_writes_pythons_directives_in_utc() {
        // 2024-07-26 13:25:09 UTC, a Friday, the 208th day (as Python writes it).
        let t = 1_722_000_309;
        assert_eq!(strftime("%d %b %Y", t).ok().as_deref(), Some("26 Jul 2024"));
        assert_eq!(
            strftime("%A %B %d %y %H:%M:%S %I%p %j %%", t).ok().as_deref(),
            Some("Friday July 26 24 13:25:09 01PM 208 %")
        );
        assert_eq!(strftime("%d-%m-%Y %a", 0).ok().as_deref(), Some("01-01-1970 Thu"));
        assert_eq!(strftime("%d %b %Y", 951_782_400).ok().as_deref(), Some("29 Feb 2000"));
        assert!(strftime("%Z", t).is_err());
    }
}
