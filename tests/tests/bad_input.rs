//! Hostile or mistaken input gets a clear error, and the server keeps
//! serving: wrong secrets, garbage on the control socket, oversized keys and
//! values, bogus give-backs, and region files it does not understand.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use kv_client::{Client, ClientOptions, Error};
use kv_common::layout::{Geometry, MAX_KEY};
use kv_common::protocol::{self, ErrorKind, Extent, Request, Response, Spent, PROTOCOL_VERSION};
use kv_common::transport::{read_frame, write_frame};
use kv_common::Address;
use kv_server::{Server, ServerConfig, ServerError};
use onekv_tests::{control_call as call, TestServer};

fn control_socket(srv: &TestServer) -> UnixStream {
    UnixStream::connect(Address::shm_socket(&srv.region_path())).unwrap()
}

#[test]
fn wrong_or_missing_secret_is_refused() {
    let srv = TestServer::start(|c| c.secret = Some(b"open sesame".to_vec()));
    let with = |s: Option<&[u8]>| {
        let options = match s {
            Some(secret) => ClientOptions::default().with_secret(secret),
            None => ClientOptions::default(),
        };
        Client::connect_with(&srv.address, options)
    };
    assert!(matches!(with(None), Err(Error::Refused(_))));
    assert!(matches!(with(Some(b"open sesamE")), Err(Error::Refused(_))));
    assert!(matches!(
        with(Some(b"open sesame!")),
        Err(Error::Refused(_))
    ));
    let mut kv = with(Some(b"open sesame")).unwrap();
    kv.put(b"a", b"b").unwrap();
    assert_eq!(srv.server.stats().rejected_connects, 3);
}

#[test]
#[allow(clippy::too_many_lines)] // one scenario, read top to bottom
fn garbage_on_the_control_socket_does_not_hurt_the_server() {
    let srv = TestServer::start(|_| {});
    // Not our framing at all: an HTTP request. Its first bytes read as a huge
    // length, which is refused before anything is allocated.
    let mut s = control_socket(&srv);
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    // A well-framed but undecodable message gets an error and the
    // connection stays usable.
    let mut s = control_socket(&srv);
    write_frame(&mut s, &[0xff, 0x13, 0x37]).unwrap();
    let r: Response = protocol::decode(&read_frame(&mut s).unwrap().unwrap()).unwrap();
    assert!(matches!(
        r,
        Response::Error {
            kind: ErrorKind::Malformed,
            ..
        }
    ));
    // Requests before Connect are refused.
    let r = call(&mut s, &Request::Lease { min_len: 64 });
    assert!(matches!(
        r,
        Some(Response::Error {
            kind: ErrorKind::NotConnected,
            ..
        })
    ));
    // A truncated frame, then the peer vanishes.
    let mut s = control_socket(&srv);
    s.write_all(&100u32.to_le_bytes()).unwrap();
    s.write_all(b"short").unwrap();
    drop(s);
    // Wrong protocol version.
    let mut s = control_socket(&srv);
    let r = call(
        &mut s,
        &Request::Connect {
            protocol_version: PROTOCOL_VERSION + 1,
            secret: vec![],
            group: 0,
        },
    );
    assert!(matches!(
        r,
        Some(Response::Error {
            kind: ErrorKind::VersionMismatch,
            ..
        })
    ));

    // Bogus leases and give-backs from a connected client.
    let mut s = control_socket(&srv);
    assert!(matches!(
        call(
            &mut s,
            &Request::Connect {
                protocol_version: PROTOCOL_VERSION,
                secret: vec![],
                group: 0,
            }
        ),
        Some(Response::Connected(_))
    ));
    for bad in [
        Request::Lease { min_len: 0 },
        Request::Lease { min_len: u64::MAX },
    ] {
        assert!(matches!(
            call(&mut s, &bad),
            Some(Response::Error {
                kind: ErrorKind::Malformed,
                ..
            })
        ));
    }
    let outside = Request::GiveBack {
        spent: vec![Spent::undeclared(Extent {
            offset: 0,
            len: 4096,
        })],
        unlinked: vec![],
    };
    assert!(matches!(
        call(&mut s, &outside),
        Some(Response::Error {
            kind: ErrorKind::BadExtent,
            ..
        })
    ));
    // Three offences: the client is disconnected, not answered again.
    assert!(call(&mut s, &Request::Stats).is_none());

    // The server still serves real clients, and counted the garbage.
    let mut kv = Client::connect(&srv.address).unwrap();
    kv.put(b"still", b"here").unwrap();
    assert_eq!(kv.get(b"still").unwrap().as_deref(), Some(&b"here"[..]));
    assert!(srv.server.stats().malformed >= 3);
}

