//! A cluster member's own `--listen` address (its shards are served beside
//! it): it hands out the member's view of the shard map, so that a client
//! built without etcd can find every shard from any member. Anything else
//! asked there is refused with a message that says where to go.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_cluster::ClusterState;
use kv_common::protocol::{self, ErrorKind, Request, Response, PROTOCOL_VERSION};
use kv_common::transport::{self, ControlListener, ControlPeer, Received};
use kv_common::Address;

use crate::ServerError;

/// Channels served at once; more are closed at accept. A client reads the
/// map on connect and after a shard failed it, so this is generous.
const MAX_PEERS: usize = 64;
/// How long one channel is served: enough to read a map of many pages.
const PEER_TIME: Duration = Duration::from_secs(5);

/// What a member knows of its cluster: none while it is out of it.
type View = Arc<Mutex<Option<ClusterState>>>;

/// The map endpoint at a member's own address.
pub struct Directory {
    listener: Arc<dyn ControlListener>,
    view: View,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Who answers, for replies.
struct Answerer {
    cluster: String,
    member: String,
    listen: String,
    view: View,
}

impl Directory {
    /// Listens at `listen` for cluster `cluster`'s clients; it answers that
    /// the member is out of the cluster until [`Self::show`] gives it a map.
    ///
    /// # Errors
    ///
    /// When the address cannot be bound (another process serves it).
    pub fn serve(listen: &Address, member: &str, cluster: &str) -> Result<Directory, ServerError> {
        let listener: Arc<dyn ControlListener> = Arc::from(transport::bind(listen)?);
        let view = View::default();
        let stop = Arc::new(AtomicBool::new(false));
        let answerer = Arc::new(Answerer {
            cluster: cluster.to_string(),
            member: member.to_string(),
            listen: listen.to_string(),
            view: view.clone(),
        });
        let thread = {
            let (listener, stop) = (listener.clone(), stop.clone());
            std::thread::Builder::new()
                .name("directory".into())
                .spawn(move || accept_loop(&*listener, &stop, &answerer))
                .map_err(|e| ServerError::Config(format!("cannot start a thread: {e}")))?
        };
        Ok(Directory {
            listener,
            view,
            stop,
            thread: Some(thread),
        })
    }

    /// What the member knows now: the cluster as of its last etcd event,
    /// or none (it is out of the cluster).
    pub fn show(&self, state: Option<&ClusterState>) {
        if let Ok(mut view) = self.view.lock() {
            *view = state.cloned();
        }
    }
}

impl Drop for Directory {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        self.listener.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn accept_loop(listener: &dyn ControlListener, stop: &AtomicBool, answerer: &Arc<Answerer>) {
    let serving = Arc::new(AtomicUsize::new(0));
    while !stop.load(Relaxed) {
        let peer = match listener.accept() {
            Ok(peer) => peer,
            Err(e) => {
                if !stop.load(Relaxed) {
                    tracing::debug!("directory: a channel failed to open: {e}");
                    // Out of descriptors, say: not a busy loop.
                    std::thread::sleep(Duration::from_millis(20));
                }
                continue;
            }
        };
        if stop.load(Relaxed) || serving.load(Relaxed) >= MAX_PEERS {
            continue;
        }
        serving.fetch_add(1, Relaxed);
        let (answerer, done) = (answerer.clone(), serving.clone());
        let spawned = std::thread::Builder::new()
            .name("directory-peer".into())
            .spawn(move || {
                serve_peer(peer, &answerer);
                done.fetch_sub(1, Relaxed);
            });
        if spawned.is_err() {
            serving.fetch_sub(1, Relaxed);
        }
    }
}

/// Answers one channel's requests until it closes or its time is up.
fn serve_peer(mut peer: Box<dyn ControlPeer>, answerer: &Answerer) {
    let until = Instant::now() + PEER_TIME;
    loop {
        let bytes = match peer.try_recv() {
            Ok(Received::Message(bytes)) => bytes,
            Ok(Received::Nothing) => {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return;
                }
                wait_readable(&peer.fds(), left);
                continue;
            }
            Ok(Received::Closed | Received::Faulted(_)) | Err(_) => return,
        };
        let (reply, stay) = match protocol::decode::<Request>(&bytes) {
            Ok(request) => answerer.answer(request),
            Err(e) => (error(ErrorKind::Malformed, e.to_string()), false),
        };
        let sent = protocol::encode(&reply).map(|b| peer.send(&b));
        if !stay || !matches!(sent, Ok(Ok(()))) {
            return;
        }
    }
}

impl Answerer {
    /// The reply, and whether the channel stays open.
    fn answer(&self, request: Request) -> (Response, bool) {
        let Request::ClusterMap {
            protocol_version,
            first,
        } = request
        else {
            let m = format!(
                "{} is the address of member {} of cluster {}, which serves only the cluster's map: \
                 connect to the cluster (kv_client::ClusterClient) with cluster+{}",
                self.listen, self.member, self.cluster, self.listen
            );
            return (error(ErrorKind::ClusterMember, m), false);
        };
        if protocol_version != PROTOCOL_VERSION {
            let m = format!("client speaks protocol {protocol_version}, server {PROTOCOL_VERSION}");
            return (error(ErrorKind::VersionMismatch, m), false);
        }
        let view = self.view.lock().ok().and_then(|v| v.clone());
        let Some(state) = view else {
            let m = format!(
                "member {} is out of cluster {} until it joins again: ask another member",
                self.member, self.cluster
            );
            return (error(ErrorKind::NoMap, m), false);
        };
        match kv_cluster::directory::page(&self.cluster, &state, first) {
            Ok(page) => (Response::ClusterMap(page), true),
            Err(e) => (error(ErrorKind::Malformed, e), false),
        }
    }
}

fn error(kind: ErrorKind, message: impl Into<String>) -> Response {
    Response::Error {
        kind,
        message: message.into(),
    }
}

/// Waits until one of `fds` is readable, or for `limit`.
fn wait_readable(fds: &[std::os::fd::RawFd], limit: Duration) {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = limit.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: `polled` is a live array of `polled.len()` pollfds.
    unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, ms) };
}
