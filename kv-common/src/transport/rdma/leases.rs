//! Writes confined to leases (`docs/rdma.md`, "Protection"). The region is
//! registered for READ and atomics only; each extent leased to a client is
//! registered apart (Soft-RoCE bounds a window's accesses only by its
//! registration) and made writable by a type-2 memory window bound on that
//! client's queue pair under a fresh random key byte. The window is
//! invalidated when the lease is given back, and deallocated with the
//! queue pair when the client is fenced or leaves.

use std::sync::Arc;
use std::time::Duration;

use super::verbs::{Mr, Mw, Pd, LOCAL_ONLY, MW_BIND, REMOTE_WRITE};
use super::Channel;
use crate::mapping::SharedRegion;
use crate::protocol::Extent;
use crate::transport::error::TransportError;

/// Most leases one client may hold writable at once: a backstop (the
/// server leases a confined client a few extents at a time, and an honest
/// one gives everything back before it leases again).
const MAX_GRANTS: usize = 64;
/// Longest a bind or an invalidate may take: local work of the device,
/// done on the thread that serves every client.
const LOCAL_WORK_TIMEOUT: Duration = Duration::from_secs(1);

/// The server's side: the windows bound on one client's queue pair.
#[derive(Default)]
pub(super) struct Grants {
    open: Vec<Grant>,
}

struct Grant {
    extent: Extent,
    key: u32,
    /// Holds the extent's registration while bound.
    _window: Mw,
}

fn overlaps(a: Extent, b: Extent) -> bool {
    a.offset < b.offset.saturating_add(b.len) && b.offset < a.offset.saturating_add(a.len)
}

/// Ends every access through `channel`'s queue pair (the error state), as
/// the way out when a window cannot be bound or invalidated in time: a
/// window whose bind or invalidate is still pending may be valid.
fn cut_off(channel: &mut Channel, why: &str) -> TransportError {
    let why = match channel.qp.set_error() {
        Ok(()) => why.to_string(),
        Err(e) => format!("{why}; and its queue pair could not be put in error: {e}"),
    };
    channel.broken = Some(why.clone());
    TransportError::Disconnected(why)
}

impl Grants {
    /// Registers `extent` of `region` and binds a window over it on
    /// `channel`'s queue pair: the key its peer's WRITEs there carry.
    pub(super) fn grant(
        &mut self,
        pd: &Arc<Pd>,
        channel: &mut Channel,
        region: Arc<SharedRegion>,
        extent: Extent,
    ) -> Result<u32, TransportError> {
        if self.open.len() >= MAX_GRANTS {
            return Err(TransportError::Unsupported(format!(
                "{MAX_GRANTS} leases already writable by this client"
            )));
        }
        if self.open.iter().any(|g| overlaps(g.extent, extent)) {
            return Err(TransportError::Unsupported(format!(
                "{extent:?} overlaps a lease this client holds"
            )));
        }
        let mr = Mr::range(pd, region, extent.offset, extent.len, LOCAL_ONLY | MW_BIND)?;
        let mut window = Mw::alloc(pd)?;
        channel.check()?;
        let bound = channel
            .qp
            .bind(&mut window, &Arc::new(mr), 0..extent.len, REMOTE_WRITE)
            .map_err(TransportError::Io)
            .and_then(|key| channel.wait_for(1, LOCAL_WORK_TIMEOUT).map(|()| key));
        match bound {
            Ok(key) => {
                self.open.push(Grant {
                    extent,
                    key,
                    _window: window,
                });
                Ok(key)
            }
            Err(e) => Err(cut_off(channel, &format!("binding a lease's window: {e}"))),
        }
    }

    /// Invalidates and frees the windows over any part of `extent`. When
    /// one cannot be invalidated in time, the queue pair is put in error
    /// instead (which ends every access through it) and the error says so.
    pub(super) fn revoke(
        &mut self,
        channel: &mut Channel,
        extent: Extent,
    ) -> Result<(), TransportError> {
        let (ending, kept): (Vec<Grant>, Vec<Grant>) = std::mem::take(&mut self.open)
            .into_iter()
            .partition(|g| overlaps(g.extent, extent));
        self.open = kept;
        if ending.is_empty() {
            return Ok(());
        }
        let invalidated = channel.check().is_ok()
            && ending.iter().all(|g| {
                channel.qp.invalidate(g.key).is_ok()
                    && channel.wait_for(1, LOCAL_WORK_TIMEOUT).is_ok()
            });
        if invalidated {
            Ok(())
        } else {
            Err(cut_off(
                channel,
                "a lease's window could not be invalidated",
            ))
        }
    }

    /// Ends every grant (the client is fenced or gone: its queue pair is
    /// in error, and deallocating a window revokes it).
    pub(super) fn revoke_all(&mut self) {
        self.open.clear();
    }
}

/// The client's side: the key of each lease it may write into.
#[derive(Default)]
pub(super) struct WriteKeys {
    keys: Vec<(Extent, u32)>,
}

impl WriteKeys {
    pub(super) fn allow(&mut self, extent: Extent, key: u32) {
        self.keys.retain(|&(e, _)| !overlaps(e, extent));
        self.keys.push((extent, key));
    }

    pub(super) fn forget(&mut self, extent: Extent) {
        self.keys.retain(|&(e, _)| !overlaps(e, extent));
    }

    /// The key for a WRITE of `len` bytes at `offset`, if a lease holds it
    /// whole. A WRITE outside every lease goes with the region's key, which
    /// the server refuses when it confines writes to leases.
    #[inline]
    pub(super) fn for_write(&self, offset: u64, len: usize) -> Option<u32> {
        let end = offset.checked_add(len as u64)?;
        self.keys
            .iter()
            .find(|(e, _)| e.offset <= offset && end <= e.offset.saturating_add(e.len))
            .map(|&(_, key)| key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    #[test]
    fn a_write_takes_the_key_of_the_lease_that_holds_it_whole() {
        let mut keys = WriteKeys::default();
        keys.allow(extent(4096, 8192), 7);
        keys.allow(extent(65536, 4096), 9);
        assert_eq!(keys.for_write(4096, 64), Some(7));
        assert_eq!(keys.for_write(12288 - 8, 8), Some(7));
        assert_eq!(keys.for_write(12288 - 8, 16), None, "runs past the lease");
        assert_eq!(keys.for_write(65536, 4096), Some(9));
        assert_eq!(keys.for_write(0, 8), None);
        assert_eq!(keys.for_write(u64::MAX - 4, 8), None);
        keys.forget(extent(4096, 8192));
        assert_eq!(keys.for_write(4096, 64), None, "given back");
        assert_eq!(keys.for_write(65536, 8), Some(9));
        // A lease over the same space again replaces the old key.
        keys.allow(extent(65536, 4096), 11);
        assert_eq!(keys.for_write(65536, 8), Some(11));
    }
}
