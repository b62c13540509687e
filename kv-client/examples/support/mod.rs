//! Where the examples find a server: the address given as their first
//! argument (or in ONEKV_SERVER), else a server embedded in the example
//! on a temporary region, so that `cargo run --example NAME` needs nothing
//! else running.

use kv_client::Address;
use kv_server::{Server, ServerConfig};

/// A server to talk to; an embedded one lives as long as this does.
pub struct Target {
    pub address: String,
    _embedded: Option<(Server, tempfile::TempDir)>,
}

pub fn server() -> Result<Target, Box<dyn std::error::Error>> {
    if let Some(address) = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("ONEKV_SERVER").ok())
    {
        return Ok(Target {
            address,
            _embedded: None,
        });
    }
    let dir = tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir())?;
    let region = dir.path().join("region");
    let server = Server::start(ServerConfig::new(Address::Shm { region }))?;
    let address = server.address().to_string();
    eprintln!("(no address given: serving an embedded region at {address})");
    Ok(Target {
        address,
        _embedded: Some((server, dir)),
    })
}
