//! What an operator watches: the library's `tracing` events and `metrics` figures, through a
//! real Prometheus recorder and a JSON log subscriber installed as a head installs them; the
//! Grafana dashboard's queries against a real exposition; a replay's counters against its
//! report; a cut NATS link and an engine gap in the log and the metrics; and `listen --metrics`
//! and `stats --prometheus` from the binary.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::Reaped;
use common::Rng;
use common::nats::{NatsServer, Proxy};
use harness::engine_sim::{Publisher, SimEngine};
use harness::replay::{self, Config};
use harness::trace;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use superfluid_warm::{
    EngineEndpoint, Error, Listener, METRICS, MetricKind, ReadIndex, RouteTally, SharedWarm, Sharing, Warm,
    describe_metrics, record_decision, record_gathered, record_load_only,
};

/// The process's recorder (with the library's buckets) and its log lines, installed once for
/// every test of this file: each test names its own nodes and heads.
struct Observed {
    metrics: PrometheusHandle,
    logs: Arc<Mutex<Vec<u8>>>,
}

#[derive(Clone)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A Prometheus builder with the buckets the library asks for.
fn prometheus() -> PrometheusBuilder {
    harness::prometheus::builder().expect("buckets")
}

fn observed() -> &'static Observed {
    static OBSERVED: OnceLock<Observed> = OnceLock::new();
    OBSERVED.get_or_init(|| {
        let metrics = prometheus().install_recorder().expect("a global recorder");
        describe_metrics();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let writer = Logs(Arc::clone(&logs));
        tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_max_level(tracing_subscriber::filter::LevelFilter::DEBUG)
            .with_writer(move || writer.clone())
            .init();
        Observed { metrics, logs }
    })
}

/// Every log line so far, as JSON objects.
fn log_lines() -> Vec<serde_json::Value> {
    let logs = observed().logs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    String::from_utf8(logs)
        .expect("UTF-8 logs")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {l}")))
        .collect()
}

/// Log events whose message starts with `message` and whose field `key` is `value`.
fn logged(level: &str, message: &str, key: &str, value: &str) -> Vec<serde_json::Value> {
    log_lines()
        .into_iter()
        .filter(|l| {
            l["level"] == level
                && l["message"].as_str().is_some_and(|m| m.starts_with(message))
                && l[key].as_str() == Some(value)
        })
        .collect()
}

/// One sample of an exposition.
#[derive(Clone, Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses Prometheus' text format strictly: every line a comment (`# HELP`, `# TYPE` of a
/// known type), blank, or a sample of a declared family with well-formed labels and a number;
/// a histogram's buckets cumulative and ending in `+Inf` equal to its count.
fn parse(text: &str) -> Vec<Sample> {
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let bad = |why: &str| -> ! { panic!("exposition line {}: {why}: {line:?}", n + 1) };
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut words = rest.splitn(3, ' ');
            match (words.next(), words.next(), words.next()) {
                (Some("HELP"), Some(name), Some(_)) if valid_name(name) => {}
                (Some("TYPE"), Some(name), Some(kind)) if valid_name(name) => {
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                        bad("unknown type");
                    }
                    if types.insert(name.to_string(), kind.to_string()).is_some() {
                        bad("a family typed twice");
                    }
                }
                _ => bad("a comment that is neither HELP nor TYPE"),
            }
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| bad("no value"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| bad("a value that is not a number")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => (name, labels(rest.strip_suffix('}').unwrap_or_else(|| bad("unclosed labels")))),
        };
        if !valid_name(name) {
            bad("a bad metric name");
        }
        let family = family(name, &types).unwrap_or_else(|| bad("a sample of no declared family"));
        let kind = &types[&family];
        if kind == "counter" && (value.is_nan() || value < 0.0) {
            bad("a negative counter");
        }
        samples.push(Sample { name: name.to_string(), labels, value });
    }
    check_histograms(&samples, &types);
    samples
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `a="x",b="y"` (with `\"`, `\\` and `\n` escapes).
fn labels(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"").unwrap_or_else(|| panic!("a label without =\": {text:?}"));
        assert!(valid_name(key), "a bad label name {key:?} in {text:?}");
        let (mut value, mut chars, mut end) = (String::new(), after.char_indices(), None);
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, e @ ('"' | '\\'))) => value.push(e),
                    _ => panic!("a bad escape in {text:?}"),
                },
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let end = end.unwrap_or_else(|| panic!("an unclosed label value in {text:?}"));
        assert!(out.insert(key.to_string(), value).is_none(), "a label named twice in {text:?}");
        rest = after.get(end + 1..).unwrap_or_default();
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    out
}

