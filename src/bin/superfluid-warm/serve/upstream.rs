//! An engine's HTTP/1.1 connections, kept open between requests. A connection is driven by the
//! task of the request that uses it, not by a task of its own: the request is written to the
//! engine by the thread that decided it, with no other thread to wake on the way (waking an idle
//! core costs tens of microseconds, a large part of a decision). Its answer's body keeps driving
//! it, and gives it back once read to its end; a body dropped before its end closes it, which
//! cancels the request in the engine.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// How long a connection is kept unused before it is closed.
const IDLE_FOR: Duration = Duration::from_secs(30);

type Connection = http1::Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// One connection: its request side, and the connection itself (`None` once it ended).
struct Conn {
    sender: SendRequest<Full<Bytes>>,
    connection: Option<Connection>,
}

impl Conn {
    /// Opens one to `authority` (`HOST:PORT`).
    async fn open(authority: &str) -> Result<Conn, SendError> {
        let stream = TcpStream::connect(authority).await.map_err(SendError::Connect)?;
        // A request's bytes go as they are written: a proxy writes whole messages.
        stream.set_nodelay(true).map_err(SendError::Connect)?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.map_err(SendError::Http)?;
        Ok(Conn { sender, connection: Some(connection) })
    }

    /// Does the connection's reads and writes for this task; `Ready` once it ended (closed by
    /// either side, or failed).
    fn drive(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), hyper::Error>> {
        let Some(connection) = self.connection.as_mut() else { return Poll::Ready(Ok(())) };
        let ended = Pin::new(connection).poll(cx);
        if ended.is_ready() {
            self.connection = None;
        }
        ended
    }

    /// Whether it can take the next request: still open (as far as it knows), and its last
    /// exchange over.
    fn ready(&self) -> bool {
        self.connection.is_some() && self.sender.is_ready()
    }

    /// [`Conn::ready`], once it has read what came while it waited (the engine closing it).
    fn still_ready(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        self.drive(&mut cx).is_pending() && self.ready()
    }
}

/// Idle connections, the oldest first.
type Idle = VecDeque<(Conn, Instant)>;

/// An engine's idle connections, the last used first.
#[derive(Default)]
pub(crate) struct Connections {
    idle: Arc<Mutex<Idle>>,
}

