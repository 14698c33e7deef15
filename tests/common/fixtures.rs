//! The recorded queries and answers of a migration's fixtures (see each folder's NOTE.md): the
//! prompts of the shared trace's first requests, cut to 20 blocks (every fourth in a 151,936
//! vocabulary, every fifth under a tenant), whole, cut to 7 blocks and with block 5 changed;
//! and the 400 queries of the 0.1.7 fixture, answered through the imported entries.

use std::path::Path;

use serde::Deserialize;
use superfluid_warm::{Hit, Namespace};

#[derive(Deserialize)]
struct Answer {
    node: String,
    tokens: usize,
}

#[derive(Deserialize)]
struct Recorded {
    request: usize,
    variant: String,
    answer: Option<Answer>,
    /// `warm_nodes`, where the fixture recorded it.
    #[serde(default)]
    nodes: Option<Vec<Answer>>,
}

#[derive(Deserialize)]
struct LegacyRecorded {
    query: usize,
    answer: Option<Answer>,
}

#[derive(Deserialize)]
struct LegacyQuery {
    model: String,
    tokens: Vec<u32>,
}

/// One recorded query: its namespace and tokens, and what the build that wrote the fixture
/// answered (`warmest`, and `warm_nodes` where recorded).
pub struct Query {
    pub namespace: Namespace,
    pub tokens: Vec<u32>,
    pub warmest: Option<Hit>,
    pub warm_nodes: Option<Vec<Hit>>,
}

fn hit(a: Answer) -> Hit {
    Hit::new(a.node, a.tokens)
}

/// Every query recorded in `dir`'s `answers.jsonl` and `legacy-answers.jsonl`.
pub fn queries(dir: &Path) -> Vec<Query> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let requests = harness::trace::read(&root.join("traces/mooncake-conversation.jsonl")).expect("the trace");
    let shared = Namespace::new("fixture-model").expect("namespace");
    let tenant = Namespace::with_tenant("fixture-model", b"tenant-a").expect("namespace");
    let mut out = Vec::new();
    let text = std::fs::read_to_string(dir.join("answers.jsonl")).expect("answers");
    for line in text.lines() {
        let r: Recorded = serde_json::from_str(line).expect("an answer line");
        let mut tokens = requests[r.request].tokens();
        tokens.truncate(64 * 20);
        if r.request % 4 == 1 {
            tokens.iter_mut().for_each(|t| *t %= 151_936);
        }
        match r.variant.as_str() {
            "whole" => {}
            "cut7" => tokens.truncate(7 * 64),
            "changed5" if tokens.len() > 5 * 64 => tokens[5 * 64] ^= 1,
            "changed5" => {}
            other => panic!("unknown variant {other}"),
        }
        let namespace = if r.request % 5 == 2 { tenant.clone() } else { shared.clone() };
        let warm_nodes = r.nodes.map(|n| n.into_iter().map(hit).collect());
        out.push(Query { namespace, tokens, warmest: r.answer.map(hit), warm_nodes });
    }
    let legacy =
        std::fs::read_to_string(root.join("migrations/0001-from-0.1.7-json/queries.jsonl")).expect("0.1.7 queries");
    let legacy: Vec<LegacyQuery> = legacy.lines().map(|l| serde_json::from_str(l).expect("a query")).collect();
    let text = std::fs::read_to_string(dir.join("legacy-answers.jsonl")).expect("legacy answers");
    for line in text.lines() {
        let r: LegacyRecorded = serde_json::from_str(line).expect("a legacy answer line");
        let q = &legacy[r.query];
        let namespace = Namespace::new(&q.model).expect("namespace");
        out.push(Query { namespace, tokens: q.tokens.clone(), warmest: r.answer.map(hit), warm_nodes: None });
    }
    out
}
