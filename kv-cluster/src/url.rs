//! Where a client reads a cluster: `etcd://HOST:PORT[,HOST:PORT…]/NAME`
//! (where its truth lives), or `cluster+rdma://HOST:PORT[,HOST:PORT…]` and
//! `cluster+shm:///PATH[,/PATH…]` (any of its members, which hand out the
//! map they follow; a client needs no etcd library for these).

use std::fmt;

use kv_common::Address;

/// What a client reads a cluster's map from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterSource {
    Etcd(ClusterUrl),
    /// Members' own `--listen` addresses; any one that answers will do.
    Members(Vec<Address>),
}

const MEMBERS_PREFIX: &str = "cluster+";

impl ClusterSource {
    /// Whether `text` names a cluster rather than one server.
    pub fn is_cluster(text: &str) -> bool {
        text.starts_with("etcd://") || text.starts_with(MEMBERS_PREFIX)
    }

    pub fn parse(text: &str) -> Result<ClusterSource, String> {
        let Some(members) = text.strip_prefix(MEMBERS_PREFIX) else {
            return ClusterUrl::parse(text).map(ClusterSource::Etcd);
        };
        let usage = "a cluster's members are cluster+rdma://HOST:PORT[,HOST:PORT...] or \
                     cluster+shm:///PATH[,/PATH...] (each a member's --listen address)";
        let (scheme, list) = members
            .split_once("://")
            .ok_or_else(|| format!("'{text}': {usage}"))?;
        let addresses = list
            .split(',')
            .map(|one| Address::parse(&format!("{scheme}://{one}")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("'{text}': {e} ({usage})"))?;
        Ok(ClusterSource::Members(addresses))
    }
}

impl fmt::Display for ClusterSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterSource::Etcd(url) => url.fmt(f),
            ClusterSource::Members(members) => {
                let mut scheme = "";
                let list: Vec<String> = members
                    .iter()
                    .map(|m| {
                        let whole = m.to_string();
                        let (s, rest) = whole.split_once("://").unwrap_or(("", &whole));
                        scheme = if s == "rdma" { "rdma" } else { "shm" };
                        rest.to_string()
                    })
                    .collect();
                write!(f, "{MEMBERS_PREFIX}{scheme}://{}", list.join(","))
            }
        }
    }
}

/// The etcd endpoints that hold a cluster, and the cluster's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterUrl {
    /// `http://HOST:PORT` for each endpoint given.
    pub endpoints: Vec<String>,
    pub name: String,
}

impl ClusterUrl {
    pub fn parse(text: &str) -> Result<ClusterUrl, String> {
        let usage = "a cluster is etcd://HOST:PORT[,HOST:PORT...]/NAME";
        let rest = text
            .strip_prefix("etcd://")
            .ok_or_else(|| format!("'{text}': {usage}"))?;
        let (hosts, name) = rest
            .split_once('/')
            .ok_or_else(|| format!("'{text}': missing /NAME ({usage})"))?;
        let name_ok = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !name_ok {
            return Err(format!(
                "'{text}': the cluster name '{name}' must be letters, digits, '-', '_' or '.'"
            ));
        }
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let (h, port) = host
                .rsplit_once(':')
                .ok_or_else(|| format!("'{text}': '{host}' is not HOST:PORT ({usage})"))?;
            if h.is_empty() || port.parse::<u16>().is_err() {
                return Err(format!("'{text}': '{host}' is not HOST:PORT ({usage})"));
            }
            endpoints.push(format!("http://{host}"));
        }
        Ok(ClusterUrl {
            endpoints,
            name: name.to_string(),
        })
    }
}

impl fmt::Display for ClusterUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hosts: Vec<&str> = self
            .endpoints
            .iter()
            .map(|e| e.trim_start_matches("http://"))
            .collect();
        write!(f, "etcd://{}/{}", hosts.join(","), self.name)
    }
}

impl std::str::FromStr for ClusterUrl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        ClusterUrl::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_endpoints_and_name_and_says_what_is_wrong() {
        let url = ClusterUrl::parse("etcd://10.0.0.1:2379,etcd2:2379/prod").unwrap();
        assert_eq!(url.endpoints, ["http://10.0.0.1:2379", "http://etcd2:2379"]);
        assert_eq!(url.name, "prod");
        assert_eq!(url.to_string(), "etcd://10.0.0.1:2379,etcd2:2379/prod");
        for bad in [
            "shm:///dev/shm/x",
            "etcd://h:2379",
            "etcd://h:2379/",
            "etcd://h/x",
            "etcd://h:port/x",
            "etcd://h:1/a/b",
        ] {
            assert!(ClusterUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn members_of_either_backend_name_a_cluster() {
        for text in [
            "cluster+rdma://10.0.0.1:7000,10.0.0.2:7000",
            "cluster+shm:///dev/shm/m0,/dev/shm/m1",
            "cluster+shm:///dev/shm/m0",
        ] {
            assert!(ClusterSource::is_cluster(text));
            let source = ClusterSource::parse(text).unwrap();
            assert!(matches!(source, ClusterSource::Members(_)), "{text}");
            assert_eq!(source.to_string(), text);
        }
        assert!(matches!(
            ClusterSource::parse("etcd://h:2379/x").unwrap(),
            ClusterSource::Etcd(_)
        ));
        assert!(!ClusterSource::is_cluster("shm:///dev/shm/x"));
        for bad in [
            "cluster+",
            "cluster+rdma://h",
            "cluster+tcp://h:1",
            "cluster+shm://rel",
        ] {
            assert!(ClusterSource::parse(bad).is_err(), "{bad}");
        }
    }
}
