//! The least HTTP/1.1 a benchmark client needs: a request on a connection of its own, its answer
//! read as it comes (chunked or to the close), the time of its first server-sent event with
//! content, and its usage.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;

pub struct Streamed {
    pub status: u16,
    /// When the first event with a choice came.
    pub first: Option<Instant>,
    /// The usage event's `usage`.
    pub usage: Option<Value>,
}

/// A POST whose answer is read as a stream of server-sent events.
pub fn stream(addr: SocketAddr, path: &str, body: &str) -> std::io::Result<Streamed> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: bench\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let mut chunked = false;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            break;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':')
            && k.trim().eq_ignore_ascii_case("transfer-encoding")
        {
            chunked = v.trim().eq_ignore_ascii_case("chunked");
        }
    }
    let mut out = Streamed { status, first: None, usage: None };
    let mut pending = String::new();
    let mut take = |text: &str, out: &mut Streamed| {
        pending.push_str(text);
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            let Ok(chunk) = serde_json::from_str::<Value>(data) else { continue };
            if out.first.is_none() && chunk["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                out.first = Some(Instant::now());
            }
            if chunk["usage"].is_object() {
                out.usage = Some(chunk["usage"].clone());
            }
        }
    };
    if chunked {
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                break;
            }
            let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            let mut chunk = vec![0u8; size + 2];
            reader.read_exact(&mut chunk)?;
            if size == 0 {
                break;
            }
            take(&String::from_utf8_lossy(chunk.get(..size).unwrap_or_default()), &mut out);
        }
    } else {
        let mut buffer = [0u8; 16 * 1024];
        loop {
            let n = reader.read(&mut buffer)?;
            if n == 0 {
                break;
            }
            take(&String::from_utf8_lossy(buffer.get(..n).unwrap_or_default()), &mut out);
        }
    }
    Ok(out)
}
