//! Heap space for new blocks: carved from extents the server leases to this
//! client (`alloc`), which are given back whole when used up, with where
//! each block starts. And the other half of reclamation: the blocks this
//! client unlinks, reported in batches, which the server frees once it has
//! checked them. The server keeps the blocks the index references and
//! reclaims the rest.

use std::time::Instant;

use kv_common::layout::{class_size, Slot};
use kv_common::protocol::{ErrorKind, Request, Response, Spent, Unlinked, MAX_MESSAGE};

use crate::geometry::Ask;
use crate::{unexpected, Client, Error, Result, SPACE_WAIT};

/// Unlinked blocks reported in one message: one control round trip per
/// this many updates or deletes.
pub const REPORT_BATCH: usize = 2048;
/// Unlinks not reported after the server said it wants no more reports
/// (it reclaims by scanning then); the next report asks again.
const REPORTS_HELD_BACK: u32 = 64 * REPORT_BATCH as u32;
/// Most bytes one report or one given-back extent (besides its starts)
/// takes encoded.
const REPORT_BYTES: usize = 12;
const SPENT_BYTES: usize = 32;
/// What one message may carry, well inside the limit.
const MESSAGE_BUDGET: usize = MAX_MESSAGE - 8 * 1024;

impl Client {
    /// A block of `class`. When no leased extent has room, what this client
    /// holds is given back and a new extent is leased. While the server is
    /// reclaiming space it waits; it fails only when the heap is full.
    pub(crate) fn take_block(&mut self, class: u8) -> Result<u64> {
        if let Some(offset) = self.alloc.take(class) {
            return Ok(offset);
        }
        let spent = self.alloc.drain();
        if !spent.is_empty() {
            self.give_back(spent)?;
        }
        let size = class_size(class);
        let give_up = Instant::now() + SPACE_WAIT;
        loop {
            match self.call(&Request::Lease { min_len: size })? {
                Response::Leased {
                    extents,
                    write_keys,
                } => {
                    if !write_keys.is_empty() && write_keys.len() != extents.len() {
                        return Err(Error::Protocol(format!(
                            "a lease of {} extents with {} write keys",
                            extents.len(),
                            write_keys.len()
                        )));
                    }
                    for (&e, &key) in extents.iter().zip(&write_keys) {
                        self.conn.allow_writes(e, key);
                    }
                    self.alloc.add_extents(&extents);
                    // Space the region grew by: learn its geometry first.
                    let end = extents.iter().map(|e| e.offset + e.len).max();
                    if end.is_some_and(|end| end > self.info.geometry.region_len) {
                        self.follow_geometry(Ask::Geometry)?;
                    }
                    if let Some(offset) = self.alloc.take(class) {
                        return Ok(offset);
                    }
                    return Err(Error::Protocol(format!(
                        "leased {extents:?}, no room for a {size}-byte block"
                    )));
                }
                Response::Error {
                    kind: ErrorKind::HeapBusy,
                    ..
                } if Instant::now() < give_up => {
                    std::thread::sleep(self.timing.space_poll());
                }
                Response::Error {
                    kind: ErrorKind::HeapFull | ErrorKind::HeapBusy,
                    message,
                } => {
                    return Err(Error::RegionFull {
                        size,
                        reason: message,
                    })
                }
                other => return Err(unexpected(other)),
            }
        }
    }

    /// Gives `spent` back, with the reports not yet sent, in messages
    /// that stay well inside the control message limit.
    pub(crate) fn give_back(&mut self, spent: Vec<Spent>) -> Result<()> {
        let mut unlinked = std::mem::take(&mut self.unlinked);
        if unlinked.len() * REPORT_BYTES > MESSAGE_BUDGET / 2 {
            self.send_reports(std::mem::take(&mut unlinked))?;
        }
        let mut message: Vec<Spent> = Vec::new();
        let mut bytes = unlinked.len() * REPORT_BYTES;
        for mut s in spent {
            if s.starts.len() + SPENT_BYTES > MESSAGE_BUDGET {
                // More than a message holds (a chunk larger than any this
                // client makes): given back undeclared, for a scan.
                s = Spent::undeclared(s.extent);
            }
            if bytes + s.starts.len() + SPENT_BYTES > MESSAGE_BUDGET {
                self.give_back_call(std::mem::take(&mut message), std::mem::take(&mut unlinked))?;
                bytes = 0;
            }
            bytes += s.starts.len() + SPENT_BYTES;
            message.push(s);
        }
        if !message.is_empty() || !unlinked.is_empty() {
            self.give_back_call(message, unlinked)?;
        }
        Ok(())
    }

    fn give_back_call(&mut self, spent: Vec<Spent>, unlinked: Vec<Unlinked>) -> Result<()> {
        for s in &spent {
            self.conn.forget_writes(s.extent);
        }
        match self.call(&Request::GiveBack { spent, unlinked })? {
            Response::GivenBack => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// This client's CAS replaced or emptied a slot that held `old`: its
    /// block is garbage once the server has checked it. Reports go out in
    /// batches; sending one that fails is not this operation's failure
    /// (what a lost report named is reclaimed by a scan).
    pub(crate) fn unlinked(&mut self, old: Slot) {
        let old = old.thawed();
        if old.is_empty() {
            return;
        }
        if self.reports_held_back > 0 {
            // The server reclaims by scanning for now.
            self.reports_held_back -= 1;
            return;
        }
        self.unlinked.push(Unlinked {
            offset: old.offset(),
            class: old.class(),
        });
        if self.unlinked.len() >= REPORT_BATCH {
            let reports = std::mem::take(&mut self.unlinked);
            // A broken connection shows in the next operation; the
            // blocks are left to a scan.
            let _ = self.send_reports(reports);
        }
    }

    fn send_reports(&mut self, blocks: Vec<Unlinked>) -> Result<()> {
        match self.call(&Request::Unlinked { blocks })? {
            Response::Noted { more } => {
                if !more {
                    self.reports_held_back = REPORTS_HELD_BACK;
                }
                Ok(())
            }
            other => Err(unexpected(other)),
        }
    }
}
