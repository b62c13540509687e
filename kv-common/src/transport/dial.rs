//! Opening a backend by address: the one place that knows which backends
//! this build has.

use super::connection::{ConnectOptions, Connection, ControlListener};
use super::error::TransportError;
#[cfg(feature = "rdma")]
use super::rdma;
use super::shm;
use crate::Address;

/// Starts listening at `address`. This comes before the region is opened,
/// so that a second server on the same address fails before it can
/// re-register (and so cut off) the first one's clients.
pub fn bind(address: &Address) -> Result<Box<dyn ControlListener>, TransportError> {
    match address {
        Address::Shm { region } => Ok(Box::new(shm::ShmListener::bind(region)?)),
        #[cfg(feature = "rdma")]
        Address::Rdma { host, port } => Ok(Box::new(rdma::RdmaListener::bind(host, *port)?)),
        #[cfg(not(feature = "rdma"))]
        Address::Rdma { .. } => Err(no_rdma(address)),
    }
}

/// Opens a control channel to the server at `address`.
pub fn connect(
    address: &Address,
    options: &ConnectOptions,
) -> Result<Box<dyn Connection>, TransportError> {
    match address {
        Address::Shm { region } => Ok(Box::new(shm::ShmConnection::connect(region, options)?)),
        #[cfg(feature = "rdma")]
        Address::Rdma { host, port } => Ok(Box::new(rdma::RdmaConnection::connect(
            host, *port, options,
        )?)),
        #[cfg(not(feature = "rdma"))]
        Address::Rdma { .. } => Err(no_rdma(address)),
    }
}

#[cfg(not(feature = "rdma"))]
fn no_rdma(address: &Address) -> TransportError {
    TransportError::Unsupported(format!(
        "{address}: this build has no rdma backend (build with --features rdma)"
    ))
}
