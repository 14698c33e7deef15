//! A sharing head facing a server it cannot use: a malformed URL is refused at open.

use std::time::Duration;

use superfluid_warm::{Builder, Error, SharedWarm, Sharing, Warm};

fn builder() -> Builder {
    let mut b = Warm::builder();
    b.capacity(3_000).sync_window(Duration::from_millis(10));
    b
}

/// A loopback port nothing listens on.
fn dead_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
    format!("nats://127.0.0.1:{port}")
}

#[test]
fn a_malformed_server_url_is_refused_at_open_and_says_what_a_url_looks_like() {
    let dir = tempfile::tempdir().expect("dir");
    for url in ["garbage", "", "http://x", "nats://", "nats://:4222", "127.0.0.1:4222", "nats://h:notaport"] {
        let file = dir.path().join("a.redb");
        match SharedWarm::open(&builder(), &file, Sharing::nats(url, "s", "a")) {
            Err(e @ Error::Sharing { .. }) => {
                let text = e.to_string();
                assert!(text.contains(&format!("{url:?}")), "names the URL it refused: {text}");
                assert!(text.contains("nats://127.0.0.1:4222"), "says what a valid URL looks like: {text}");
            }
            other => panic!("{url:?} is not a NATS server URL, yet open gave {other:?}"),
        }
        assert!(!file.exists(), "{url:?}: refused before the file is made");
    }
    // Well-formed URLs open (nothing listens there: the head routes locally meanwhile).
    for url in [dead_url(), "tls://127.0.0.1:1".to_string(), "nats://localhost".to_string()] {
        let h = SharedWarm::open(&builder(), dir.path().join("ok.redb"), Sharing::nats(&url, "s", "a"))
            .unwrap_or_else(|e| panic!("{url} is a NATS URL: {e}"));
        h.close().expect("close");
    }
}