/// Why a request did not reach its engine, or had no answer.
pub(crate) enum SendError {
    /// No connection could be opened.
    Connect(std::io::Error),
    /// The connection failed: reset, closed, or an answer that is not HTTP.
    Http(hyper::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (said, mut source): (String, Option<&dyn std::error::Error>) = match self {
            SendError::Connect(e) => (format!("cannot connect: {e}"), std::error::Error::source(e)),
            SendError::Http(e) => (e.to_string(), std::error::Error::source(e)),
        };
        f.write_str(&said)?;
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

impl Connections {
    /// An idle connection that is still open, if there is one; the expired ones closed. The
    /// lock is held only to take one: two threads take and give back connections all the time.
    fn take(&self) -> Option<Conn> {
        loop {
            let (mut conn, _) = {
                let mut idle = self.idle.lock().ok()?;
                while idle.front().is_some_and(|(_, since)| since.elapsed() >= IDLE_FOR) {
                    idle.pop_front();
                }
                idle.pop_back()?
            };
            // One closed by the engine while it waited (a restart) is dropped here.
            if conn.still_ready() {
                return Some(conn);
            }
        }
    }

    /// Sends `request` (its URI a path) to the engine at `authority`, on an idle connection or
    /// a new one, and gives its answer's head, with a body that drives the connection. A
    /// connection kept open may turn out closed by the engine before the request could go: the
    /// request then goes once more, on another.
    ///
    /// # Errors
    /// [`SendError`]: no connection, or it failed before the answer's head.
    pub(crate) async fn send(
        &self,
        authority: &str,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<EngineBody>, SendError> {
        while let Some(conn) = self.take() {
            match self.exchange(conn, copy(&request)).await {
                Err(e) if closed_under_it(&e) => {}
                answer => return answer.map_err(SendError::Http),
            }
        }
        let conn = Conn::open(authority).await?;
        self.exchange(conn, request).await.map_err(SendError::Http)
    }

    /// `request` on `conn`, driven by this task until the answer's head.
    async fn exchange(&self, mut conn: Conn, request: Request<Full<Bytes>>) -> hyper::Result<Response<EngineBody>> {
        let mut answer = std::pin::pin!(conn.sender.send_request(request));
        let mut ended = false;
        let head = std::future::poll_fn(|cx| {
            // The connection first: it writes the request now, on this thread.
            if !ended {
                ended = conn.drive(cx).is_ready();
            }
            answer.as_mut().poll(cx)
        })
        .await?;
        let home = Arc::clone(&self.idle);
        Ok(head.map(|incoming| EngineBody { incoming, conn: Some(conn), home }))
    }
}

/// Whether a connection kept open failed because the engine had closed it (a restart, its
/// keep-alive timeout): closed before the request went or was answered, or reset by the
/// engine's side as the request came to a socket it had closed.
fn closed_under_it(e: &hyper::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    let io = std::error::Error::source(e).and_then(|s| s.downcast_ref::<std::io::Error>());
    e.is_canceled()
        || e.is_closed()
        || e.is_incomplete_message()
        || io.is_some_and(|io| matches!(io.kind(), ConnectionReset | BrokenPipe | ConnectionAborted))
}

/// A request made again, for a connection kept open (its body is shared, not copied).
fn copy(r: &Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    let mut again = Request::new(r.body().clone());
    *again.method_mut() = r.method().clone();
    *again.uri_mut() = r.uri().clone();
    *again.version_mut() = r.version();
    *again.headers_mut() = r.headers().clone();
    again
}

/// An answer's body from an engine. Polling it drives its connection; read to its end, the
/// connection goes back to its engine's idle ones.
pub(crate) struct EngineBody {
    incoming: Incoming,
    conn: Option<Conn>,
    home: Arc<Mutex<Idle>>,
}

impl Body for EngineBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        // What the connection has read already first; it reads more only when that is all.
        let mut frame = Pin::new(&mut this.incoming).poll_frame(cx);
        if frame.is_pending()
            && let Some(conn) = this.conn.as_mut()
        {
            if let Poll::Ready(Err(e)) = conn.drive(cx) {
                this.conn = None;
                return Poll::Ready(Some(Err(e)));
            }
            frame = Pin::new(&mut this.incoming).poll_frame(cx);
        }
        if let Poll::Ready(None) = frame
            && let Some(conn) = this.conn.take()
            && conn.ready()
            && let Ok(mut idle) = this.home.lock()
        {
            idle.push_back((conn, Instant::now()));
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.incoming.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;

    use super::*;

    /// What the test engine does with a connection after its first answer.
    #[derive(Clone, Copy)]
    enum After {
        /// Answers the next request too.
        Keep,
        /// Closes it (without saying so, as an engine that restarted).
        Close,
        /// Takes the next request, and closes it unanswered (a keep-alive timeout that met it).
        DropNext,
    }

    /// An engine on a thread that answers `ok`; counts the connections it took.
    fn engine(after: After) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
        let authority = listener.local_addr().expect("its address").to_string();
        let taken = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&taken);
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                count.fetch_add(1, Ordering::SeqCst);
                let mut reader = BufReader::new(stream.try_clone().expect("a clone"));
                let mut writer = stream;
                for answered in 0.. {
                    let (mut line, mut length) = (String::new(), 0usize);
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).map_or(true, |n| n == 0) {
                            break;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0u8; length];
                    if line != "\r\n" || reader.read_exact(&mut body).is_err() {
                        break;
                    }
                    if answered == 1 && matches!(after, After::DropNext) {
                        break;
                    }
                    if writer.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").is_err()
                        || matches!(after, After::Close)
                    {
                        break;
                    }
                }
            }
        });
        (authority, taken)
    }

    fn request(authority: &str) -> Request<Full<Bytes>> {
        Request::builder()
            .method("POST")
            .uri("/v1/completions")
            .header(hyper::header::HOST, authority)
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("a request")
    }

    async fn exchange(connections: &Connections, authority: &str) -> Result<String, String> {
        let answer = connections.send(authority, request(authority)).await.map_err(|e| e.to_string())?;
        let body = answer.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime")
    }

    fn idle(connections: &Connections) -> usize {
        connections.idle.lock().map_or(0, |idle| idle.len())
    }

    #[test]
    fn a_connection_read_to_its_end_takes_the_next_request() {
        let (authority, taken) = engine(After::Keep);
        let connections = Connections::default();
        runtime().block_on(async {
            for _ in 0..3 {
                assert_eq!(exchange(&connections, &authority).await, Ok("ok".to_string()));
                assert_eq!(idle(&connections), 1);
            }
        });
        assert_eq!(taken.load(Ordering::SeqCst), 1, "each request opened a connection");
    }

    #[test]
    fn a_connection_the_engine_closed_is_replaced_and_the_request_still_goes() {
        // Closed once answered (seen when the connection is given back, or taken, or as a reset
        // when the next request meets it); closed with the next request in it (that request
        // goes again): each request on a new connection, and none fails.
        for after in [After::Close, After::DropNext] {
            let (authority, taken) = engine(after);
            let connections = Connections::default();
            runtime().block_on(async {
                for round in 0..3 {
                    assert_eq!(exchange(&connections, &authority).await, Ok("ok".to_string()), "round {round}");
                }
            });
            assert_eq!(taken.load(Ordering::SeqCst), 3);
        }
    }

    #[test]
    fn a_body_dropped_before_its_end_closes_its_connection_and_no_engine_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
        let authority = listener.local_addr().expect("its address").to_string();
        // An engine that sends half of its answer, then waits for the head to go.
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("a connection");
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf");
            // Read to the end: it comes once the head closed the connection.
            while stream.read(&mut buf).is_ok_and(|n| n > 0) {}
        });
        let connections = Connections::default();
        runtime().block_on(async {
            let answer = connections.send(&authority, request(&authority)).await.map_err(|e| e.to_string());
            let mut body = answer.expect("an answer").into_body();
            let first = body.frame().await.expect("a frame").expect("data").into_data().expect("data");
            assert_eq!(&first[..], b"half");
            drop(body);
            assert_eq!(idle(&connections), 0, "a half-read connection was kept");
        });
        server.join().expect("the engine saw the connection closed");
        let closed = TcpListener::bind("127.0.0.1:0").expect("a port");
        let gone = closed.local_addr().expect("its address").to_string();
        drop(closed);
        let failed = runtime().block_on(Connections::default().send(&gone, request(&gone)));
        assert!(matches!(failed, Err(SendError::Connect(_))), "{:?}", failed.err().map(|e| e.to_string()));
    }
}
