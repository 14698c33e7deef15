//! A kept-alive HTTP/1.1 client, the least a load generator needs: a request with a body and
//! extra headers, its status and body (by content length or chunked).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Instant, SystemTime};

/// When a request was written: its last byte's time, on both clocks (the engine's socket stamps
/// the wall clock).
#[derive(Clone, Copy)]
pub struct Sent {
    pub at: Instant,
    pub wall: SystemTime,
}

pub struct Client {
    addr: SocketAddr,
    conn: Option<(TcpStream, BufReader<TcpStream>)>,
    /// The last answer's `server-timing` header, if it had one.
    pub server_timing: Option<String>,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        Client { addr, conn: None, server_timing: None }
    }

    /// POSTs `body` to `path`; the status, the body, and when the request was written.
    pub fn post(&mut self, path: &str, body: &str, headers: &str) -> std::io::Result<(u16, String, Sent)> {
        for retry in 0..2 {
            match self.try_post(path, body, headers) {
                Ok(r) => return Ok(r),
                Err(e) if retry == 0 => {
                    // A kept-alive connection the server closed: once more on a new one.
                    self.conn = None;
                    let _ = e;
                }
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::other("unreachable"))
    }

    fn try_post(&mut self, path: &str, body: &str, headers: &str) -> std::io::Result<(u16, String, Sent)> {
        if self.conn.is_none() {
            let s = TcpStream::connect(self.addr)?;
            s.set_nodelay(true)?;
            let r = BufReader::new(s.try_clone()?);
            self.conn = Some((s, r));
        }
        let Some((stream, reader)) = self.conn.as_mut() else { return Err(std::io::Error::other("no connection")) };
        let request = format!(
            "POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{headers}\r\n{body}",
            body.len()
        );
        // Taken before the write: after it, on a loaded 2-core machine, this thread may not run
        // again until the head has long forwarded the request. Loopback takes the whole request
        // into its buffer at once, so this is its last byte's time to a few microseconds.
        let sent = Sent { wall: SystemTime::now(), at: Instant::now() };
        stream.write_all(request.as_bytes())?;
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no status: {line:?}")))?;
        let (mut length, mut chunked, mut close, mut timing) = (None, false, false, None);
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                return Err(std::io::Error::other("closed in the head"));
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                match k.trim().to_ascii_lowercase().as_str() {
                    "content-length" => length = v.trim().parse::<usize>().ok(),
                    "transfer-encoding" => chunked = v.trim().eq_ignore_ascii_case("chunked"),
                    "connection" => close = v.trim().eq_ignore_ascii_case("close"),
                    "server-timing" => timing = Some(v.trim().to_string()),
                    _ => {}
                }
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                line.clear();
                reader.read_line(&mut line)?;
                let size = usize::from_str_radix(line.trim(), 16).map_err(std::io::Error::other)?;
                let mut chunk = vec![0u8; size + 2];
                reader.read_exact(&mut chunk)?;
                if size == 0 {
                    break;
                }
                body.extend_from_slice(chunk.get(..size).unwrap_or_default());
            }
        } else if let Some(n) = length {
            body.resize(n, 0);
            reader.read_exact(&mut body)?;
        } else {
            reader.read_to_end(&mut body)?;
            close = true;
        }
        if close {
            self.conn = None;
        }
        self.server_timing = timing;
        Ok((status, String::from_utf8_lossy(&body).into_owned(), sent))
    }
}
