//! Server addresses: a URL-like string picks the transport backend.

use std::fmt;
use std::path::PathBuf;

/// Where a server listens, and so which backend reaches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// `shm:///dev/shm/NAME`: the region is the file NAME, the control
    /// socket is NAME.sock beside it.
    Shm {
        /// The region file.
        region: PathBuf,
    },
    /// `rdma://HOST:PORT`: RC queue pairs, set up over a TCP handshake on
    /// that port.
    Rdma {
        /// A name or an address of the server's RDMA interface.
        host: String,
        /// The TCP port of the handshake.
        port: u16,
    },
}

impl Address {
    /// Reads `shm:///PATH` or `rdma://HOST:PORT`; the error says what is
    /// wrong with the text.
    pub fn parse(text: &str) -> Result<Self, String> {
        if let Some(path) = text.strip_prefix("shm://") {
            if !path.starts_with('/') || path.len() < 2 || path.ends_with('/') {
                return Err(format!(
                    "'{text}': a shm address names an absolute file path, e.g. shm:///dev/shm/onekv"
                ));
            }
            return Ok(Address::Shm {
                region: PathBuf::from(path),
            });
        }
        if let Some(rest) = text.strip_prefix("rdma://") {
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| format!("'{text}': an rdma address is rdma://HOST:PORT"))?;
            let port = port
                .parse()
                .map_err(|_| format!("'{text}': '{port}' is not a port number"))?;
            if host.is_empty() {
                return Err(format!("'{text}': missing host"));
            }
            return Ok(Address::Rdma {
                host: host.to_string(),
                port,
            });
        }
        Err(format!(
            "'{text}' is not a onekv address: use shm:///dev/shm/NAME or rdma://HOST:PORT"
        ))
    }

    /// The control socket of a shm server.
    pub fn shm_socket(region: &std::path::Path) -> PathBuf {
        let mut name = region.as_os_str().to_owned();
        name.push(".sock");
        PathBuf::from(name)
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Shm { region } => write!(f, "shm://{}", region.display()),
            Address::Rdma { host, port } => write!(f, "rdma://{host}:{port}"),
        }
    }
}

impl std::str::FromStr for Address {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Address::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_schemes() {
        assert_eq!(
            Address::parse("shm:///dev/shm/x").unwrap(),
            Address::Shm {
                region: "/dev/shm/x".into()
            }
        );
        assert_eq!(
            Address::parse("rdma://10.0.0.1:7471").unwrap(),
            Address::Rdma {
                host: "10.0.0.1".into(),
                port: 7471
            }
        );
        assert!(Address::parse("shm://relative").is_err());
        assert!(Address::parse("tcp://x:1").is_err());
        assert!(Address::parse("rdma://host").is_err());
        assert_eq!(
            Address::parse("shm:///a/b").unwrap().to_string(),
            "shm:///a/b"
        );
    }
}