#[test]
fn oversized_keys_and_values_are_typed_errors_with_the_limit() {
    let srv = TestServer::start(|_| {});
    let mut kv = Client::connect(&srv.address).unwrap();
    let max = kv.max_value();
    match kv.put(vec![b'k'; MAX_KEY + 1], b"v") {
        Err(Error::KeyTooLarge { len, max }) => assert_eq!((len, max), (MAX_KEY + 1, MAX_KEY)),
        other => panic!("expected KeyTooLarge, got {other:?}"),
    }
    match kv.put(b"k", vec![0; max + 1]) {
        Err(Error::ValueTooLarge { len, max: limit }) => assert_eq!((len, limit), (max + 1, max)),
        other => panic!("expected ValueTooLarge, got {other:?}"),
    }
    assert!(matches!(kv.get(b""), Err(Error::EmptyKey)));
    // The largest allowed key and value work.
    let key = vec![b'k'; MAX_KEY];
    kv.put(&key, vec![9; max]).unwrap();
    assert_eq!(kv.get(&key).unwrap().map(|v| v.len()), Some(max));
}

#[test]
fn region_files_of_another_version_or_kind_are_refused_untouched() {
    let dir = onekv_tests::region_dir();
    let start = |name: &str| {
        let config = ServerConfig {
            memory: 4 << 20,
            ..ServerConfig::new(Address::Shm {
                region: dir.path().join(name),
            })
        };
        Server::start(config)
    };

    let g = Geometry::for_memory(4 << 20, None).unwrap();
    let mut header = g.encode_header();
    header[1] = 99; // a future format version
    let mut bytes: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes.resize(4 << 20, 0);
    std::fs::write(dir.path().join("future"), &bytes).unwrap();
    match start("future") {
        Err(e @ ServerError::Region { .. }) => assert!(e.to_string().contains("version 99"), "{e}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a version-99 region was accepted"),
    }
    assert_eq!(
        std::fs::read(dir.path().join("future")).unwrap(),
        bytes,
        "file was modified"
    );

    let junk = b"these are somebody's important notes".repeat(200);
    std::fs::write(dir.path().join("notes"), &junk).unwrap();
    match start("notes") {
        Err(e) => assert!(e.to_string().contains("not a onekv region"), "{e}"),
        Ok(_) => panic!("a non-region file was accepted"),
    }
    assert_eq!(
        std::fs::read(dir.path().join("notes")).unwrap(),
        junk,
        "file was modified"
    );
}

#[test]
fn a_second_server_on_the_same_region_is_refused() {
    let srv = TestServer::start(|_| {});
    let config = ServerConfig::new(Address::Shm {
        region: srv.region_path(),
    });
    assert!(Server::start(config).is_err());
    let mut kv = Client::connect(&srv.address).unwrap();
    kv.put(b"first", b"server").unwrap();
}

