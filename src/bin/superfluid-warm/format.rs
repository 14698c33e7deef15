//! What several commands share of how their output is written: figures with thousands
//! separators, keys in hex, tier names, and what opening a file did, said on stderr. Knows
//! nothing of the command it is in: the harness's `replay` binary includes this file too.

use std::path::Path;

use superfluid_warm::{Medium, Stats};

/// A medium's name, as vLLM's events spell it.
pub(crate) fn tier_name(m: Medium) -> &'static str {
    match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        Medium::Storage => "STORAGE",
        _ => "other",
    }
}

/// Says on stderr what opening the file as a head did besides opening it: recovering a crashed
/// head's file, upgrading an older schema.
pub(crate) fn say_how_opened(path: &Path, stats: &Stats) {
    if let Some(pid) = stats.recovered_from {
        say_recovered(path, pid);
    }
    if let Some(from) = stats.upgraded_from {
        eprintln!(
            "superfluid-warm: upgraded {} from schema {from} to {} (older builds no longer open it)",
            path.display(),
            superfluid_warm::SCHEMA_VERSION
        );
    }
}

/// Says on stderr that a writing command recovered a crashed head's file.
pub(crate) fn say_recovered(path: &Path, pid: u32) {
    eprintln!(
        "superfluid-warm: recovered {} to its last commit: a head (process {pid}) had left it open",
        path.display()
    );
}

/// Lower-case hex of a key.
pub(crate) fn hex(key: &[u8]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// `n` with a comma between each group of three digits.
pub(crate) fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_are_separated() {
        let shown: Vec<String> = [0, 999, 1_000, 144_793_823].into_iter().map(thousands).collect();
        assert_eq!(shown, ["0", "999", "1,000", "144,793,823"]);
    }
}
