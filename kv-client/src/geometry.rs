//! Following the server's geometry: a resize publishes a new index, a
//! growth a longer region. A client learns of either only when it meets it
//! (a frozen slot, a block past the region it knows, a lease beyond it), so
//! the hot path pays nothing for it.

use std::time::{Duration, Instant};

use kv_common::protocol::{GeometryInfo, Request, Response};

use crate::{unexpected, Client, Error, Result, RESIZE_WAIT};

impl Client {
    /// Learns the server's current geometry; with `resize`, first asks for a
    /// resize of the index this client knows. Waits while a resize is under
    /// way for it to publish the new index. Returns once the geometry is newer
    /// than the one this client had (true), or (without `resize`) nothing
    /// newer is coming (false).
    pub(crate) fn follow_geometry(&mut self, resize: bool) -> Result<bool> {
        let epoch = self.info.geometry.epoch;
        let give_up = Instant::now() + RESIZE_WAIT;
        let backoff = crossbeam::utils::Backoff::new();
        loop {
            let request = if resize {
                Request::Resize { epoch }
            } else {
                Request::Geometry
            };
            let info = match self.conn.call(&request)? {
                Response::Geometry(info) => info,
                other => return Err(unexpected(other)),
            };
            if info.geometry.epoch != epoch {
                self.adopt(info)?;
                return Ok(true);
            }
            if !info.resizing && !resize {
                return Ok(false);
            }
            if Instant::now() > give_up {
                return Err(Error::Protocol(format!(
                    "the server's index resize did not finish within {RESIZE_WAIT:?}"
                )));
            }
            // Spin briefly, then sleep: a resize takes milliseconds to seconds.
            if backoff.is_completed() {
                std::thread::sleep(Duration::from_millis(2));
            } else {
                backoff.snooze();
            }
        }
    }

    /// Waits out a resize met in the middle of an insert's duplicate check:
    /// true if a new index was published (its copy kept the lowest copy),
    /// false if the index is the same (the heap grew, or the resize was
    /// undone) and the check goes on here.
    pub(crate) fn follow_to_new_index(&mut self) -> Result<bool> {
        let before = (
            self.info.geometry.index_offset,
            self.info.geometry.bucket_count,
        );
        self.follow_geometry(false)?;
        let g = &self.info.geometry;
        Ok((g.index_offset, g.bucket_count) != before)
    }

    /// Switches to a new geometry: a grown region is mapped (or its new key
    /// taken), and hints into a replaced index are dropped.
    pub(crate) fn adopt(&mut self, info: GeometryInfo) -> Result<()> {
        info.geometry
            .validate()
            .map_err(|e| Error::Protocol(e.to_string()))?;
        if info.geometry.chunk_size != self.info.geometry.chunk_size {
            return Err(Error::Protocol("the region's chunk size changed".into()));
        }
        if info.region != self.info.region {
            self.conn.attach(&info.region, self.layout.len)?;
            self.info.region = info.region;
        }
        let g = (&self.info.geometry, &info.geometry);
        if (g.0.index_offset, g.0.bucket_count) != (g.1.index_offset, g.1.bucket_count) {
            // Hints name slots of the old index.
            self.cache.clear();
        }
        self.info.geometry = info.geometry;
        Ok(())
    }
}