/// A file at the control socket's path is not a stale socket: the server
/// refuses to start, saying so, and leaves the file as it was.
#[test]
fn a_file_where_the_control_socket_goes_is_refused_untouched() {
    let dir = onekv_tests::region_dir();
    let region = dir.path().join("z");
    let socket = Address::shm_socket(&region);
    std::fs::write(&socket, b"important data").unwrap();
    let config = ServerConfig::new(Address::Shm { region });
    match Server::start(config) {
        Err(e) => assert!(e.to_string().contains("is not a socket"), "{e}"),
        Ok(_) => panic!("a server started over {}", socket.display()),
    }
    assert_eq!(std::fs::read(&socket).unwrap(), b"important data");
}

#[test]
fn the_region_file_is_private_locked_and_allocated_up_front() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let srv = TestServer::start(|_| {});
    let meta = std::fs::metadata(srv.region_path()).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    // The control socket admits the same users as the file does.
    if let Address::Shm { region } = srv.server.address() {
        let socket = std::fs::metadata(Address::shm_socket(region)).unwrap();
        assert_eq!(socket.permissions().mode() & 0o777, 0o600);
    }
    // Every page allocated now, not at first touch.
    assert!(
        meta.blocks() * 512 >= meta.len(),
        "{} of {} bytes allocated",
        meta.blocks() * 512,
        meta.len()
    );

    // A second server through another path to the same file is refused,
    // and the first one's clients are unaffected.
    let alias = srv.dir.path().join("alias");
    std::os::unix::fs::symlink(srv.region_path(), &alias).unwrap();
    match Server::start(ServerConfig::new(Address::Shm { region: alias })) {
        Err(e) => assert!(e.to_string().contains("another server"), "{e}"),
        Ok(_) => panic!("a second server opened a region in use"),
    }
    let mut kv = Client::connect(&srv.address).unwrap();
    kv.put(b"first", b"server").unwrap();

    let dir = onekv_tests::region_dir();
    let shared = dir.path().join("group");
    let config = ServerConfig {
        group_access: true,
        memory: 4 << 20,
        ..ServerConfig::new(Address::Shm {
            region: shared.clone(),
        })
    };
    let group_server = Server::start(config).unwrap();
    let mode = std::fs::metadata(&shared).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o660);
    let socket = std::fs::metadata(Address::shm_socket(&shared)).unwrap();
    assert_eq!(socket.permissions().mode() & 0o777, 0o660);
    drop(group_server);

    // More memory than the file system has: refused at start, no file left.
    let huge = dir.path().join("huge");
    let config = ServerConfig {
        memory: 64 << 40,
        ..ServerConfig::new(Address::Shm {
            region: huge.clone(),
        })
    };
    match Server::start(config) {
        Err(e) => assert!(e.to_string().contains("cannot allocate"), "{e}"),
        Ok(_) => panic!("a 64 TiB region was created"),
    }
    assert!(!huge.exists());
}

#[test]
fn an_unfinished_create_is_redone_but_a_damaged_header_is_refused() {
    let dir = onekv_tests::region_dir();
    let config = |name: &str| ServerConfig {
        memory: 4 << 20,
        ..ServerConfig::new(Address::Shm {
            region: dir.path().join(name),
        })
    };
    // All zeros: a create that died before it wrote the header.
    std::fs::write(dir.path().join("zeros"), vec![0u8; 4 << 20]).unwrap();
    let srv = Server::start(config("zeros")).unwrap();
    assert!(srv.created());
    drop(srv);

    // A region whose header alone was zeroed still has its slots: refused,
    // and left as it was.
    let srv = Server::start(config("damaged")).unwrap();
    let mut kv = Client::connect(&srv.address().to_string()).unwrap();
    kv.put(b"keep", b"me").unwrap();
    kv.close().unwrap();
    drop(srv);
    let path = dir.path().join("damaged");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..4096].fill(0);
    std::fs::write(&path, &bytes).unwrap();
    match Server::start(config("damaged")) {
        Err(e) => assert!(e.to_string().contains("not a onekv region"), "{e}"),
        Ok(_) => panic!("a region with a damaged header was recreated"),
    }
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "file was modified");
}
