//! An engine that answers at once: every POST gets one small completion (with `cached_tokens` 0),
//! every GET a 200, on kept-alive connections. It notes when each request's first byte came,
//! by the `x-bench-id` header the client sent, so that a head's overhead is measured from the
//! engine's side: when the byte reached its socket (the kernel's receive time), and when its
//! thread, woken, read it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// A running instant engine.
pub struct InstantEngine {
    pub addr: SocketAddr,
    /// When each request's first byte came, by its `x-bench-id`.
    pub arrivals: Arc<Mutex<HashMap<u64, Arrival>>>,
}

impl InstantEngine {
    pub fn start() -> std::io::Result<InstantEngine> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let arrivals: Arc<Mutex<HashMap<u64, Arrival>>> = Arc::default();
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

/// When a request's first byte came.
#[derive(Clone, Copy)]
pub struct Arrival {
    /// Into the engine's socket: the kernel's receive time (on loopback, when the sender wrote
    /// it), if the kernel told it.
    pub socket: Option<SystemTime>,
    /// To the engine's thread, once woken.
    pub read: Instant,
}

fn serve(stream: TcpStream, arrivals: &Mutex<HashMap<u64, Arrival>>) {
    let _ = stream.set_nodelay(true);
    let stamped = kernel_stamps(&stream);
    let Ok(mut writer) = stream.try_clone() else { return };
    let mut reader = BufReader::new(stream);
    loop {
        // The request line: its first byte's arrival is when `fill_buf` returns; the kernel
        // stamped the byte when it reached the socket (the buffer is empty between requests:
        // a client sends the next once it has the answer).
        let socket = if stamped && reader.buffer().is_empty() { first_byte_stamp(reader.get_ref()) } else { None };
        let came = match reader.fill_buf() {
            Ok([]) | Err(_) => return,
            Ok(_) => Arrival { socket, read: Instant::now() },
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

/// Asks the kernel to stamp what reaches `stream` with its receive time (`SO_TIMESTAMPNS`).
#[allow(unsafe_code)]
fn kernel_stamps(stream: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let on: libc::c_int = 1;
    // SAFETY: a valid socket, and an option value of the size given.
    let set = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_TIMESTAMPNS,
            (&raw const on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    set == 0
}

/// Waits for the next byte on `stream` without taking it, and gives the kernel's receive time
/// of the segment it came in.
#[allow(unsafe_code)]
fn first_byte_stamp(stream: &TcpStream) -> Option<SystemTime> {
    use std::os::fd::AsRawFd;
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut control = [0u64; 16];
    // SAFETY: zeroed is a valid `msghdr`; its pointers are set to live buffers below.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &raw mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    message.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: every buffer `message` points to outlives the call.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &raw mut message, libc::MSG_PEEK) };
    if n <= 0 {
        return None;
    }
    // SAFETY: the control messages the kernel wrote, walked with its own macros.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&raw const message);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SO_TIMESTAMPNS {
                let at: libc::timespec = std::ptr::read_unaligned(libc::CMSG_DATA(header).cast());
                let since = Duration::new(u64::try_from(at.tv_sec).ok()?, u32::try_from(at.tv_nsec).ok()?);
                return Some(SystemTime::UNIX_EPOCH + since);
            }
            header = libc::CMSG_NXTHDR(&raw const message, header);
        }
    }
    None
}
