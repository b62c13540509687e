//! The connection's local buffer, laid out once per connection: where the
//! key's windows of buckets land, the epoch word, the results of a CAS
//! and of an insert lock's release, a slot read alone, the block being
//! written, and room for the candidate blocks read back.

use kv_common::layout::{
    block_len, class_for, class_size, Geometry, BUCKET_BYTES, MAX_KEY, WINDOW_BUCKETS,
};
use kv_common::transport::MAX_BATCH_VERBS;

pub const WINDOW_BYTES: usize = WINDOW_BUCKETS * BUCKET_BYTES as usize;
/// Keys one batch of a multi-key operation covers: two window READs each
/// fill a batch.
pub const BATCH_KEYS: usize = MAX_BATCH_VERBS / 2;

#[derive(Debug, Clone, Copy)]
pub struct LocalLayout {
    /// Both windows, back to back: slot `i` of the key's candidates is the
    /// word at `windows + 8 * i`.
    pub windows: usize,
    /// The region's epoch word.
    pub epoch: usize,
    /// The old value a CAS returns.
    pub cas: usize,
    /// The old value the CAS that lets an insert lock go returns, when it
    /// rides in the batch of another CAS (a replicated write's commit).
    pub release: usize,
    /// One slot read alone (a sole hint's).
    pub slot: usize,
    /// The windows of the keys of a multi-key batch, then one slot word per
    /// key (a hinted key's).
    pub batch: usize,
    /// The block a PUT writes.
    pub block: usize,
    /// Candidate blocks, back to back, from here to `len`.
    pub reads: usize,
    /// The whole buffer.
    pub len: usize,
}

impl LocalLayout {
    /// Room for the windows, the words, the block being written and at least
    /// two candidate blocks. The chunk size (and so the largest block) never
    /// changes for a region, so neither does this.
    pub fn for_geometry(g: &Geometry) -> LocalLayout {
        // The largest block any client writes: a maximal key and value.
        let largest = block_len(MAX_KEY, g.max_value());
        let max_block = class_for(largest).map_or(g.max_block(), class_size) as usize;
        let windows = 0;
        let epoch = windows + 2 * WINDOW_BYTES;
        let cas = epoch + 8;
        let release = cas + 8;
        let slot = release + 8;
        let batch = (slot + 8).next_multiple_of(64);
        let batch_end = batch + BATCH_KEYS * (2 * WINDOW_BYTES + 8);
        let block = batch_end.next_multiple_of(64);
        let reads = block + max_block;
        LocalLayout {
            windows,
            epoch,
            cas,
            release,
            slot,
            batch,
            block,
            reads,
            len: reads + 2 * max_block,
        }
    }

    /// Where window `w` (0 or 1) of the key's buckets lands.
    pub fn window(&self, w: usize) -> usize {
        self.windows + w * WINDOW_BYTES
    }

    /// Where window `w` of key `k` of a multi-key batch lands.
    pub fn batch_window(&self, k: usize, w: usize) -> usize {
        self.batch + (2 * k + w) * WINDOW_BYTES
    }

    /// Where the slot word of key `k` of a multi-key batch lands.
    pub fn batch_word(&self, k: usize) -> usize {
        self.batch + BATCH_KEYS * 2 * WINDOW_BYTES + 8 * k
    }

    /// Bytes of candidate blocks one batch can read back.
    pub fn read_room(&self) -> usize {
        self.len - self.reads
    }
}