/// The declared family a sample name belongs to (a histogram's `_bucket`, `_sum`, `_count`).
fn family(name: &str, types: &BTreeMap<String, String>) -> Option<String> {
    if types.contains_key(name) {
        return Some(name.to_string());
    }
    ["_bucket", "_sum", "_count"]
        .iter()
        .filter_map(|s| name.strip_suffix(s))
        .find(|f| types.get(*f).is_some_and(|k| k == "histogram" || k == "summary"))
        .map(str::to_string)
}

fn check_histograms(samples: &[Sample], types: &BTreeMap<String, String>) {
    for (family, _) in types.iter().filter(|(_, k)| *k == "histogram") {
        let bucket = format!("{family}_bucket");
        // Per series (its labels but `le`): its buckets (bound, count).
        type Buckets = Vec<(f64, f64)>;
        let mut series: BTreeMap<Vec<(String, String)>, Buckets> = BTreeMap::new();
        for s in samples.iter().filter(|s| s.name == bucket) {
            let le = s.labels.get("le").unwrap_or_else(|| panic!("{bucket} without le"));
            let le: f64 = if le == "+Inf" { f64::INFINITY } else { le.parse().expect("le is a number") };
            let key = s.labels.iter().filter(|(k, _)| *k != "le").map(|(k, v)| (k.clone(), v.clone())).collect();
            series.entry(key).or_default().push((le, s.value));
        }
        for (key, mut buckets) in series {
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{family} {key:?}: buckets not cumulative");
            let count = samples
                .iter()
                .find(|s| {
                    s.name == format!("{family}_count")
                        && s.labels.iter().all(|(k, v)| key.contains(&(k.clone(), v.clone())))
                })
                .map(|s| s.value);
            assert_eq!(buckets.last().map(|b| (b.0, b.1)), count.map(|c| (f64::INFINITY, c)), "{family} {key:?}");
        }
    }
}

/// The value of `name` with labels `labels` (all of them), if exported.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && s.labels.len() == labels.len()
                && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

/// The global recorder's exposition, parsed.
fn exposition() -> Vec<Sample> {
    parse(&observed().metrics.render())
}

/// Waits (up to a minute: the machine may be loaded) until `done`.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn endpoint(node: &str, publisher: &Publisher) -> EngineEndpoint {
    EngineEndpoint::parse(&format!("{node}={},replay={}", publisher.events, publisher.replay), Some("m"))
        .expect("an endpoint")
}

/// Publishes `batches` turns of conversations from `engine`, losing those `lose` picks; returns
/// the last batch's number.
fn publish(engine: &mut SimEngine, publisher: &Publisher, batches: usize, lose: impl Fn(usize) -> bool) -> Option<u64> {
    let (mut rng, mut conversations) = (Rng(11), common::Conversations::new(6));
    for i in 0..batches {
        let (_, prompt) = conversations.turn(&mut rng);
        let batch = engine.run(&prompt);
        publisher.publish(&batch, lose(i)).expect("publish");
        std::thread::sleep(Duration::from_millis(2));
    }
    engine.published.back().map(|b| b.seq)
}

