//! Which RDMA device and GID carry a connection, found the way rdma_cm
//! finds them: the kernel's route to the peer picks the local address (the
//! handshake's TCP socket is bound to it), and the GID table lists which
//! device, port and GID index own that address. On RoCE the GID of an IPv4
//! address is its IPv4-mapped IPv6 form (`::ffff:a.b.c.d`); onekv takes the
//! RoCE v2 entry (routable UDP), as `perftest -R` and rdma_cm do.
//!
//! The rdma transport reads each device's table with one verbs query
//! (`ibv_query_gid_table`, what `show_gids` prints); the choice itself is
//! here, free of verbs, so that it is tested on any machine.

use std::net::IpAddr;

/// What kind of GID an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidKind {
    /// RoCE v2: carried in UDP/IP, routable.
    RoceV2,
    /// InfiniBand, or RoCE v1 (Ethernet only): neither is routed by IP.
    IbOrRoceV1,
}

/// One valid entry of a device's GID table (port 1: the transport uses
/// port 1).
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
    local: IpAddr,
) -> Option<&'a GidEntry> {
    let on_device = |e: &&GidEntry| device.is_none_or(|d| e.device == d);
    let candidates: Vec<&GidEntry> = table.iter().filter(on_device).collect();
    if !local.is_loopback() && !local.is_unspecified() {
        let want = match local {
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

    fn entry(device: &str, index: u8, gid: &str, kind: GidKind) -> GidEntry {
        let gid: std::net::Ipv6Addr = gid.parse().expect("an IPv6 form");
        GidEntry {
            device: device.into(),
            index,
            gid: gid.octets(),
            kind,
        }
    }

    const LINK_LOCAL: &str = "fe80::5054:ff:fe12:3456";

    /// Two RoCE devices as `show_gids` lists them: link-local and one IPv4
    /// address each, in v1 and v2.
    fn roce_two_devices() -> Vec<GidEntry> {
        use GidKind::*;
        vec![
            entry("mlx5_0", 0, LINK_LOCAL, IbOrRoceV1),
            entry("mlx5_0", 1, LINK_LOCAL, RoceV2),
            entry("mlx5_0", 2, "::ffff:192.168.1.7", IbOrRoceV1),
            entry("mlx5_0", 3, "::ffff:192.168.1.7", RoceV2),
            entry("rxe0", 0, LINK_LOCAL, IbOrRoceV1),
            entry("rxe0", 1, LINK_LOCAL, RoceV2),
            entry("rxe0", 2, "::ffff:10.0.2.15", IbOrRoceV1),
            entry("rxe0", 3, "::ffff:10.0.2.15", RoceV2),
        ]
    }

    fn pick(t: &[GidEntry], device: Option<&str>, ip: &str) -> (String, u8) {
        let e = choose(t, device, ip.parse().expect("ip")).expect("a GID");
        (e.device.clone(), e.index)
    }

    #[test]
    fn the_route_s_source_address_picks_the_device_and_its_roce_v2_gid() {
        let t = roce_two_devices();
        assert_eq!(pick(&t, None, "10.0.2.15"), ("rxe0".into(), 3));
        assert_eq!(pick(&t, None, "192.168.1.7"), ("mlx5_0".into(), 3));
        assert_eq!(
            pick(&t, None, "fe80::5054:ff:fe12:3456"),
            ("mlx5_0".into(), 1)
        );
        // An operator's device choice narrows the search.
        assert_eq!(pick(&t, Some("rxe0"), "192.168.1.7"), ("rxe0".into(), 3));
    }

    #[test]
    fn loopback_and_unknown_addresses_take_the_first_device_s_ipv4_roce_v2_gid() {
        let t = roce_two_devices();
        for ip in ["127.0.0.1", "0.0.0.0", "::1", "172.16.0.1"] {
            assert_eq!(pick(&t, None, ip), ("mlx5_0".into(), 3), "{ip}");
        }
    }

    #[test]
    fn infiniband_takes_index_0_and_no_table_means_no_choice() {
        let ib = vec![entry(
            "mlx4_0",
            0,
            "fe80::2:c903:31:7d61",
            GidKind::IbOrRoceV1,
        )];
        assert_eq!(pick(&ib, None, "10.1.1.1"), ("mlx4_0".into(), 0));
        let any = "10.1.1.1".parse().expect("ip");
        assert!(choose(&[], None, any).is_none());
        assert!(choose(&ib, Some("mlx5_0"), any).is_none());
    }
}
