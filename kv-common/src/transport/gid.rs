//! Which RDMA device and GID carry a connection, found the way rdma_cm
//! finds them: the kernel's route to the peer picks the local address (the
//! handshake's TCP socket is bound to it), and the GID table lists which
//! device, port and GID index own that address. On RoCE the GID of an IPv4
//! address is its IPv4-mapped IPv6 form (`::ffff:a.b.c.d`); onekv takes the
//! RoCE v2 entry (routable UDP), as `perftest -R` and rdma_cm do.
//!
//! The table is read from sysfs (`/sys/class/infiniband/DEV/ports/1/gids/N`
//! and `gid_attrs/types/N`), as rdma-core's `show_gids` reads it; that works
//! without opening a device, so the client can pick its device before it
//! opens one. Only port 1 is used (the transport opens port 1).

use std::io;
use std::net::IpAddr;
use std::path::Path;

/// Where the kernel lists RDMA devices.
pub const SYSFS_ROOT: &str = "/sys/class/infiniband";

/// What kind of GID an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidKind {
    /// RoCE v2: carried in UDP/IP, routable.
    RoceV2,
    /// InfiniBand, or RoCE v1 (Ethernet only): the table cannot tell them
    /// apart, and neither is routed by IP.
    IbOrRoceV1,
}

/// One used entry of a device's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    pub device: String,
    pub index: u8,
    pub gid: [u8; 16],
    pub kind: GidKind,
}

impl GidEntry {
    /// The IPv4 address an IPv4-mapped GID stands for.
    fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        std::net::Ipv6Addr::from(self.gid).to_ipv4_mapped()
    }
}

/// Every non-zero GID of port 1 of every device under `root`, by device
/// name then index. A missing root (no RDMA in this kernel) is an empty
/// table.
pub fn table(root: &Path) -> io::Result<Vec<GidEntry>> {
    let mut entries = Vec::new();
    let devices = match std::fs::read_dir(root) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(entries),
        Err(e) => return Err(e),
    };
    let mut names: Vec<String> = devices
        .filter_map(|d| d.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    for device in names {
        let port = root.join(&device).join("ports/1");
        let Ok(gids) = std::fs::read_dir(port.join("gids")) else {
            continue;
        };
        let mut found: Vec<GidEntry> = gids
            .filter_map(|g| {
                let g = g.ok()?;
                let index: u8 = g.file_name().to_str()?.parse().ok()?;
                let gid = parse_gid(&std::fs::read_to_string(g.path()).ok()?)?;
                if gid == [0; 16] {
                    return None;
                }
                // IB devices refuse to read their types (EINVAL).
                let kind = match std::fs::read_to_string(
                    port.join("gid_attrs/types").join(index.to_string()),
                ) {
                    Ok(t) if t.trim().eq_ignore_ascii_case("RoCE v2") => GidKind::RoceV2,
                    _ => GidKind::IbOrRoceV1,
                };
                Some(GidEntry {
                    device: device.clone(),
                    index,
                    gid,
                    kind,
                })
            })
            .collect();
        found.sort_by_key(|e| e.index);
        entries.extend(found);
    }
    Ok(entries)
}