/// A head with node caches, an engine listener with gaps and a sharing head through a real
/// NATS server: then every metric the library declares is exported, the exposition parses,
/// and every query of the Grafana dashboard names only metrics the exposition has.
#[test]
fn every_metric_is_exported_and_the_dashboard_queries_only_real_ones() -> Result<(), Error> {
    observed();
    let dir = common::tempdir();
    // A head with node caches: requests, rans, commits, entries, nodes.
    let mut builder = Warm::builder();
    builder.capacity(4096).node_cache_blocks(256).sync_window(Duration::from_millis(5));
    let warm = Arc::new(builder.open(dir.path().join("dash.redb"))?);
    let (mut rng, mut conversations) = (Rng(3), common::Conversations::new(5));
    for i in 0..60 {
        let (model, prompt) = conversations.turn(&mut rng);
        warm.warmest(model, &prompt)?;
        warm.ran(model, &prompt, &format!("dash-node-{}", i % 3))?;
    }
    warm.sync()?;
    // A forgotten node is named by nothing answered: its gauge goes to 0.
    let held = |node: &str| value(&exposition(), "superfluid_warm_node_held_blocks", &[("node", node)]);
    assert!(held("dash-node-2").is_some_and(|h| h > 0.0), "{:?}", held("dash-node-2"));
    warm.forget_node("dash-node-2")?;
    assert_eq!(held("dash-node-2"), Some(0.0));
    // An engine: batches, one lost in seven (gaps, replays), lag.
    let publisher = Publisher::new(Duration::ZERO)?;
    let listener = Listener::start(Arc::clone(&warm), &[endpoint("dash-gpu", &publisher)], Duration::from_secs(30))?;
    wait_until("the listener to connect", || listener.stats().iter().all(|s| s.connected));
    let mut engine = SimEngine::new(16, 2000, "m", None)?;
    let last = publish(&mut engine, &publisher, 40, |i| i % 7 == 3);
    wait_until("the last batch", || warm.engine_stats().is_ok_and(|s| s.first().and_then(|e| e.last_seq) == last));
    listener.stop();
    warm.sync()?;
    // A sharing head.
    let server = NatsServer::start(&dir.path().join("js"));
    let shared =
        SharedWarm::open(&builder, dir.path().join("shared.redb"), Sharing::nats(&server.url(), "dash", "dash-head"))?;
    for i in 0..10 {
        let (model, prompt) = conversations.turn(&mut rng);
        shared.ran(model, &prompt, &format!("dash-node-{}", i % 3))?;
    }
    shared.sync()?;
    wait_until("the sharing head's figures", || {
        value(&exposition(), "superfluid_warm_share_applied_events_total", &[("head", "dash-head")])
            .is_some_and(|n| n >= 10.0)
    });
    // A routing head's figures (`serve`): requests, a failure and an ejection, predictions
    // against deliveries, decisions routed on load alone, decision and tokenization times.
    let tally = RouteTally::new(&["dash-gpu"]);
    tally.sent(0, true);
    tally.failed(0, "connect");
    tally.ejected(0, false);
    tally.delivered(0, 640, 512, 700);
    record_load_only("late");
    record_decision(Some(Duration::from_micros(300)), Duration::from_micros(40));
    record_gathered(Duration::from_millis(3));

    let samples = exposition();
    let names: BTreeSet<&str> = samples.iter().map(|s| s.name.as_str()).collect();
    for m in METRICS {
        let exported = match m.kind {
            MetricKind::Histogram => names.contains(format!("{}_count", m.name).as_str()),
            _ => names.contains(m.name),
        };
        assert!(exported, "{} is never exported", m.name);
    }
    assert_eq!(value(&samples, "superfluid_warm_share_connected", &[("head", "dash-head")]), Some(1.0));
    // Moved, not only registered.
    for name in [
        "superfluid_warm_commits_total",
        "superfluid_warm_commit_duration_seconds_count",
        "superfluid_warm_file_size_bytes",
    ] {
        assert!(value(&samples, name, &[]).is_some_and(|v| v > 0.0), "{name}");
    }
    let counts = warm.engine_stats()?.remove(0).counts;
    let gpu = [("node", "dash-gpu")];
    assert_eq!(value(&samples, "superfluid_warm_engine_batches_total", &gpu), Some(counts.batches as f64));
    assert!(value(&samples, "superfluid_warm_engine_gaps_total", &[("node", "dash-gpu")]).is_some_and(|g| g >= 1.0));
    assert_eq!(value(&samples, "superfluid_warm_route_mispredicted_total", &gpu), Some(1.0));
    assert_eq!(value(&samples, "superfluid_warm_route_ejected", &gpu), Some(1.0));

    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/grafana/superfluid-warm.json"))
            .expect("the dashboard"),
    )
    .expect("the dashboard is JSON");
    let mut queries = Vec::new();
    collect_exprs(&dashboard, &mut queries);
    assert!(queries.len() >= 20, "the dashboard's queries were found: {}", queries.len());
    let mut named = 0;
    for query in &queries {
        for name in metric_names(query) {
            named += 1;
            assert!(names.contains(name.as_str()), "the dashboard queries {name}, which is not exported: {query}");
        }
    }
    // Every metric the library declares is on the dashboard.
    for m in METRICS {
        assert!(queries.iter().any(|q| q.contains(m.name)), "{} is on no panel", m.name);
    }
    println!("{} samples; the dashboard's {} queries name {named} metrics, all exported", samples.len(), queries.len());
    Ok(())
}

fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v.as_str()) {
                    ("expr", Some(e)) => out.push(e.to_string()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

/// The metric names a PromQL query reads.
fn metric_names(query: &str) -> Vec<String> {
    query
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.starts_with("superfluid_warm_"))
        .map(str::to_string)
        .collect()
}

/// A replay's counters, recorded by a recorder of its own thread, equal what its report says:
/// requests, `ran`s, and the tokens answered warm.
#[test]
fn a_replays_counters_equal_its_report() -> Result<(), Error> {
    observed();
    let dir = common::tempdir();
    let requests = trace::synthetic(600, 40, 9);
    let config = Config { baseline: false, ..Config::default() };
    let recorder = prometheus().build_recorder();
    let handle = recorder.handle();
    let report = metrics::with_local_recorder(&recorder, || -> Result<replay::Report, Error> {
        let warm = Warm::open(dir.path().join("replay.redb"))?;
        let report = replay::run(&warm, &requests, &config, |_| {})?;
        warm.close()?;
        Ok(report)
    })?;
    let samples = parse(&handle.render());
    let count = |name: &str| value(&samples, name, &[]).unwrap_or_else(|| panic!("{name} exported"));
    assert_eq!(count("superfluid_warm_requests_total"), report.requests as f64);
    assert_eq!(count("superfluid_warm_rans_total"), report.requests as f64);
    assert_eq!(count("superfluid_warm_warm_tokens_total"), report.answered_warm_tokens as f64);
    assert!(report.answered_warm_tokens > 0 && report.answered_warm_tokens >= report.warm_tokens, "{report:?}");
    let whole_blocks: u64 = requests.iter().map(|r| (r.input_length as u64) / 64 * 64).sum();
    assert_eq!(count("superfluid_warm_request_tokens_total"), whole_blocks as f64);
    println!(
        "{} requests, {} tokens answered warm ({} routed warm): the counters agree",
        report.requests, report.answered_warm_tokens, report.warm_tokens
    );
    Ok(())
}

/// A sharing head whose link to the server is cut says so in the log (warn) and the metrics
/// (connected 0, one more disconnect), and again when it is back.
#[test]
fn a_cut_nats_link_shows_in_the_log_and_the_metrics() -> Result<(), Error> {
    observed();
    let dir = common::tempdir();
    let server = NatsServer::start(&dir.path().join("js"));
    let proxy = Proxy::to(&server);
    let mut builder = Warm::builder();
    builder.sync_window(Duration::from_millis(10));
    let head = SharedWarm::open(&builder, dir.path().join("cut.redb"), Sharing::nats(&proxy.url(), "cut", "cut-head"))?;
    let connected = || value(&exposition(), "superfluid_warm_share_connected", &[("head", "cut-head")]);
    wait_until("the head to connect", || connected() == Some(1.0));
    assert_eq!(logged("INFO", "NATS connection up", "head", "cut-head").len(), 1);
    proxy.cut();
    wait_until("the cut to be seen", || connected() == Some(0.0));
    let lost = logged("WARN", "NATS connection lost", "head", "cut-head");
    assert_eq!(lost.len(), 1, "{lost:?}");
    let disconnects = value(&exposition(), "superfluid_warm_share_disconnects_total", &[("head", "cut-head")]);
    assert_eq!(disconnects, Some(1.0));
    // Routing goes on: its events are buffered, and shown so.
    let (mut rng, mut conversations) = (Rng(5), common::Conversations::new(3));
    for _ in 0..5 {
        let (model, prompt) = conversations.turn(&mut rng);
        head.ran(model, &prompt, "n")?;
    }
    let buffered = || value(&exposition(), "superfluid_warm_share_buffered_events", &[("head", "cut-head")]);
    wait_until("the buffered events", || buffered() == Some(5.0));
    proxy.heal();
    wait_until("the link to come back", || connected() == Some(1.0));
    assert_eq!(logged("INFO", "NATS connection up", "head", "cut-head").len(), 2);
    // What was buffered is published once the link is back (a publish sent into the cut
    // connection is sent again after its acknowledgement times out: seconds, not a `sync`'s).
    wait_until("the buffer to drain", || buffered() == Some(0.0));
    println!("{}", serde_json::to_string(&lost[0]).unwrap_or_default());
    Ok(())
}

/// An engine whose batches are lost on the way: each gap is logged (warn) and replayed (info),
/// and the metrics count what the index and the listener count.
#[test]
fn an_engine_gap_shows_in_the_log_and_the_metrics() -> Result<(), Error> {
    observed();
    let dir = common::tempdir();
    let warm = Arc::new(Warm::open(dir.path().join("gap.redb"))?);
    let publisher = Publisher::new(Duration::ZERO)?;
    let listener = Listener::start(Arc::clone(&warm), &[endpoint("gap-gpu", &publisher)], Duration::from_secs(30))?;
    wait_until("the listener to connect", || listener.stats().iter().all(|s| s.connected));
    let mut engine = SimEngine::new(16, 2000, "m", None)?;
    let last = publish(&mut engine, &publisher, 30, |i| i == 10 || i == 20);
    wait_until("the last batch", || warm.engine_stats().is_ok_and(|s| s.first().and_then(|e| e.last_seq) == last));
    let stats = listener.stop();
    let counts = warm.engine_stats()?.remove(0).counts;
    assert_eq!((counts.gaps, counts.lost), (2, 0), "{counts:?}");
    let gaps = logged("WARN", "engine stream gap", "node", "gap-gpu");
    let froms: Vec<u64> = gaps.iter().filter_map(|g| g["from"].as_u64()).collect();
    assert_eq!(froms, [9, 19], "{gaps:?}");
    assert_eq!(logged("INFO", "engine gap replayed", "node", "gap-gpu").len(), 2);
    let samples = exposition();
    let node = [("node", "gap-gpu")];
    assert_eq!(value(&samples, "superfluid_warm_engine_gaps_total", &node), Some(2.0));
    assert_eq!(value(&samples, "superfluid_warm_engine_replays_total", &node), Some(stats[0].replays as f64));
    assert_eq!(value(&samples, "superfluid_warm_engine_batches_total", &node), Some(counts.batches as f64));
    assert_eq!(value(&samples, "superfluid_warm_engine_stored_blocks_total", &node), Some(counts.stored as f64));
    assert_eq!(value(&samples, "superfluid_warm_engine_lost_gaps_total", &node), Some(0.0));
    // Nothing per request or per batch at info or above: only the connection, the gaps and
    // their replays.
    let noisy: Vec<_> = log_lines()
        .into_iter()
        .filter(|l| l["node"] == "gap-gpu" && l["level"] != "DEBUG" && l["level"] != "TRACE")
        .filter(|l| {
            let message = l["message"].as_str().unwrap_or_default();
            !["engine stream gap", "engine gap replayed", "engine connected"].iter().any(|m| message.starts_with(m))
        })
        .collect();
    assert!(noisy.is_empty(), "{noisy:?}");
    Ok(())
}

/// A loopback port nothing listens on (as of now).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

/// `GET /metrics` from `addr`, if it answers.
fn scrape(addr: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// `listen --metrics` serves the exposition over HTTP while it follows an engine, its log is
/// JSON lines with `--log-format json`, and `stats --prometheus` prints the same counts from the
/// file once it stopped.
#[test]
fn listen_serves_metrics_and_stats_prints_them_for_a_textfile() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = dir.path().join("listen.redb");
    let publisher = Publisher::new(Duration::ZERO)?;
    let addr = format!("127.0.0.1:{}", free_port());
    let child = Reaped(
        Command::new(common::bin())
            .arg("listen")
            .arg(&path)
            .arg("--engine")
            .arg(format!("gpu-0={},replay={}", publisher.events, publisher.replay))
            .args(["--model", "m", "--status-every", "0", "--log-format", "json", "--metrics", &addr])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn listen"),
    );
    let samples = || scrape(&addr).map(|text| parse(&text)).unwrap_or_default();
    let connected = || value(&samples(), "superfluid_warm_engine_connected", &[("node", "gpu-0")]);
    wait_until("listen to serve its metrics, connected", || connected() == Some(1.0));
    let mut engine = SimEngine::new(16, 2000, "m", None)?;
    let last = publish(&mut engine, &publisher, 25, |_| false).expect("batches");
    let batches = || value(&samples(), "superfluid_warm_engine_batches_total", &[("node", "gpu-0")]);
    wait_until("every batch in the metrics", || batches() == Some((last + 1) as f64));
    wait_until("a commit", || value(&samples(), "superfluid_warm_commits_total", &[]).is_some_and(|c| c >= 1.0));
    let mut child = child;
    let status = Command::new("kill").arg("-TERM").arg(child.0.id().to_string()).status().expect("kill -TERM");
    assert!(status.success());
    let mut stderr = String::new();
    child.0.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("stderr");
    assert!(child.0.wait().expect("listen ends").success(), "{stderr}");
    let events: Vec<serde_json::Value> = stderr.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert!(
        events.iter().any(|e| e["message"] == "engine connected" && e["node"] == "gpu-0" && e["level"] == "INFO"),
        "{stderr}"
    );

    let out = Command::new(common::bin()).arg("stats").arg(&path).arg("--prometheus").output().expect("stats");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let textfile = parse(&String::from_utf8(out.stdout).expect("UTF-8"));
    let gpu = [("node", "gpu-0")];
    assert_eq!(value(&textfile, "superfluid_warm_engine_batches_total", &gpu), Some((last + 1) as f64));
    assert!(value(&textfile, "superfluid_warm_engine_blocks", &gpu).is_some_and(|b| b > 0.0));
    let size = std::fs::metadata(&path).expect("the index file").len();
    assert_eq!(value(&textfile, "superfluid_warm_file_size_bytes", &[]), Some(size as f64));
    assert!(Path::new(&path).exists());
    Ok(())
}

/// A commit whose sync fails: logged as an error that says the I/O error latched (the index
/// must be reopened), and counted.
#[test]
fn a_failed_commit_is_logged_and_counted() -> Result<(), Error> {
    observed();
    let failures = || value(&exposition(), "superfluid_warm_commit_failures_total", &[]).unwrap_or(0.0);
    let before = failures();
    let disk = common::backend::Disk::default();
    let warm = Warm::builder().sync_window(Duration::from_secs(30)).open_with_backend(disk.backend())?;
    let prompt: Vec<u32> = (0..256).collect();
    warm.ran("m", &prompt, "latched-node")?;
    disk.state().fail_syncs = true;
    warm.ran("m", &prompt, "latched-node-2")?;
    let error = warm.sync().expect_err("the sync fails");
    assert!(error.needs_reopen(), "{error}");
    assert!(failures() >= before + 1.0, "counted");
    let latched: Vec<_> = log_lines()
        .into_iter()
        .filter(|l| l["level"] == "ERROR" && l["needs_reopen"] == true)
        .filter(|l| l["message"].as_str().is_some_and(|m| m.starts_with("I/O error latched")))
        .collect();
    assert!(!latched.is_empty(), "logged");
    assert!(latched.iter().all(|l| l["error"].as_str().is_some_and(|e| e.contains("reopen"))), "{latched:?}");
    Ok(())
}
