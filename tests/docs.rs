//! The documents stay true to the code where a test can tell: every redb table they cite exists,
//! and ARCHITECTURE.md stays a map (at most 4,000 words; the narratives live in docs/design.md).

use std::collections::BTreeSet;
use std::path::Path;

/// The documents whose table names must exist.
const DOCS: &[&str] = &["ARCHITECTURE.md", "docs/design.md", "README.md"];

/// Most words ARCHITECTURE.md may have (as `wc -w` counts them).
const MAX_ARCHITECTURE_WORDS: usize = 4_000;

/// A file of the repository, as text.
fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{} is readable: {e}", path.display()))
}

/// The names of the tables `tables` defines: each `TableDefinition::new("…")`'s string.
fn defined_tables(tables: &str) -> BTreeSet<String> {
    tables
        .split("TableDefinition::new(\"")
        .skip(1)
        .filter_map(|rest| rest.split_once('"').map(|(name, _)| name.to_string()))
        .collect()
}

/// Whether `span` is a table name as the documents cite them: `name/vN` (lower-case letters,
/// digits and `_`, then a version), as `prefixes/v2` or `engine_blocks/v7`. A hash scheme's
/// name (`blake3-tree-chain-seg16/v3`) has a `-` and is not one.
fn is_table_name(span: &str) -> bool {
    let Some((name, version)) = span.split_once("/v") else { return false };
    let name_ok = name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    let version_ok = !version.is_empty() && version.chars().all(|c| c.is_ascii_digit());
    name_ok && version_ok
}

/// Every table name cited in backticks in `markdown` (code fences' own lines left out, so that
/// they do not shift which text is inside backticks).
fn cited_tables(markdown: &str) -> BTreeSet<String> {
    let text: String =
        markdown.lines().filter(|l| !l.trim_start().starts_with("```")).flat_map(|l| [l, "\n"]).collect();
    text.split('`').skip(1).step_by(2).map(str::trim).filter(|s| is_table_name(s)).map(str::to_string).collect()
}

/// The tables `docs` (name, text) cite that `defined` lacks, as "file: name".
fn missing(docs: &[(&str, String)], defined: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    for (file, text) in docs {
        for name in cited_tables(text) {
            if !defined.contains(&name) {
                out.push(format!("{file}: `{name}`"));
            }
        }
    }
    out
}

/// Every table ARCHITECTURE.md, docs/design.md and README.md cite in backticks as `name/vN` is
/// a `TableDefinition::new("name/vN")` of src/store/tables.rs.
#[test]
fn every_table_the_docs_cite_exists() {
    let defined = defined_tables(&read("src/store/tables.rs"));
    assert!(defined.len() >= 10, "the table definitions were found: {defined:?}");
    assert!(defined.contains("prefixes/v2"), "the prefix table is among them: {defined:?}");
    let docs: Vec<(&str, String)> = DOCS.iter().map(|&file| (file, read(file))).collect();
    let cited: BTreeSet<String> = docs.iter().flat_map(|(_, text)| cited_tables(text)).collect();
    println!("{} tables defined, {} cited: {cited:?}", defined.len(), cited.len());
    assert!(cited.len() >= 10, "the docs' table names were found: {cited:?}");
    let missing = missing(&docs, &defined);
    assert!(
        missing.is_empty(),
        "tables the docs cite that src/store/tables.rs does not define:\n{}",
        missing.join("\n")
    );
}

/// ARCHITECTURE.md is at most 4,000 words, counted as `wc -w` counts them (runs of
/// non-whitespace).
#[test]
fn architecture_is_at_most_4000_words() {
    let words = read("ARCHITECTURE.md").split_whitespace().count();
    println!("ARCHITECTURE.md: {words} words");
    assert!(words > 500, "ARCHITECTURE.md was read ({words} words)");
    assert!(
        words <= MAX_ARCHITECTURE_WORDS,
        "ARCHITECTURE.md has {words} words, more than {MAX_ARCHITECTURE_WORDS}: narratives go to docs/design.md"
    );
}

/// The scanners see what they should: table definitions, names cited in backticks (across a
/// line break, around a code fence), and not hash scheme names, paths or plain words.
#[test]
fn the_scanners_see_what_they_should() {
    let tables = "pub(crate) const A: TableDefinition<u32, u64> = TableDefinition::new(\"a_b/v4\");\n\
                  const M: TableDefinition<&str, &[u8]> = TableDefinition::new(\"meta\");";
    let defined = defined_tables(tables);
    assert_eq!(defined, BTreeSet::from(["a_b/v4".to_string(), "meta".to_string()]));
    let doc = "`a_b/v4` and `gone/v2`, not a_b/v9 nor `blake3-tree-chain-seg16/v3` nor `docs/design.md`\n\
               ```\nx\n```\nnor `x/v` nor `A/v1`; a span `(node,\n0)` then `node_clocks/v5`";
    let cited = cited_tables(doc);
    let want: BTreeSet<String> = ["a_b/v4", "gone/v2", "node_clocks/v5"].iter().map(|s| s.to_string()).collect();
    assert_eq!(cited, want);
    assert_eq!(missing(&[("doc.md", doc.to_string())], &defined), ["doc.md: `gone/v2`", "doc.md: `node_clocks/v5`"]);
}
