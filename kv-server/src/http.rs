//! The metrics endpoint's HTTP side: one request per connection, answered
//! by one thread that serves every connection with non-blocking sockets on
//! one poller. A scraper that trickles its request, one that never reads
//! its answer, or a crowd that opens connections and sits on them delays
//! nobody else:
//!
//! - each connection has a deadline for its whole request head
//!   (`IO_TIMEOUT` from its accept) and another for its whole answer, and
//!   is closed when it passes;
//! - at most `MAX_CONNECTIONS` are open: a new one beyond them closes the
//!   oldest (an honest scrape takes milliseconds, so the oldest is the one
//!   most likely stalled), and so does running out of descriptors;
//! - a request head is at most `MAX_REQUEST` bytes.
//!
//! Why not a crate: tiny_http (tried first) has no timeouts and a thread
//! per connection; hyper needs an async runtime this server does not run.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use polling::{Event, Events, PollMode, Poller};

/// Longest a client may take to send its request head, and (separately) to
/// take its answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest request head read; a GET needs a few hundred bytes.
const MAX_REQUEST: usize = 8 << 10;
/// Connections open at once (scrapers are few; the server keeps this many
/// descriptors spare for them, see `descriptors.rs`).
const MAX_CONNECTIONS: usize = 32;
/// The listener's poller key; connections count up from 1.
const LISTENER: usize = 0;

/// What a request asks for, as far as a GET-only endpoint cares.
pub struct Request<'a> {
    pub method: &'a [u8],
    /// The target without its query.
    pub path: &'a [u8],
}

/// An answer: status line text, content type, body.
pub struct Answer {
    pub status: &'static str,
    pub content_type: &'static str,
    pub body: String,
}

type Handler = Box<dyn Fn(&Request) -> Answer + Send>;

/// A running server; dropping it stops it (open connections are closed).
pub struct HttpServer {
    address: SocketAddr,
    poller: Arc<Poller>,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// Serves `listener` on a thread named `name`, answering each request
    /// with `handler`.
    pub fn start(
        listener: TcpListener,
        name: &str,
        handler: impl Fn(&Request) -> Answer + Send + 'static,
    ) -> std::io::Result<HttpServer> {
        let address = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let poller = Arc::new(Poller::new()?);
        // SAFETY: the listener is moved into the thread, which deletes it
        // from the poller before dropping it.
        unsafe {
            poller.add_with_mode(
                listener.as_raw_fd(),
                Event::readable(LISTENER),
                PollMode::Level,
            )?
        };
        let stopping = Arc::new(AtomicBool::new(false));
        let mut serving = Serving {
            listener,
            poller: poller.clone(),
            handler: Box::new(handler),
            connections: BTreeMap::new(),
            next_key: LISTENER + 1,
            last_warning: None,
        };
        let stop = stopping.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || serving.run(&stop))?;
        Ok(HttpServer {
            address,
            poller,
            stopping,
            thread: Some(thread),
        })
    }

    /// Where it listens (the port the system chose, for port 0).
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        let _ = self.poller.notify();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One connection: reading its request head, then writing its answer.
struct Connection {
    stream: TcpStream,
    deadline: Instant,
    state: State,
}

enum State {
    Reading(Vec<u8>),
    Writing { reply: Vec<u8>, sent: usize },
}

/// The serving thread's state.
struct Serving {
    listener: TcpListener,
    poller: Arc<Poller>,
    handler: Handler,
    /// By key, which grows with each accept: the first is the oldest.
    connections: BTreeMap<usize, Connection>,
    next_key: usize,
    last_warning: Option<Instant>,
}

impl Serving {
    fn run(&mut self, stopping: &AtomicBool) {
        let mut events = Events::new();
        while !stopping.load(Ordering::SeqCst) {
            events.clear();
            let now = Instant::now();
            let wait = self
                .connections
                .values()
                .map(|c| c.deadline.saturating_duration_since(now))
                .min()
                .unwrap_or(Duration::from_secs(1));
            if let Err(e) = self.poller.wait(&mut events, Some(wait)) {
                if e.kind() != ErrorKind::Interrupted {
                    self.warn(&format!("polling failed: {e}"));
                    std::thread::sleep(Duration::from_millis(50));
                }
                continue;
            }
            for key in events.iter().map(|e| e.key).collect::<Vec<_>>() {
                if key == LISTENER {
                    self.accept_all();
                } else {
                    self.progress(key);
                }
            }
            let now = Instant::now();
            let expired: Vec<usize> = self
                .connections
                .iter()
                .filter(|(_, c)| c.deadline <= now)
                .map(|(&k, _)| k)
                .collect();
            for key in expired {
                self.close(key);
            }
        }
        let keys: Vec<usize> = self.connections.keys().copied().collect();
        for key in keys {
            self.close(key);
        }
        let _ = self.poller.delete(&self.listener);
    }

