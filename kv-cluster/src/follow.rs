//! Following a cluster's records as they change, for a client that routes
//! by them: etcd's watch from the revision last read, each change applied
//! to the state held, and the whole state read again only when the watch
//! cannot go on from where it was (etcd compacted its history past it, or
//! the cluster was made anew). It runs on a thread of its own, so that the
//! client's data path never waits for etcd.

use std::time::Duration;

use etcd_client::{EventType, WatchResponse};
use tokio::sync::oneshot;

use crate::etcd::{check_map, Etcd, Keys, Record};
use crate::records::ClusterState;
use crate::url::ClusterUrl;
use crate::ClusterError;

/// How long the follower waits before it tries etcd again.
const RETRY: Duration = Duration::from_millis(500);

/// A thread that follows one cluster; it stops when this is dropped.
pub struct Follower {
    /// Dropped with the follower: the thread's runtime sees it closed.
    _stop: oneshot::Sender<()>,
}

impl Follower {
    /// Follows the cluster at `url` from `from` (a state read from the same
    /// etcd) on; `publish` is given every state after it, in order.
    ///
    /// # Errors
    ///
    /// When no runtime or thread can be started.
    pub fn start(
        url: &ClusterUrl,
        from: ClusterState,
        publish: impl FnMut(&ClusterState) + Send + 'static,
    ) -> Result<Follower, ClusterError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ClusterError::Etcd(format!("cannot start a runtime: {e}")))?;
        let (stop, stopped) = oneshot::channel();
        let url = url.clone();
        std::thread::Builder::new()
            .name("onekv-map".into())
            .spawn(move || {
                runtime.block_on(async {
                    tokio::select! {
                        _ = stopped => {}
                        () = follow(&url, from, publish) => {}
                    }
                });
            })
            .map_err(|e| ClusterError::Etcd(format!("cannot start a thread: {e}")))?;
        Ok(Follower { _stop: stop })
    }
}

/// Follows for as long as it is polled.
async fn follow(url: &ClusterUrl, mut state: ClusterState, mut publish: impl FnMut(&ClusterState)) {
    let mut etcd = None;
    let mut reload = false;
    loop {
        if etcd.is_none() {
            etcd = Etcd::connect_watching(url).await.ok();
        }
        let Some(e) = etcd.as_mut() else {
            tokio::time::sleep(RETRY).await;
            continue;
        };
        if reload {
            match e.state().await {
                Ok(now) => {
                    if now.revision > state.revision {
                        state = now;
                        publish(&state);
                    }
                    reload = false;
                }
                Err(_) => {
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            }
        }
        let keys = e.keys.clone();
        let mut changes = match e.watch_from(state.revision).await {
            Ok(changes) => changes,
            Err(_) => {
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        // Until the watch ends: etcd away (watched again from the last
        // change applied) or told it cannot go on (read whole).
        while let Ok(Some(reply)) = changes.message().await {
            match apply(&keys, &state, &reply) {
                Ok(Some(next)) => {
                    state = next;
                    publish(&state);
                }
                Ok(None) => {}
                Err(()) => {
                    reload = true;
                    break;
                }
            }
        }
        // Not at once: a watch that etcd keeps refusing must not spin.
        tokio::time::sleep(RETRY).await;
    }
}

/// `state` with one watch reply applied, if it changed anything; Err when
/// the state must be read whole (the watch was cancelled, as when etcd has
/// compacted the revisions it was to start from; the config changed, or a
/// record does not decode). A reply is applied whole or not at all.
fn apply(
    keys: &Keys,
    state: &ClusterState,
    reply: &WatchResponse,
) -> Result<Option<ClusterState>, ()> {
    if reply.canceled() || reply.compact_revision() > 0 {
        return Err(());
    }
    if reply.events().is_empty() {
        return Ok(None);
    }
    let mut state = state.clone();
    for event in reply.events() {
        let Some(kv) = event.kv() else { continue };
        let key = kv.key();
        match event.event_type() {
            EventType::Put => match keys.record(key, kv.value()) {
                Ok(Record::Map(map)) => state.map = Some((map, kv.mod_revision())),
                Ok(Record::Member(member)) => {
                    state.members.retain(|m| m.id != member.id);
                    state.members.push(member);
                }
                Ok(Record::Other) => {}
                Ok(Record::Config(_)) | Err(_) => return Err(()),
            },
            EventType::Delete => {
                if key == keys.map().as_bytes() {
                    state.map = None;
                } else if let Some(id) = key.strip_prefix(keys.members().as_bytes()) {
                    state.members.retain(|m| m.id.as_bytes() != id);
                } else if key == keys.config().as_bytes() {
                    return Err(());
                }
            }
        }
        state.revision = state.revision.max(kv.mod_revision());
    }
    // In key order, as a whole read gives them.
    state.members.sort_by(|a, b| a.id.cmp(&b.id));
    check_map(&state).map_err(|_| ())?;
    Ok(Some(state))
}
