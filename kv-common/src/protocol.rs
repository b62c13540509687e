//! Two-sided control messages (connect, lease, return space, geometry and
//! resize, stats, disconnect). They are serde types encoded with postcard; the data path
//! never uses them.

use serde::{Deserialize, Serialize};

use crate::layout::Geometry;

/// A region registered by the server, as a client names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Address of byte 0 on the server (an RDMA virtual address; 0 on shm).
    pub base: u64,
    pub len: u64,
    /// Access key handed out at connect; it changes at every registration
    /// (and on shm at every connect).
    pub rkey: u32,
    /// shm only: the key-table entry that holds this connection's key, so
    /// the server can cut off one client (rdma does that per queue pair).
    pub key_slot: u32,
}

/// Bumped when a message changes shape, or what clients must do on the
/// data path does (4: an insert CASes within the operation deadline of the
/// read that found no copy, which clients' settled hints rely on; 5:
/// counter blocks, which older clients would take for damage; 6: a settled
/// counter is sealed before it is unlinked, which one-round-trip atomics
/// rely on; 7: a resize request names the key that found no room; 8:
/// clients report the blocks they unlink and declare the blocks of the
/// space they give back; 9: a lease carries the keys its WRITEs take; 10:
/// a cluster's map page carries each shard's backups; 12: a copy of a
/// replicated shard serves reads for a bounded time that clients renew,
/// `ConnectInfo::read_lease_us`); 13: a replicated shard's insert locks
/// are words of its primary's region that clients CAS, no longer control
/// messages, so two versions' writers would not exclude each other). A
/// request or reply added at the end of its enum needs no new version: the
/// others' encoding is unchanged, and a peer that lacks it fails to decode
/// that one message (a client of version 8 before `ClusterMap` meets a
/// member's address that way).
pub const PROTOCOL_VERSION: u32 = 13;
/// Largest encoded message either side accepts.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// A run of heap bytes: leased to a client, or given back by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

/// Bytes of heap one bit of [`Spent::starts`] stands for (every block
/// starts on such a boundary).
pub const START_GRANULE: u64 = crate::layout::BLOCK_ALIGN;

/// Leased space given back, with what its client wrote there: blocks were
/// carved front to back from `extent.offset` up to `carved` bytes in, and
/// bit `i` of `starts` (byte `i / 8`, bit `i % 8`) says that one begins at
/// `extent.offset + i * START_GRANULE`. The server believes this only about
/// the client's own space (only it wrote there): it is what lets a report
/// of an unlinked block free that block without an index scan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spent {
    pub extent: Extent,
    pub carved: u64,
    #[serde(with = "byte_run")]
    pub starts: Vec<u8>,
}

/// A `Vec<u8>` encoded as serde bytes. In postcard that is the encoding of
/// a sequence of `u8` (a varint length, then the bytes), so the wire does
/// not change; decoding copies the run once instead of visiting each byte
/// (a give-back of a fragmented lease carries a thousand bitmaps).
mod byte_run {
    use std::fmt;

    use serde::de::{self, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        d.deserialize_byte_buf(Run)
    }

    struct Run;

    impl<'de> Visitor<'de> for Run {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a run of bytes")
        }

        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(super::MAX_MESSAGE));
            while let Some(b) = seq.next_element()? {
                out.push(b);
            }
            Ok(out)
        }
    }
}

impl Spent {
    /// Space given back with nothing said about it: it is reclaimed by an
    /// index scan.
    pub fn undeclared(extent: Extent) -> Spent {
        Spent {
            extent,
            carved: extent.len,
            starts: Vec::new(),
        }
    }
}

