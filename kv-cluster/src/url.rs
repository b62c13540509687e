//! `etcd://HOST:PORT[,HOST:PORT…]/NAME`: where a cluster's truth lives.

use std::fmt;

/// The etcd endpoints that hold a cluster, and the cluster's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterUrl {
    /// `http://HOST:PORT` for each endpoint given.
    pub endpoints: Vec<String>,
    pub name: String,
}

impl ClusterUrl {
    /// Whether `text` names a cluster rather than one server.
    pub fn is_cluster(text: &str) -> bool {
        text.starts_with("etcd://")
    }

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
}
