//! How full the index is: the sample its doubling threshold reads, and
//! whether a client's request to double it is warranted.

use kv_common::layout::{Geometry, KeyHash, Slot, MAX_KEY, SLOTS_PER_BUCKET, WINDOW_BUCKETS};
use kv_common::mapping::SharedRegion;
use kv_common::transport::TransportError;

/// Buckets the occupancy sample reads (all of a smaller index).
const SAMPLE_BUCKETS: u64 = 4096;

/// When the index doubles.
#[derive(Debug, Clone, Copy)]
pub struct ResizePolicy {
    /// By itself: when this fraction of its slots is in use.
    pub resize_at: f64,
    /// On any client's request: while the doubled index takes at most this
    /// many bytes (beyond, see [`resize_warranted`]).
    pub on_request_up_to: u64,
}

/// The used fraction of up to `SAMPLE_BUCKETS` buckets spread over the index.
pub fn occupancy(region: &SharedRegion, g: &Geometry) -> Result<f64, TransportError> {
    const RUN: u64 = 64;
    let runs = (SAMPLE_BUCKETS / RUN).min(g.bucket_count / RUN).max(1);
    let run = g.bucket_count.min(RUN);
    let stride = g.bucket_count / runs;
    let mut words = vec![0u64; (run as usize) * SLOTS_PER_BUCKET];
    let (mut used, mut seen) = (0u64, 0u64);
    for r in 0..runs {
        region.read(g.bucket_offset(r * stride), &mut words)?;
        used += words
            .iter()
            .filter(|&&w| !Slot(w).thawed().is_empty())
            .count() as u64;
        seen += words.len() as u64;
    }
    Ok(used as f64 / seen as f64)
}

/// Whether a client's resize request is worth doubling the index for
/// (otherwise any client could double it at will, each request a doubling
/// of its memory, which never shrinks): the doubled index is small
/// (`on_request_up_to`); or the index is at least half as full as
/// `resize_at`; or the key the client named has all its candidate slots
/// occupied and the index is at least a quarter as full (a key that finds
/// no room in an emptier index is no accident: crafted keys would buy a
/// doubling for every 48 inserts).
pub fn resize_warranted(
    region: &SharedRegion,
    g: &Geometry,
    policy: ResizePolicy,
    full_key: Option<&[u8]>,
) -> bool {
    if kv_common::layout::index_bytes(g.bucket_count * 2) <= policy.on_request_up_to {
        return true;
    }
    let Ok(occupancy) = occupancy(region, g) else {
        return false;
    };
    let resize_at = policy.resize_at;
    occupancy >= resize_at / 2.0
        || (occupancy >= resize_at / 4.0 && full_key.is_some_and(|key| has_no_room(region, g, key)))
}

/// Whether every candidate slot of `key` is occupied.
fn has_no_room(region: &SharedRegion, g: &Geometry, key: &[u8]) -> bool {
    if key.is_empty() || key.len() > MAX_KEY {
        return false;
    }
    let kh = KeyHash::new(key, g.bucket_count);
    let mut window = [0u64; WINDOW_BUCKETS * SLOTS_PER_BUCKET];
    kh.windows.iter().all(|&first| {
        region.read(g.bucket_offset(first), &mut window).is_ok()
            && window.iter().all(|&w| !Slot(w).thawed().is_empty())
    })
}
