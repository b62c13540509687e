//! Heap space for new blocks: carved from extents the server leases to this
//! client (`alloc`), which are given back whole when used up. The server
//! keeps the blocks in them that the index references and reclaims the rest.

use std::time::Instant;

use kv_common::layout::class_size;
use kv_common::protocol::{ErrorKind, Extent, Request, Response};

use crate::geometry::Ask;
use crate::{unexpected, Client, Error, Result, SPACE_WAIT};

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
            match self.conn.call(&Request::Lease { min_len: size })? {
                Response::Leased(extents) => {
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

    pub(crate) fn give_back(&mut self, extents: Vec<Extent>) -> Result<()> {
        // Stay well inside the control message size limit.
        for part in extents.chunks(2048) {
            match self.conn.call(&Request::GiveBack {
                extents: part.to_vec(),
            })? {
                Response::GivenBack => {}
                other => return Err(unexpected(other)),
            }
        }
        Ok(())
    }
}
