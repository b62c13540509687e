//! One thread serves every control channel: it waits on all their file
//! descriptors at once (epoll, through `polling`), so the server's thread
//! count does not grow with its clients. Channels come from the accept
//! thread over a queue; a channel that has not connected within the
//! handshake timeout, or a connected one silent for the idle timeout (when
//! set), is closed, and a connected client's space is then reclaimed.

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_common::protocol::{self, ErrorKind, Request};
use kv_common::transport::{ControlPeer, Received, TransportError};
use polling::{Event, Events, PollMode, Poller};

use crate::control::{self, After, Ending, Session, Shared};

/// Requests taken from one channel before the others get a turn.
const FAIRNESS: usize = 16;
/// How often timeouts are checked when nothing else wakes the loop.
const TICK: Duration = Duration::from_millis(200);

/// How long a channel may stay in each state.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// From accept to Connect.
    pub handshake: Duration,
    /// Between messages of a connected client; None: forever.
    pub idle: Option<Duration>,
}

struct Channel {
    peer: Box<dyn ControlPeer>,
    fds: Vec<RawFd>,
    session: Session,
    opened: Instant,
    last_seen: Instant,
    /// Beyond the cap: why its first request is answered with a refusal.
    refusal: Option<String>,
}

/// Channels beyond the cap that cannot take a reply yet (an rdma handshake
/// under way) kept until their first request, to be refused with the
/// reason. More are closed at once.
const REFUSING: usize = 64;

pub struct EventLoop {
    shared: Arc<Shared>,
    poller: Arc<Poller>,
    incoming: Receiver<Box<dyn ControlPeer>>,
    channels: HashMap<usize, Channel>,
    /// Channels cut short by the fairness limit: served again next turn
    /// whether or not their descriptors signal (an rdma channel is only
    /// re-armed once it has been drained).
    unfinished: Vec<usize>,
    next_id: usize,
    max_channels: usize,
    timeouts: Timeouts,
}

impl EventLoop {
    pub fn new(
        shared: Arc<Shared>,
        poller: Arc<Poller>,
        incoming: Receiver<Box<dyn ControlPeer>>,
        max_channels: usize,
        timeouts: Timeouts,
    ) -> EventLoop {
        EventLoop {
            shared,
            poller,
            incoming,
            channels: HashMap::new(),
            unfinished: Vec::new(),
            next_id: 0,
            max_channels,
            timeouts,
        }
    }

    pub fn run(mut self) {
        let mut events = Events::new();
        let mut cpu_mark = control::thread_cpu_us();
        let mut last_sweep = Instant::now();
        loop {
            events.clear();
            let wait = if self.unfinished.is_empty() {
                TICK
            } else {
                Duration::ZERO
            };
            if let Err(e) = self.poller.wait(&mut events, Some(wait)) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!("control event loop: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            if self.shared.stopping.load(Relaxed) {
                break;
            }
            while let Ok(peer) = self.incoming.try_recv() {
                self.add(peer);
            }
            let mut ready: Vec<usize> = events.iter().map(|e| e.key / 2).collect();
            ready.append(&mut self.unfinished);
            ready.sort_unstable();
            ready.dedup();
            for id in ready {
                self.service(id);
            }
            if last_sweep.elapsed() >= TICK {
                self.sweep_timeouts();
                last_sweep = Instant::now();
            }
            control::account_cpu(&self.shared.counters, &mut cpu_mark);
        }
        // Shutting down: the clients did not leave, the server did; nothing
        // of theirs is a departure to count or log.
        let ids: Vec<usize> = self.channels.keys().copied().collect();
        for id in ids {
            self.close(id, Ending::Goodbye);
        }
    }

    fn add(&mut self, mut peer: Box<dyn ControlPeer>) {
        let mut refusal = None;
        if self.channels.len() >= self.max_channels {
            // Say why before hanging up; the client reads it as the reply
            // to its Connect. A channel that cannot take it yet (an rdma
            // handshake under way) is kept, within REFUSING more, to be
            // told at its first request.
            self.shared.counters.refuse(control::Refusal::Connections);
            let why = format!(
                "the server has {} control connections open, its limit",
                self.max_channels
            );
            let reply = protocol::encode(&control::error(ErrorKind::TooManyClients, why.clone()));
            let told = reply.is_ok_and(|b| peer.send(&b).is_ok());
            if told || self.channels.len() >= self.max_channels + REFUSING {
                return;
            }
            refusal = Some(why);
        }
        let id = self.next_id;
        self.next_id += 1;
        let fds = peer.fds();
        for (i, &fd) in fds.iter().enumerate() {
            // SAFETY: the descriptor belongs to `peer`, which stays alive
            // (in `channels`) until `close` deletes it from the poller.
            let added = unsafe {
                self.poller
                    .add_with_mode(fd, Event::readable(id * 2 + i), PollMode::Level)
            };
            if let Err(e) = added {
                tracing::warn!("cannot watch a control connection: {e}");
                for &done in &fds[..i] {
                    self.forget_fd(done);
                }
                return;
            }
        }
        let now = Instant::now();
        self.channels.insert(
            id,
            Channel {
                peer,
                fds,
                session: Session::default(),
                opened: now,
                last_seen: now,
                refusal,
            },
        );
        self.shared.counters.connections.fetch_add(1, Relaxed);
        // A request may have arrived before its descriptor could signal it
        // (over rdma, a receive that completed before the queue was armed
        // raises no event): look once now.
        self.service(id);
    }

