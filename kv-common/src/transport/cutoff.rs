//! A client's connections cut off from another thread. A cluster client's
//! map follower cuts the connections to a copy that a new map dropped from
//! its shard's group: a writer waiting for that copy's answer (a frozen
//! server answers nothing) then follows the map at once, rather than wait
//! out its reply timeout while the shard's other copies serve on.

use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use super::error::TransportError;

/// Shared by a client and each connection it opens in turn. Once cut,
/// every control call of theirs fails as a lost connection, the one
/// waiting now included, and so does every later one.
#[derive(Debug, Default)]
pub struct Cutoff {
    cut: AtomicBool,
    why: OnceLock<String>,
    /// The control socket of the connection open now (shm): shut down to
    /// wake a call blocked reading it. Its own descriptor, so the
    /// connection forgets it when dropped (the server then sees it close).
    socket: Mutex<Option<UnixStream>>,
}

impl Cutoff {
    /// Cuts the connections off for `why`.
    pub fn cut(&self, why: String) {
        let _ = self.why.set(why);
        self.cut.store(true, Ordering::SeqCst);
        if let Some(socket) = self
            .socket
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }

    /// The error a call fails with once the connections are cut off.
    pub fn error(&self) -> Option<TransportError> {
        if !self.cut.load(Ordering::SeqCst) {
            return None;
        }
        let why = self.why.get().map_or("", String::as_str);
        Some(TransportError::Disconnected(format!("cut off: {why}")))
    }

    /// The connection open now reads its replies from `socket`.
    pub(crate) fn watch_socket(&self, socket: &UnixStream) {
        let Ok(own) = socket.try_clone() else {
            return;
        };
        *self.socket.lock().unwrap_or_else(|e| e.into_inner()) = Some(own);
        // A cut that came meanwhile found no socket to shut down.
        if self.cut.load(Ordering::SeqCst) {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }

    /// The connection that read from the socket is gone.
    pub(crate) fn forget_socket(&self) {
        self.socket.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::protocol::Request;
    use crate::transport::connection::{ConnectOptions, Connection};
    use crate::transport::shm::ShmConnection;
    use crate::Address;

    /// A connection over shm to a server that takes the call and never
    /// answers (as a frozen one), waiting a minute for its reply; and the
    /// server's end, held open.
    fn silent_server(dir: &std::path::Path) -> (ShmConnection, UnixListener) {
        let region = dir.join("region");
        let listener = UnixListener::bind(Address::shm_socket(&region)).expect("bind");
        let options = ConnectOptions {
            reply_timeout: Duration::from_secs(60),
            ..ConnectOptions::default()
        };
        let conn = ShmConnection::connect(&region, &options).expect("connect");
        (conn, listener)
    }

    #[test]
    fn a_cut_wakes_the_call_waiting_for_a_silent_server_and_fails_every_later_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut conn, listener) = silent_server(dir.path());
        let _accepted = listener.accept().expect("accept");
        let cutoff = Arc::new(Cutoff::default());
        conn.cut_by(cutoff.clone());
        let cutter = std::thread::spawn({
            let cutoff = cutoff.clone();
            move || {
                std::thread::sleep(Duration::from_millis(200));
                cutoff.cut("m1 holds no copy of shard 0".into());
            }
        });
        let waited = conn.call(&Request::Stats).expect_err("no reply came");
        cutter.join().expect("cutter");
        assert!(
            waited.to_string().contains("cut off: m1 holds no copy"),
            "{waited}"
        );
        let later = conn.call(&Request::Stats).expect_err("cut off");
        assert!(later.is_connection_lost(), "{later}");
    }

    #[test]
    fn a_connection_made_after_the_cut_is_cut_off_too() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut conn, _listener) = silent_server(dir.path());
        let cutoff = Arc::new(Cutoff::default());
        cutoff.cut("gone".into());
        conn.cut_by(cutoff);
        let e = conn.call(&Request::Stats).expect_err("cut off");
        assert!(e.to_string().contains("cut off: gone"), "{e}");
    }

    #[test]
    fn a_dropped_connection_leaves_no_socket_open_behind_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut conn, listener) = silent_server(dir.path());
        let (mut server_end, _) = listener.accept().expect("accept");
        let cutoff = Arc::new(Cutoff::default());
        conn.cut_by(cutoff.clone());
        drop(conn);
        // The server sees the client close, though the cutoff lives on.
        let mut byte = [0u8; 1];
        server_end
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let read = std::io::Read::read(&mut server_end, &mut byte).expect("read");
        assert_eq!(read, 0, "the socket is closed");
        drop(cutoff);
    }
}
