//! Following the server's geometry: a resize publishes a new index, a
//! growth a longer region. A client learns of either only when it meets it
//! (a frozen slot, a block past the region it knows, a lease beyond it), so
//! the hot path pays nothing for it.

use std::time::{Duration, Instant};

use kv_common::protocol::{GeometryInfo, Request, Response};

use crate::{unexpected, Client, Error, Result, RESIZE_WAIT};

/// How long a writer waits on frozen slots while the server reports no
/// resize under way (it thaws them once told) before it gives up.
const STRAY_FROZEN_WAIT: Duration = Duration::from_secs(10);
/// How often a writer waiting on them tells the server again.
const STRAY_REPORT_EVERY: Duration = Duration::from_millis(50);

/// A writer's wait on frozen slots with no resize under way.
pub(crate) struct StrayFrozenWait {
    since: Instant,
    reported: Option<Instant>,
}

/// What [`Client::follow_geometry`] asks the server.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ask<'a> {
    /// The geometry in force (waiting out a resize under way).
    Geometry,
    /// A resize of the index this client knows: `full_key` found no room
    /// (None: the caller asks for one).
    Resize { full_key: Option<&'a [u8]> },
}

impl Client {
    /// Learns the server's current geometry, after asking for a resize if
    /// `ask` says so. Waits while a resize is under way for it to publish
    /// the new index. Returns once the geometry is newer than the one this
    /// client had (true), or nothing newer is coming (false: no resize
    /// under way, or the server declined the one asked for).
    pub(crate) fn follow_geometry(&mut self, ask: Ask<'_>) -> Result<bool> {
        let epoch = self.info.geometry.epoch;
        let give_up = Instant::now() + RESIZE_WAIT;
        let backoff = crossbeam::utils::Backoff::new();
        // A resize that ended with no new index (it failed) is asked for
        // once more; a request answered with none under way was declined.
        let mut was_resizing = false;
        loop {
            let request = match ask {
                Ask::Resize { full_key } => Request::Resize {
                    epoch,
                    full_key: full_key.map(<[u8]>::to_vec),
                },
                Ask::Geometry => Request::Geometry,
            };
            let info = match self.call(&request)? {
                Response::Geometry(info) => info,
                other => return Err(unexpected(other)),
            };
            if info.geometry.epoch != epoch {
                self.adopt(info)?;
                return Ok(true);
            }
            if !info.resizing && (matches!(ask, Ask::Geometry) || !was_resizing) {
                return Ok(false);
            }
            was_resizing = info.resizing;
            if Instant::now() > give_up {
                return Err(Error::Stalled(format!(
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

    /// Frozen slots met while no resize is under way (after
    /// [`Client::follow_geometry`] found none): stray bits — damage, or a
    /// client that set them — or a failed resize being undone. Tells the
    /// server, which thaws stray ones (at most every `STRAY_REPORT_EVERY`),
    /// and pauses; the caller then redoes its step.
    ///
    /// # Errors
    ///
    /// Once the slots have stayed frozen for `STRAY_FROZEN_WAIT`.
    pub(crate) fn wait_out_stray_frozen(
        &mut self,
        wait: &mut Option<StrayFrozenWait>,
    ) -> Result<()> {
        let now = Instant::now();
        let w = wait.get_or_insert(StrayFrozenWait {
            since: now,
            reported: None,
        });
        if now.duration_since(w.since) > STRAY_FROZEN_WAIT {
            return Err(Error::Stalled(format!(
                "index slots stayed frozen for {STRAY_FROZEN_WAIT:?} with no resize under way \
                 (the server was told; a client may be setting them)"
            )));
        }
        if w.reported
            .is_none_or(|at| now.duration_since(at) >= STRAY_REPORT_EVERY)
        {
            w.reported = Some(now);
            let epoch = self.info.geometry.epoch;
            match self.call(&Request::StrayFrozen { epoch })? {
                Response::Geometry(info) if info.geometry.epoch != epoch => self.adopt(info)?,
                Response::Geometry(_) => {}
                other => return Err(unexpected(other)),
            }
        }
        std::thread::sleep(Duration::from_millis(1));
        Ok(())
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
        self.follow_geometry(Ask::Geometry)?;
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