    fn accept_all(&mut self) {
        let mut closed_one = false;
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.connections.len() >= MAX_CONNECTIONS {
                        self.close_oldest();
                    }
                    self.add(stream);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors: the oldest connection gives one
                    // back (once per pass); otherwise wait a little.
                    let out_of_descriptors =
                        matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if out_of_descriptors && !closed_one && !self.connections.is_empty() {
                        self.close_oldest();
                        closed_one = true;
                        continue;
                    }
                    self.warn(&format!("accept failed: {e}"));
                    if out_of_descriptors {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    return;
                }
            }
        }
    }

    fn add(&mut self, stream: TcpStream) {
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let key = self.next_key;
        self.next_key += 1;
        // SAFETY: the stream stays in `connections` until `close` deletes
        // it from the poller.
        let added = unsafe {
            self.poller
                .add_with_mode(stream.as_raw_fd(), Event::readable(key), PollMode::Level)
        };
        if added.is_ok() {
            let connection = Connection {
                stream,
                deadline: Instant::now() + IO_TIMEOUT,
                state: State::Reading(Vec::new()),
            };
            self.connections.insert(key, connection);
        }
    }

    /// Reads what has come, answers a complete head, writes what the
    /// socket takes; closes the connection when it is done or broken.
    fn progress(&mut self, key: usize) {
        let Some(c) = self.connections.get_mut(&key) else {
            return;
        };
        let done = match &mut c.state {
            State::Reading(head) => match read_head(&mut c.stream, head) {
                Ok(true) => {
                    let reply = answer(head, &self.handler);
                    c.state = State::Writing { reply, sent: 0 };
                    c.deadline = Instant::now() + IO_TIMEOUT;
                    let writable = Event::writable(key);
                    // `modify` alone would make it one-shot.
                    self.poller
                        .modify_with_mode(&c.stream, writable, PollMode::Level)
                        .is_err()
                        || write_some(c).unwrap_or(true)
                }
                Ok(false) => false,
                Err(_) => true,
            },
            State::Writing { .. } => write_some(c).unwrap_or(true),
        };
        if done {
            self.close(key);
        }
    }

    fn close_oldest(&mut self) {
        if let Some(&key) = self.connections.keys().next() {
            self.close(key);
        }
    }

    fn close(&mut self, key: usize) {
        if let Some(c) = self.connections.remove(&key) {
            let _ = self.poller.delete(&c.stream);
        }
    }

    /// Logs now and then, not once per failed call.
    fn warn(&mut self, message: &str) {
        if self
            .last_warning
            .is_none_or(|t| t.elapsed() > Duration::from_secs(5))
        {
            tracing::warn!("http endpoint: {message}");
            self.last_warning = Some(Instant::now());
        }
    }
}

/// Reads what the socket has into `head`: true once the head is complete
/// (or the client stopped sending); an error when it is too long or the
/// connection broke.
fn read_head(stream: &mut TcpStream, head: &mut Vec<u8>) -> std::io::Result<bool> {
    let mut buf = [0u8; 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Ok(true),
            Ok(n) => {
                head.extend_from_slice(&buf[..n]);
                if head.windows(4).any(|w| w == b"\r\n\r\n") {
                    return Ok(true);
                }
                if head.len() > MAX_REQUEST {
                    return Err(ErrorKind::InvalidData.into());
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Writes what the socket takes of the answer: true once all is sent.
fn write_some(c: &mut Connection) -> std::io::Result<bool> {
    let State::Writing { reply, sent } = &mut c.state else {
        return Ok(false);
    };
    while *sent < reply.len() {
        match c.stream.write(&reply[*sent..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => *sent += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// The whole reply to a request head: its first line's method and path
/// go to the handler.
fn answer(head: &[u8], handler: &Handler) -> Vec<u8> {
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let method = words.next().unwrap_or_default();
    let target = words.next().unwrap_or_default();
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    let a = handler(&Request { method, path });
    let mut reply = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        a.status,
        a.content_type,
        a.body.len()
    )
    .into_bytes();
    reply.extend_from_slice(a.body.as_bytes());
    reply
}
