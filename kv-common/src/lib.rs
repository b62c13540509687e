//! Shared pieces of onekv: the layout of the registered region, key hashing
//! and block checksums, the two-sided control protocol, and the transport
//! that carries one-sided verbs (READ, WRITE, CAS, FETCH-AND-ADD).

pub mod address;
pub mod layout;
pub mod mapping;
pub mod protocol;
pub mod random;
pub mod secret;
pub mod size;
pub mod transport;
mod words;

pub use address::Address;