/// `fe80:0000:...:3456` (eight groups of four hex digits) as bytes.
fn parse_gid(text: &str) -> Option<[u8; 16]> {
    let mut gid = [0u8; 16];
    let groups: Vec<&str> = text.trim().split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    for (i, g) in groups.iter().enumerate() {
        let v = u16::from_str_radix(g, 16).ok()?;
        gid[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(gid)
}

/// The GID for traffic from `local` (the address the route to the peer
/// starts from), on `device` if one is named:
///
/// 1. the RoCE v2 entry holding `local` (IPv4-mapped for IPv4), else any
///    entry holding it;
/// 2. for a loopback or unspecified `local` (a server talking to itself
///    through `0.0.0.0`), or an address no device holds (IPoIB: InfiniBand
///    GIDs hold no IP), the first device's RoCE v2 entry of an IPv4
///    address, else its first RoCE v2 entry, else its index 0.
pub fn choose<'a>(
    table: &'a [GidEntry],
    device: Option<&str>,
    local: Option<IpAddr>,
) -> Option<&'a GidEntry> {
    let on_device = |e: &&GidEntry| device.is_none_or(|d| e.device == d);
    let candidates: Vec<&GidEntry> = table.iter().filter(on_device).collect();
    if let Some(ip) = local.filter(|ip| !ip.is_loopback() && !ip.is_unspecified()) {
        let want = match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        let holding = || candidates.iter().copied().filter(|e| e.gid == want);
        if let Some(e) = holding()
            .find(|e| e.kind == GidKind::RoceV2)
            .or_else(|| holding().next())
        {
            return Some(e);
        }
    }
    let first = candidates.first()?.device.as_str();
    let own = || candidates.iter().copied().filter(|e| e.device == first);
    own()
        .find(|e| e.kind == GidKind::RoceV2 && e.ipv4().is_some())
        .or_else(|| own().find(|e| e.kind == GidKind::RoceV2))
        .or_else(|| own().find(|e| e.index == 0))
        .or_else(|| own().next())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs tree: (device, index, gid text, type).
    fn sysfs(entries: &[(&str, u8, &str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("dir");
        for (dev, index, gid, kind) in entries {
            let port = root.path().join(dev).join("ports/1");
            std::fs::create_dir_all(port.join("gids")).expect("gids");
            std::fs::create_dir_all(port.join("gid_attrs/types")).expect("types");
            std::fs::write(
                port.join("gids").join(index.to_string()),
                format!("{gid}\n"),
            )
            .expect("gid");
            if !kind.is_empty() {
                std::fs::write(
                    port.join("gid_attrs/types").join(index.to_string()),
                    format!("{kind}\n"),
                )
                .expect("type");
            }
        }
        root
    }

    const ZERO: &str = "0000:0000:0000:0000:0000:0000:0000:0000";
    const LINK_LOCAL: &str = "fe80:0000:0000:0000:5054:00ff:fe12:3456";
    const V4_10_0_2_15: &str = "0000:0000:0000:0000:0000:ffff:0a00:020f";
    const V4_192_168_1_7: &str = "0000:0000:0000:0000:0000:ffff:c0a8:0107";

    fn roce_two_devices() -> tempfile::TempDir {
        sysfs(&[
            ("mlx5_0", 0, LINK_LOCAL, "IB/RoCE v1"),
            ("mlx5_0", 1, LINK_LOCAL, "RoCE v2"),
            ("mlx5_0", 2, V4_192_168_1_7, "IB/RoCE v1"),
            ("mlx5_0", 3, V4_192_168_1_7, "RoCE v2"),
            ("rxe0", 0, LINK_LOCAL, "IB/RoCE v1"),
            ("rxe0", 1, LINK_LOCAL, "RoCE v2"),
            ("rxe0", 2, V4_10_0_2_15, "IB/RoCE v1"),
            ("rxe0", 3, V4_10_0_2_15, "RoCE v2"),
            ("rxe0", 4, ZERO, ""),
        ])
    }

    #[test]
    fn the_route_s_source_address_picks_the_device_and_its_roce_v2_gid() {
        let root = roce_two_devices();
        let t = table(root.path()).expect("table");
        assert_eq!(t.len(), 8, "the zero GID is not an entry");
        let pick = |dev, ip: &str| choose(&t, dev, Some(ip.parse().expect("ip"))).cloned();
        let e = pick(None, "10.0.2.15").expect("a GID");
        assert_eq!((e.device.as_str(), e.index), ("rxe0", 3));
        let e = pick(None, "192.168.1.7").expect("a GID");
        assert_eq!((e.device.as_str(), e.index), ("mlx5_0", 3));
        // An operator's device choice narrows the search.
        let e = pick(Some("rxe0"), "192.168.1.7").expect("a GID");
        assert_eq!((e.device.as_str(), e.index), ("rxe0", 3));
    }

    #[test]
    fn loopback_and_unknown_addresses_take_the_first_device_s_ipv4_roce_v2_gid() {
        let root = roce_two_devices();
        let t = table(root.path()).expect("table");
        for ip in ["127.0.0.1", "0.0.0.0", "172.16.0.1"] {
            let e = choose(&t, None, Some(ip.parse().expect("ip"))).expect("a GID");
            assert_eq!((e.device.as_str(), e.index), ("mlx5_0", 3), "{ip}");
        }
    }

    #[test]
    fn infiniband_takes_index_0_and_no_rdma_means_no_choice() {
        let root = sysfs(&[
            ("mlx4_0", 0, "fe80:0000:0000:0000:0002:c903:0031:7d61", ""),
            ("mlx4_0", 1, ZERO, ""),
        ]);
        let t = table(root.path()).expect("table");
        let e = choose(&t, None, Some("10.1.1.1".parse().expect("ip"))).expect("a GID");
        assert_eq!((e.index, e.kind), (0, GidKind::IbOrRoceV1));
        let none = table(&root.path().join("absent")).expect("empty table");
        assert!(choose(&none, None, None).is_none());
    }

    #[test]
    fn gids_parse_as_eight_groups_of_hex() {
        assert_eq!(
            parse_gid(V4_10_0_2_15).map(|g| std::net::Ipv6Addr::from(g).to_ipv4_mapped()),
            Some(Some("10.0.2.15".parse().expect("ip")))
        );
        assert_eq!(parse_gid("fe80::1"), None);
        assert_eq!(parse_gid("zz80:0:0:0:0:0:0:0"), None);
    }
}
