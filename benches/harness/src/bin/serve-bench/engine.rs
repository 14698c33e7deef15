//! An engine that answers at once: every POST gets one small completion (with `cached_tokens` 0),
//! every GET a 200, on kept-alive connections. It notes when each request's first byte came,
//! by the `x-bench-id` header the client sent, so that a head's overhead is measured from the
//! engine's side.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A running instant engine.
pub struct InstantEngine {
    pub addr: SocketAddr,
    /// When each request's first byte came, by its `x-bench-id`.
    pub arrivals: Arc<Mutex<HashMap<u64, Instant>>>,
}

impl InstantEngine {
    pub fn start() -> std::io::Result<InstantEngine> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let arrivals: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
        let a = Arc::clone(&arrivals);
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let a = Arc::clone(&a);
                std::thread::spawn(move || serve(stream, &a));
            }
        });
        Ok(InstantEngine { addr, arrivals })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

const ANSWER: &str = r#"{"id":"b","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}"#;

fn serve(stream: TcpStream, arrivals: &Mutex<HashMap<u64, Instant>>) {
    let _ = stream.set_nodelay(true);
    let Ok(mut writer) = stream.try_clone() else { return };
    let mut reader = BufReader::new(stream);
    loop {
        // The request line: its first byte's arrival is when `fill_buf` returns.
        let came = match reader.fill_buf() {
            Ok([]) | Err(_) => return,
            Ok(_) => Instant::now(),
        };
        let (mut line, mut length, mut id, mut get) = (String::new(), 0usize, None, false);
        let mut first = true;
        loop {
            line.clear();
            if reader.read_line(&mut line).map_or(true, |n| n == 0) {
                return;
            }
            let l = line.trim_end();
            if first {
                get = l.starts_with("GET");
                first = false;
                continue;
            }
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                match k.trim().to_ascii_lowercase().as_str() {
                    "content-length" => length = v.trim().parse().unwrap_or(0),
                    "x-bench-id" => id = v.trim().parse().ok(),
                    _ => {}
                }
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        if let (Some(id), Ok(mut a)) = (id, arrivals.lock()) {
            a.insert(id, came);
        }
        let answer = if get { "{}" } else { ANSWER };
        let sent = write!(
            writer,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if sent.and_then(|()| writer.flush()).is_err() {
            return;
        }
    }
}
