//! Length-prefixed frames: how control messages travel over a stream (the
//! shm control socket; rdma's TCP handshake).

use super::connection::Received;
use super::error::TransportError;
use crate::protocol::{CodecError, Request, Response};

/// Sends a request over any connection and decodes the reply.
pub(crate) fn frame_call<S: std::io::Read + std::io::Write>(
    stream: &mut S,
    request: &Request,
) -> Result<Response, TransportError> {
    let bytes = crate::protocol::encode(request)?;
    let written = write_frame(stream, &bytes);
    // A server that refuses a connection says why and hangs up, possibly
    // before our request arrived: its reply is read even if the write failed.
    match (read_frame(stream), written) {
        (Ok(Some(reply)), _) => Ok(crate::protocol::decode(&reply)?),
        (_, Err(e)) => Err(e),
        (Err(e), Ok(())) => Err(e),
        (Ok(None), Ok(())) => Err(TransportError::Disconnected(
            "server closed the connection".into(),
        )),
    }
}

/// Reassembles length-prefixed frames from a non-blocking stream, however
/// the bytes arrive: a frame sent a byte at a time costs the server nothing
/// but this buffer, which never exceeds one maximal frame.
#[derive(Default)]
pub struct FrameReader {
    buf: Vec<u8>,
}

impl FrameReader {
    /// Reads what is available and returns one whole frame if there is one.
    pub fn poll<R: std::io::Read>(&mut self, r: &mut R) -> Result<Received, TransportError> {
        loop {
            if let Some(frame) = self.take_frame()? {
                return Ok(Received::Message(frame));
            }
            let have = self.buf.len();
            let want = self.wanted();
            self.buf.resize(want, 0);
            match r.read(&mut self.buf[have..]) {
                Ok(0) => {
                    self.buf.truncate(have);
                    return Ok(Received::Closed);
                }
                Ok(n) => self.buf.truncate(have + n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.buf.truncate(have);
                    return Ok(Received::Nothing);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                    self.buf.truncate(have);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Bytes the buffer should hold to make progress: the length prefix,
    /// then the whole frame.
    fn wanted(&self) -> usize {
        if self.buf.len() < 4 {
            return 4;
        }
        4 + u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize
    }

    fn take_frame(&mut self) -> Result<Option<Vec<u8>>, TransportError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = self.wanted() - 4;
        if len > crate::protocol::MAX_MESSAGE {
            return Err(CodecError::TooLarge(len).into());
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let frame = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(frame))
    }
}

/// Length-prefixed frames for stream transports (the shm control socket).
pub fn write_frame<W: std::io::Write>(w: &mut W, bytes: &[u8]) -> Result<(), TransportError> {
    let len = u32::try_from(bytes.len()).map_err(|_| CodecError::TooLarge(bytes.len()))?;
    let mut out = Vec::with_capacity(4 + bytes.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(bytes);
    w.write_all(&out)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame; None on a clean end of stream. A length above
/// MAX_MESSAGE is refused before anything is allocated.
pub fn read_frame<R: std::io::Read>(r: &mut R) -> Result<Option<Vec<u8>>, TransportError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > crate::protocol::MAX_MESSAGE {
        return Err(CodecError::TooLarge(len).into());
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream that hands out its bytes a few at a time, then would block.
    struct Trickle {
        bytes: Vec<u8>,
        at: usize,
        step: usize,
    }

    impl std::io::Read for Trickle {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            if self.at == self.bytes.len() {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            let n = self.step.min(out.len()).min(self.bytes.len() - self.at);
            out[..n].copy_from_slice(&self.bytes[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    #[test]
    fn frame_reader_reassembles_trickled_frames_and_refuses_huge_ones() {
        let mut wire = Vec::new();
        write_frame(&mut wire, b"hello").unwrap();
        write_frame(&mut wire, b"").unwrap();
        write_frame(&mut wire, &[7; 300]).unwrap();
        for step in [1, 3, 1000] {
            let mut s = Trickle {
                bytes: wire.clone(),
                at: 0,
                step,
            };
            let mut r = FrameReader::default();
            let mut got = Vec::new();
            loop {
                match r.poll(&mut s).unwrap() {
                    Received::Message(m) => got.push(m),
                    Received::Nothing => break,
                    Received::Closed | Received::Faulted(_) => unreachable!(),
                }
            }
            assert_eq!(got, vec![b"hello".to_vec(), vec![], vec![7; 300]]);
        }
        let mut huge = Trickle {
            bytes: u32::MAX.to_le_bytes().to_vec(),
            at: 0,
            step: 4,
        };
        assert!(FrameReader::default().poll(&mut huge).is_err());
        let mut closed: &[u8] = b"\x05\x00";
        assert_eq!(
            FrameReader::default().poll(&mut closed).unwrap(),
            Received::Closed
        );
    }
}