/// A block a client unlinked: the slot its CAS replaced or emptied named
/// it. Reports are checked, never trusted (see `kv-server`'s `registry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Unlinked {
    pub offset: u64,
    pub class: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Must be the first message. `secret` is checked when the server has
    /// one; `group`, the group epoch of the shard's copies the client
    /// routes by (a cluster's map: 0 outside a cluster, or before any
    /// failover), must be the copy's own.
    Connect {
        protocol_version: u32,
        secret: Vec<u8>,
        group: u64,
    },
    /// Lease heap space: one or more extents, the first of at least
    /// `min_len` bytes (at most a chunk).
    Lease {
        min_len: u64,
    },
    /// Give back leased space this client will not write into again (an
    /// extent it has filled, or all it holds at disconnect). It may hold live
    /// blocks: the server frees only what the index does not reference. Only
    /// space leased to this client is accepted, all of a message or none.
    /// `unlinked` are reports as in [`Request::Unlinked`], taken first.
    GiveBack {
        spent: Vec<Spent>,
        unlinked: Vec<Unlinked>,
    },
    /// Blocks this client unlinked since its last report: the server frees
    /// each once it has checked that nothing references it (and, for a
    /// block in space still leased, once that space is given back).
    Unlinked {
        blocks: Vec<Unlinked>,
    },
    /// The current geometry and how to reach the region (a client asks
    /// when it met a frozen slot, a block past the region it knows, or an
    /// epoch newer than its own).
    Geometry,
    /// Start a resize of the index of epoch `epoch`: a client found no room
    /// for `full_key` (the server checks that its buckets are full), or an
    /// operator asked (None). Answered at once with the geometry, which
    /// says `resizing` when the resize was warranted and started; the
    /// client then waits for a newer epoch.
    Resize {
        epoch: u64,
        full_key: Option<Vec<u8>>,
    },
    /// A writer met frozen slots in the index of epoch `epoch` while the
    /// server reported no resize under way: stray frozen bits (damage, or
    /// a client that set them), which the server thaws. Answered with the
    /// geometry.
    StrayFrozen {
        epoch: u64,
    },
    Stats,
    Disconnect,
    /// A cluster member's own address (not a shard's) answers only this:
    /// its shard map, from shard `first` on (the map comes in pages, each
    /// within [`MAX_MESSAGE`]). No `Connect` first: the map is what a
    /// client needs to know where to connect. A client built without etcd
    /// reads the cluster this way.
    ClusterMap {
        protocol_version: u32,
        first: u32,
    },
    /// Renew this client's read lease on a copy of a replicated shard
    /// (see [`ConnectInfo::read_lease_us`]). Answered with
    /// [`Response::ReadLease`], or refused as `StaleGroup` once the copy's
    /// member cannot confirm its own lease.
    ReadLease,
    /// One page of the keys this region holds, each with a digest of its
    /// value as readers see it, from index bucket `from` on (of the
    /// geometry in force: the page says which), the digests seeded by
    /// `seed`.
    /// Answered with [`Response::Keys`]. What it is for: comparing two
    /// copies of a replicated shard without reading every value over the
    /// wire (kv-server's `level`).
    Keys {
        from: u64,
        seed: u64,
    },
}

/// A page of a region's keys (see [`Request::Keys`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysPage {
    /// The geometry's epoch the slots are numbered by; pages of another
    /// epoch (a resize between them) do not make one listing.
    pub epoch: u64,
    /// A resize was under way: keys may be missing from this page.
    pub resizing: bool,
    /// The bucket the next page starts at; None after the last bucket.
    pub next: Option<u64>,
    /// Slots in this page whose block failed validation: their keys are
    /// not known.
    pub damaged: u64,
    pub keys: Vec<KeyDigest>,
}

/// A key and a digest of its value (None: a counter, compared by value
/// by whoever needs to).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyDigest {
    pub key: Vec<u8>,
    pub digest: Option<u128>,
}

/// A live member of a cluster, as a client needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberAddress {
    pub id: String,
    /// Its `--listen` address; its shards are served beside it.
    pub listen: String,
    pub incarnation: i64,
    pub draining: bool,
}

