//! Errors name what happened, and carry their cause: a malformed address is
//! not an unreachable server, and transport failures chain to their source.

use std::error::Error as _;

use kv_client::{Client, Error, TransportError};

#[test]
fn a_malformed_address_is_invalid_not_unreachable() {
    for address in ["localhost:1234", "shm://relative/path", "rdma://"] {
        match Client::connect(address) {
            Err(e @ Error::InvalidAddress(_)) => assert!(!e.is_retryable(), "{e}"),
            Err(e) => panic!("{address}: expected InvalidAddress, got {e:?}"),
            Ok(_) => panic!("{address}: connected"),
        }
    }
}

#[test]
fn an_unreachable_server_chains_to_the_operating_systems_error() {
    let dir = tempfile::tempdir().expect("dir");
    let address = format!("shm://{}", dir.path().join("nobody").display());
    let e = match Client::connect(&address) {
        Err(e @ Error::Unreachable(_)) => e,
        Err(e) => panic!("expected Unreachable, got {e:?}"),
        Ok(_) => panic!("connected to nobody"),
    };
    assert!(e.is_retryable());
    let transport = e.source().expect("a transport error under it");
    assert!(transport.is::<TransportError>(), "{transport:?}");
    let os = transport.source().expect("an i/o error under that");
    assert!(os.is::<std::io::Error>(), "{os:?}");
}

#[test]
fn a_transport_error_is_the_source_of_the_clients() {
    let e = Error::from(TransportError::Disconnected("gone".into()));
    assert!(matches!(e, Error::Transport(_)), "{e:?}");
    let source = e.source().expect("a source");
    assert!(
        matches!(
            source.downcast_ref::<TransportError>(),
            Some(TransportError::Disconnected(_))
        ),
        "{source:?}"
    );
}