    /// Answers what a channel has sent, up to FAIRNESS requests.
    fn service(&mut self, id: usize) {
        let shared = self.shared.clone();
        let c = &shared.counters;
        let Some(ch) = self.channels.get_mut(&id) else {
            return;
        };
        let mut close: Option<Ending> = None;
        let mut drained = false;
        for _ in 0..FAIRNESS {
            let bytes = match ch.peer.try_recv() {
                Ok(Received::Message(b)) => b,
                Ok(Received::Nothing) => {
                    drained = true;
                    break;
                }
                Ok(Received::Closed) => {
                    close = Some(Ending::Unannounced);
                    break;
                }
                Ok(Received::Faulted(why)) => {
                    c.faulted_clients.fetch_add(1, Relaxed);
                    tracing::warn!(
                        client = ch.session.client,
                        "cutting off a client whose queue pair failed on a request of its own \
                         (an access it has no right to, or a malformed one): {why}"
                    );
                    close = Some(Ending::Unannounced);
                    break;
                }
                Err(TransportError::Codec(e)) => {
                    // The framing itself is broken: say why, then hang up.
                    c.malformed.fetch_add(1, Relaxed);
                    tracing::warn!(
                        client = ch.session.client,
                        "closing control connection: {e}"
                    );
                    let reply = control::error(ErrorKind::Malformed, e.to_string());
                    if let Ok(b) = protocol::encode(&reply) {
                        let _ = ch.peer.send(&b);
                    }
                    close = Some(Ending::Unannounced);
                    break;
                }
                Err(_) => {
                    close = Some(Ending::Unannounced);
                    break;
                }
            };
            ch.last_seen = Instant::now();
            let (reply, after, ending) = respond(&shared, ch, &bytes);
            if ending.is_some() {
                close = ending;
            }
            let sent = protocol::encode(&reply)
                .map_err(TransportError::from)
                .and_then(|b| ch.peer.send(&b));
            if let Err(e) = sent {
                tracing::debug!(client = ch.session.client, "reply not delivered: {e}");
                close.get_or_insert(Ending::Unannounced);
            }
            if after == After::Close || close.is_some() {
                break;
            }
        }
        if let Some(ending) = close {
            self.close(id, ending);
        } else if !drained {
            self.unfinished.push(id);
        }
    }

    fn sweep_timeouts(&mut self) {
        let now = Instant::now();
        let t = self.timeouts;
        let expired: Vec<usize> = self
            .channels
            .iter()
            .filter(|(_, ch)| match ch.session.client {
                None => now.duration_since(ch.opened) > t.handshake,
                Some(_) => t
                    .idle
                    .is_some_and(|idle| now.duration_since(ch.last_seen) > idle),
            })
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            if let Some(ch) = self.channels.get(&id) {
                tracing::debug!(client = ch.session.client, "control connection timed out");
            }
            self.close(id, Ending::Unannounced);
        }
    }

    fn close(&mut self, id: usize, ending: Ending) {
        let Some(mut ch) = self.channels.remove(&id) else {
            return;
        };
        for &fd in &ch.fds {
            self.forget_fd(fd);
        }
        control::end_session(&self.shared, &ch.session, &mut *ch.peer, ending);
        self.shared.counters.connections.fetch_sub(1, Relaxed);
    }

    fn forget_fd(&self, fd: RawFd) {
        // SAFETY: the descriptor is still open: its peer has not been dropped.
        let _ = self.poller.delete(unsafe { BorrowedFd::borrow_raw(fd) });
    }
}

/// The reply to one request on `ch`, what follows it, and how the channel
/// ends if it is to close.
fn respond(
    shared: &Shared,
    ch: &mut Channel,
    bytes: &[u8],
) -> (protocol::Response, After, Option<Ending>) {
    if let Some(why) = ch.refusal.take() {
        let reply = control::error(ErrorKind::TooManyClients, why);
        return (reply, After::Close, Some(Ending::Unannounced));
    }
    match protocol::decode::<Request>(bytes) {
        Ok(request) => {
            let ending = if request == Request::Disconnect {
                Ending::Goodbye
            } else {
                Ending::Unannounced
            };
            let (reply, after) = control::handle(shared, &mut ch.session, &mut *ch.peer, request);
            let ending = (after == After::Close).then_some(ending);
            (reply, after, ending)
        }
        Err(e) => {
            shared.counters.malformed.fetch_add(1, Relaxed);
            let after = control::offence(&mut ch.session);
            let ending = (after == After::Close).then_some(Ending::Unannounced);
            (
                control::error(ErrorKind::Malformed, e.to_string()),
                after,
                ending,
            )
        }
    }
}