/// One page of a cluster's shard map, as a member knows it from etcd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapPage {
    /// The cluster's name.
    pub cluster: String,
    pub shards: u32,
    pub initial_members: u32,
    /// etcd's revision the member's view is as of: pages of one revision
    /// make one map, and a client keeps the newest it has seen.
    pub revision: i64,
    /// The map's epoch; None before the first map (and then no owners).
    pub epoch: Option<u64>,
    pub members: Vec<MemberAddress>,
    /// The ids `owners` and `moving` name by position.
    pub names: Vec<String>,
    /// The owners of shards `first..first + owners.len()`: a position in
    /// `names`, or [`NO_OWNER`].
    pub first: u32,
    pub owners: Vec<u32>,
    /// The shard being moved and its target (a position in `names`). The
    /// move's secret stays with the members.
    pub moving: Option<(u32, u32)>,
    /// Copies of each shard.
    pub replicas: u32,
    /// The backups of the same shards as `owners` (positions in `names`);
    /// empty when the cluster keeps one copy.
    pub backups: Vec<Vec<u32>>,
    /// The group epochs of the same shards (what their copies ask at
    /// connect); empty when none has failed over.
    pub group_epochs: Vec<u64>,
}

/// In [`MapPage::owners`]: a shard no member owns yet.
pub const NO_OWNER: u32 = u32::MAX;

/// The geometry in force and how this client names the region under it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GeometryInfo {
    pub geometry: Geometry,
    pub region: RemoteRegion,
    /// A resize is migrating the index: a newer epoch is coming.
    pub resizing: bool,
}

/// What a connected client learns: where the region is and how it is laid out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectInfo {
    pub client_id: u64,
    pub region: RemoteRegion,
    pub geometry: Geometry,
    /// A one-sided operation whose reads took longer than this is retried; a
    /// freed block is reused only after [`GRACE_DEADLINES`] of these (the
    /// grace period).
    pub op_deadline_us: u64,
    /// For a copy of a replicated shard: for how long, from when the
    /// client sent its `Connect`, it may read this region before renewing
    /// (`Request::ReadLease`). The server grants no more than its member's
    /// lease is sure to last, so a copy that a failover may replace (its
    /// server frozen, its region still readable over rdma) serves no
    /// client past the moment a new primary could take writes. None: the
    /// region is no replicated copy, and reads need no lease.
    pub read_lease_us: Option<u64>,
}

/// The grace period, in operation deadlines: space found unreferenced is
/// reused only this many deadlines later. Clients rely on it (a hint
/// confirmed less than grace − deadline ago cannot name a reused block).
pub const GRACE_DEADLINES: u32 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    BadSecret,
    VersionMismatch,
    NotConnected,
    Malformed,
    /// No free space, and none is being reclaimed.
    HeapFull,
    /// No free space right now, but some is being reclaimed: retry shortly.
    HeapBusy,
    /// A give-back named space this client does not hold.
    BadExtent,
    /// The server already serves as many clients as it is configured for.
    TooManyClients,
    /// The index cannot grow (its cap, or no memory for a larger one).
    IndexFull,
    /// A cluster member's own address was asked for a region: it serves
    /// only the shard map ([`Request::ClusterMap`]).
    ClusterMember,
    /// A shard map was asked of a single server, or of a member that is
    /// out of its cluster until it rejoins.
    NoMap,
    /// Leased space could not be made writable for this client (over rdma,
    /// its memory window): the server closes the channel and the lease.
    WriteGrant,
    /// The client routes by another group epoch than this copy serves
    /// (a failover changed the shard's primary): it reads the map again.
    StaleGroup,
}

