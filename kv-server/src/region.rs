//! The server's side of the region: create it, or reopen and validate an
//! existing one (never overwriting a file it does not understand), and scan
//! the index for live blocks.

use std::path::Path;

use kv_common::layout::{Geometry, KeyHash, Slot, BUCKET_BYTES, SLOTS_PER_BUCKET};
use kv_common::protocol::Extent;
use kv_common::transport::shm::SharedRegion;
use kv_common::transport::TransportError;

use crate::ServerError;

pub struct OpenedRegion {
    pub region: SharedRegion,
    pub geometry: Geometry,
    pub created: bool,
}

/// Opens the region at `path`, or creates it with `geometry` when there is
/// no file (or an empty one).
pub fn open_or_create(path: &Path, geometry: &Geometry) -> Result<OpenedRegion, ServerError> {
    let io = |e: std::io::Error| ServerError::Region {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let exists = std::fs::metadata(path)
        .map(|m| m.len() > 0)
        .unwrap_or(false);
    if !exists {
        let _ = std::fs::remove_file(path);
        let region = SharedRegion::create(path, geometry.region_len).map_err(io)?;
        for (i, w) in geometry.encode_header().iter().enumerate() {
            region
                .store(i as u64 * 8, *w)
                .map_err(|e| transport(path, e))?;
        }
        return Ok(OpenedRegion {
            region,
            geometry: *geometry,
            created: true,
        });
    }
    let region = SharedRegion::open(path).map_err(io)?;
    let mut words = [0u64; 10];
    region.read(0, &mut words).map_err(|e| transport(path, e))?;
    let found = Geometry::decode_header(&words).map_err(|e| ServerError::Region {
        path: path.to_path_buf(),
        reason: format!("{e}; refusing to use it (move it away or pick another path)"),
    })?;
    if found.region_len != region.len() {
        return Err(ServerError::Region {
            path: path.to_path_buf(),
            reason: format!(
                "header says {} bytes, file has {}",
                found.region_len,
                region.len()
            ),
        });
    }
    Ok(OpenedRegion {
        region,
        geometry: found,
        created: false,
    })
}

fn transport(path: &Path, e: TransportError) -> ServerError {
    ServerError::Region {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// Calls `f` for every occupied slot of the index (server-side reads only).
pub fn for_each_slot(
    region: &SharedRegion,
    g: &Geometry,
    mut f: impl FnMut(u64, Slot),
) -> Result<(), TransportError> {
    let mut bucket = [0u64; SLOTS_PER_BUCKET];
    for b in 0..g.bucket_count {
        region.read(g.bucket_offset(b), &mut bucket)?;
        for &w in &bucket {
            if w != 0 {
                f(b, Slot(w));
            }
        }
    }
    Ok(())
}

/// The heap extents that live slots point at; slots pointing outside the
/// heap are reported and skipped.
pub fn live_blocks(region: &SharedRegion, g: &Geometry) -> Result<Vec<Extent>, TransportError> {
    let heap_end = g.heap_offset + g.heap_size;
    let mut live = Vec::new();
    for_each_slot(region, g, |bucket, slot| {
        let (offset, len) = (slot.offset(), slot.block_len());
        if offset >= g.heap_offset && offset.checked_add(len).is_some_and(|e| e <= heap_end) {
            live.push(Extent { offset, len });
        } else {
            tracing::warn!(
                bucket,
                slot = format!("{:#x}", slot.0),
                "slot points outside the heap; ignored"
            );
        }
    })?;
    Ok(live)
}

/// How many index slots hold a block of `key` (an inspection for operators
/// and tests: after concurrent inserts of one key it must be exactly one).
pub fn slots_holding(
    region: &SharedRegion,
    g: &Geometry,
    key: &[u8],
) -> Result<usize, TransportError> {
    let h = KeyHash::new(key, g.bucket_count);
    let mut count = 0;
    for b in h.buckets() {
        let mut words = [0u64; SLOTS_PER_BUCKET];
        region.read(g.index_offset + b * BUCKET_BYTES, &mut words)?;
        for w in words {
            let slot = Slot(w);
            if slot.is_empty() || slot.fingerprint() != h.fingerprint {
                continue;
            }
            let mut block = vec![0u64; (slot.block_len() / 8) as usize];
            region.read(slot.offset(), &mut block)?;
            let bytes: Vec<u8> = block.iter().flat_map(|w| w.to_le_bytes()).collect();
            if kv_common::layout::decode_block(&bytes).is_ok_and(|v| v.key == key) {
                count += 1;
            }
        }
    }
    Ok(count)
}
