//! The layers of ARCHITECTURE.md: every `crate::` path in a layer's files names only a layer it
//! may use, so the modules form no cycle.

use std::path::Path;

/// What each layer may use besides itself (`error` is usable by all, and uses nothing).
const ALLOWED: &[(&str, &[&str])] = &[
    ("error", &[]),
    ("keys", &["error"]),
    ("render", &["error"]),
    // The decided state knows no storage: the store loads it and persists its effects.
    ("decided", &["error", "keys"]),
    ("store", &["error", "keys", "decided"]),
    // Where a request goes: prices engines from numbers the index and the head give it.
    ("route", &["error", "keys", "decided", "telemetry"]),
    ("telemetry", &["error", "decided"]),
    ("file", &["error", "keys", "decided", "store", "telemetry", "route"]),
    ("index", &["error", "keys", "decided", "store", "file", "telemetry"]),
    ("share", &["error", "keys", "decided", "store", "index", "telemetry"]),
    ("engine", &["error", "keys", "decided", "store", "file", "index", "telemetry"]),
];
/// What sits on top and may use anything: `lib.rs`, and the binary (`src/bin/`, a crate of its
/// own that uses the library through its public API).
const TOP: &[&str] = &["lib", "bin"];

/// The layer a source file belongs to: its folder under `src/`, or its file stem.
fn layer_of(relative: &Path) -> String {
    let first = relative.components().next().map(|c| c.as_os_str().to_string_lossy().into_owned()).unwrap_or_default();
    first.trim_end_matches(".rs").to_string()
}

/// Which layer each name `lib.rs` re-exports at the crate root comes from (`pub use file::…`).
fn root_names(lib: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for statement in lib.split(';') {
        // An attribute (`#[cfg(feature = "nats")]`) may come first.
        let Some(path) = statement.trim().split_once("pub use ").map(|(_, path)| path) else { continue };
        let layer: String = path.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let names = path.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|w| !w.is_empty());
        for name in names.skip(1) {
            out.push((name.to_string(), layer.clone()));
        }
    }
    out
}

/// Every layer named right after `crate::` in the code of `text` (doc and other comments may
/// link anywhere), a root re-export counted as the layer it comes from: `(layer, through the
/// crate root)`. A layer reaches no further through a root re-export than through its path.
fn used_layers(text: &str, roots: &[(String, String)]) -> Vec<(String, bool)> {
    let code: String = text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let text = &code;
        // Words ending in "crate" (`mycrate::`) are not crate paths.
        if text[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[i + "crate::".len()..];
        // `crate::{a::x, B}` names each of its first segments.
        let names: Vec<&str> = match rest.strip_prefix('{') {
            Some(group) => group.split('}').next().unwrap_or_default().split(',').collect(),
            None => vec![rest],
        };
        for name in names {
            let name: String = name.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if let Some((_, layer)) = roots.iter().find(|(root, _)| *root == name) {
                out.push((layer.clone(), true));
            } else if !name.is_empty() {
                out.push((name, false));
            }
        }
    }
    out
}

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src is readable") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_layer_uses_a_layer_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let roots = root_names(&std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs"));
    let (mut checked, mut uses) = (0, 0);
    let mut wrong = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        let layer = layer_of(relative);
        if TOP.contains(&layer.as_str()) {
            continue;
        }
        // A library file in no layer would be checked against nothing: name its layer above.
        let Some((_, allowed)) = ALLOWED.iter().find(|(name, _)| *name == layer) else {
            wrong.push(format!("{} is in no layer of ALLOWED", relative.display()));
            continue;
        };
        checked += 1;
        let text = std::fs::read_to_string(file).expect("utf-8 source");
        for (used, through_root) in used_layers(&text, &roots) {
            uses += 1;
            if used != layer && !allowed.contains(&used.as_str()) {
                let how = if through_root { " (through a root re-export)" } else { "" };
                wrong.push(format!("{} uses crate::{used}{how}", relative.display()));
            }
        }
    }
    println!("{checked} files of {} layers, {uses} crate paths", ALLOWED.len());
    assert!(checked > 20 && uses > 50, "the sources were found ({checked} files, {uses} paths)");
    assert!(wrong.is_empty(), "uses against the layering:\n{}", wrong.join("\n"));
}

/// The decided state decides in memory only: no file of `src/decided/` names redb (outside
/// comments), so what it decides cannot depend on how, or whether, it was stored.
#[test]
fn the_decided_state_knows_no_storage() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/decided");
    let mut files = Vec::new();
    sources(&dir, &mut files);
    assert!(files.len() >= 5, "the decided state's files were found: {files:?}");
    let mut wrong = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("utf-8 source");
        let code = text.lines().filter(|l| !l.trim_start().starts_with("//"));
        for line in code.filter(|l| l.contains("redb")) {
            wrong.push(format!("{}: {}", file.display(), line.trim()));
        }
    }
    assert!(wrong.is_empty(), "the decided state names storage:\n{}", wrong.join("\n"));
}

#[test]
fn the_path_scanner_sees_what_it_should() {
    let roots = root_names("mod a;\npub use file::check::{FileCheck, check_file};\npub use index::warm::Warm;");
    let text = "use crate::store::tables;\nlet x = crate::keys::hex(b);\nlet y = mycrate::nope; // crate::index\n\
                /// [`crate::Warm`]\nlet w: crate::Warm = crate::check_file(p);\nuse crate::{Warm, store::x};\n";
    let used = used_layers(text, &roots);
    let got: Vec<(&str, bool)> = used.iter().map(|(l, r)| (l.as_str(), *r)).collect();
    let want = [
        ("store", false),
        ("keys", false),
        ("index", false),
        ("index", true),
        ("file", true),
        ("index", true),
        ("store", false),
    ];
    assert_eq!(got, want);
    assert_eq!(layer_of(Path::new("index/warm.rs")), "index");
    assert_eq!(layer_of(Path::new("error.rs")), "error");
}