/// Counters a server keeps about its control plane and heap.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStats {
    /// Clients connected now.
    pub clients_connected: u64,
    /// Open control channels, connected or not yet.
    pub connections: u64,
    /// Clients admitted since the server started.
    pub connects: u64,
    /// Connections refused (wrong secret or version, too many clients).
    pub rejected_connects: u64,
    /// Heap chunks leased to clients.
    pub leases: u64,
    /// Extents clients gave back.
    pub give_backs: u64,
    /// Give-backs refused because they named space the client does not hold.
    pub refused_give_backs: u64,
    /// `Unlinked` messages (reports also ride on give-backs).
    pub report_messages: u64,
    /// Unlinked blocks clients reported.
    pub reported_blocks: u64,
    /// Reported blocks freed (after a check, without an index scan).
    pub freed_on_report: u64,
    /// Reports that freed nothing: the block was still referenced, not
    /// declared by its writer, already freed, or the queue was full (an
    /// index scan finds what they named, if it is garbage).
    pub refused_reports: u64,
    /// Stats requests answered.
    pub stats_requests: u64,
    /// Clients that said goodbye.
    pub disconnects: u64,
    /// Clients that went away without saying goodbye (crashed, or cut off by
    /// a timeout or for misbehaving); their space was reclaimed.
    pub departures: u64,
    /// Control messages that could not be decoded or made no sense.
    pub malformed: u64,
    /// Bytes of the heap.
    pub heap_size: u64,
    /// Free heap bytes, counting those still waiting out their grace period.
    pub heap_free: u64,
    /// Bytes leased to connected clients (their unused space included).
    pub heap_leased: u64,
    /// Buckets of the index in force.
    pub bucket_count: u64,
    /// Occupied slots as of the last index scan (`index_scans` so far; the
    /// server scans when it reclaims space, not on every stats request).
    pub live_slots: u64,
    /// Bytes of the blocks those slots reference.
    pub live_bytes: u64,
    pub index_scans: u64,
    /// Slots whose class or offset cannot be a block, found by the scans.
    pub corrupt_slots: u64,
    /// CPU time the control plane and the reclaimer spent.
    pub server_cpu_us: u64,
    /// Changes of the geometry since the region was created.
    pub epoch: u64,
    /// Index resizes this server completed.
    pub resizes: u64,
    /// Whether one is under way.
    pub resizing: bool,
    /// Times the heap grew.
    pub growths: u64,
    /// The region's size now.
    pub region_bytes: u64,
    /// The size the region may grow to.
    pub max_region_bytes: u64,
    /// Slots of the current index (`live_slots` of them in use).
    pub index_slots: u64,
    /// Geometry and resize requests answered.
    pub geometry_requests: u64,
    /// Resize requests declined: the index was not full enough, nor the
    /// key named full.
    pub declined_resizes: u64,
    /// Frozen slots in the index as of the last scan (outside a resize,
    /// stray bits the server is about to thaw).
    pub frozen_slots: u64,
    /// Stray frozen slots the server thawed (found outside a resize by a
    /// scan, or reported by a writer that met them).
    pub thawed_slots: u64,
    /// Times the server found the header changed behind its back (a
    /// record or the epoch word not what it holds: damage, or a client
    /// that wrote there) and wrote it back. This and the fields after it
    /// come last, so that a client older than them still reads the rest
    /// (postcard leaves trailing bytes be).
    pub header_repairs: u64,
    /// Clients cut off because their data path failed on a request of
    /// their own: over rdma, an access the device refused (a WRITE outside
    /// their leases, a key not theirs), which puts their queue pair in
    /// error.
    pub faulted_clients: u64,
    /// Leases that could not be made writable for their client (over rdma,
    /// registering the extent or binding its window failed); the client
    /// was cut off.
    pub write_grant_failures: u64,
}

impl ServerStats {
    /// Fraction of the index's slots in use, as of the last scan.
    pub fn occupancy(&self) -> f64 {
        if self.index_slots == 0 {
            return 0.0;
        }
        self.live_slots as f64 / self.index_slots as f64
    }
}

impl ServerStats {
    /// Messages the control plane has handled, of every kind.
    pub fn messages(&self) -> u64 {
        self.connects
            + self.rejected_connects
            + self.leases
            + self.give_backs
            + self.report_messages
            + self.stats_requests
            + self.geometry_requests
            + self.disconnects
            + self.malformed
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Connected(ConnectInfo),
    /// Heap space leased, and the key a WRITE into each extent carries
    /// (in the same order; empty where writes need no key of their own:
    /// shm, or rdma serving the region writable by all).
    Leased {
        extents: Vec<Extent>,
        write_keys: Vec<u32>,
    },
    GivenBack,
    /// Reports of unlinked blocks were taken. `more`: whether the server
    /// wants more now; false while index scans reclaim space at less cost
    /// than checking reports does (updates scattered over many keys), and
    /// the client then holds its reports back for a while.
    Noted {
        more: bool,
    },
    Geometry(GeometryInfo),
    Stats(ServerStats),
    Goodbye,
    Error {
        kind: ErrorKind,
        message: String,
    },
    /// Variants are added at the end: the wire names them by position.
    ClusterMap(MapPage),
    /// A read lease of `valid_us` from when the client sent its request.
    ReadLease {
        valid_us: u64,
    },
    Keys(KeysPage),
}

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge(usize),
    #[error("malformed message: {0}")]
    Malformed(String),
}

pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, CodecError> {
    let bytes = postcard::to_stdvec(msg).map_err(|e| CodecError::Malformed(e.to_string()))?;
    if bytes.len() > MAX_MESSAGE {
        return Err(CodecError::TooLarge(bytes.len()));
    }
    Ok(bytes)
}

pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, CodecError> {
    if bytes.len() > MAX_MESSAGE {
        return Err(CodecError::TooLarge(bytes.len()));
    }
    postcard::from_bytes(bytes).map_err(|e| CodecError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_travel_as_a_plain_sequence_of_bytes() {
        // What protocol 8 put on the wire before starts were decoded as one
        // run: the same bytes both ways.
        #[derive(Serialize, Deserialize)]
        struct AsSequence {
            extent: Extent,
            carved: u64,
            starts: Vec<u8>,
        }
        let starts: Vec<u8> = (0..=255).chain([0, 1, 0x80]).collect();
        let spent = Spent {
            extent: Extent {
                offset: 1 << 20,
                len: 4096,
            },
            carved: 2048,
            starts: starts.clone(),
        };
        let seq = AsSequence {
            extent: spent.extent,
            carved: spent.carved,
            starts,
        };
        let wire = postcard::to_allocvec(&seq).unwrap();
        assert_eq!(postcard::to_allocvec(&spent).unwrap(), wire);
        assert_eq!(postcard::from_bytes::<Spent>(&wire).unwrap(), spent);
        let back: AsSequence = postcard::from_bytes(&wire).unwrap();
        assert_eq!(back.starts, spent.starts);
    }

    #[test]
    fn messages_round_trip() {
        let reqs = [
            Request::Connect {
                protocol_version: PROTOCOL_VERSION,
                secret: b"s3".to_vec(),
                group: 7,
            },
            Request::Lease { min_len: 4096 },
            Request::GiveBack {
                spent: vec![Spent {
                    extent: Extent {
                        offset: 8192,
                        len: 4096,
                    },
                    carved: 128,
                    starts: vec![0b1_0001],
                }],
                unlinked: vec![Unlinked {
                    offset: 4096,
                    class: 3,
                }],
            },
            Request::Unlinked {
                blocks: vec![Unlinked {
                    offset: 1 << 40,
                    class: 0,
                }],
            },
            Request::Stats,
            Request::Disconnect,
            Request::ClusterMap {
                protocol_version: PROTOCOL_VERSION,
                first: 4096,
            },
        ];
        for r in reqs {
            assert_eq!(decode::<Request>(&encode(&r).unwrap()).unwrap(), r);
        }
        let resp = Response::Error {
            kind: ErrorKind::BadSecret,
            message: "no".into(),
        };
        assert_eq!(decode::<Response>(&encode(&resp).unwrap()).unwrap(), resp);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for junk in [&b""[..], b"\xff\xff\xff\xff\xff", b"\x09", b"\x00\x01"] {
            assert!(decode::<Request>(junk).is_err());
        }
        let mut seed = 1u64;
        for _ in 0..2000 {
            let len = (seed % 40) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (seed >> 33) as u8
                })
                .collect();
            let _ = decode::<Request>(&bytes);
        }
        assert!(matches!(
            decode::<Request>(&vec![0; MAX_MESSAGE + 1]),
            Err(CodecError::TooLarge(_))
        ));
    }
}
