//! The Prometheus endpoint (`kv-server --metrics-listen ADDR`): `GET
//! /metrics` answers in Prometheus' text format (0.0.4).
//!
//! Each scrape reads the counters the control plane keeps anyway (atomics)
//! and the pool's two totals (one short lock, as a `Stats` request does):
//! no metric is kept twice, and the control thread never waits for HTTP.
//!
//! The HTTP side is a few lines on purpose: one thread answers one
//! connection at a time, each with a read and a write timeout, and closes
//! it. A scraper that connects and stalls, or never reads its answer, holds
//! one descriptor for at most those timeouts and cannot stop the server
//! from shutting down (tiny_http, tried first, has neither timeouts nor a
//! bound on its threads per connection).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use crate::control::{Refusal, Shared};
use crate::ServerError;

const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// Longest a scraper may take to send its request, or to take the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest request head read; a GET needs a few hundred bytes.
const MAX_REQUEST: usize = 8 << 10;

/// A running endpoint; dropping it stops it.
pub struct MetricsEndpoint {
    address: SocketAddr,
    stopping: Arc<AtomicBool>,
    /// The listening socket, to shut down from `Drop`.
    waker: TcpListener,
    thread: Option<JoinHandle<()>>,
}

impl MetricsEndpoint {
    pub(crate) fn start(address: SocketAddr, shared: Arc<Shared>) -> Result<Self, ServerError> {
        let listener = TcpListener::bind(address)
            .map_err(|e| ServerError::Config(format!("metrics endpoint on {address}: {e}")))?;
        let address = listener.local_addr().unwrap_or(address);
        let waker = listener
            .try_clone()
            .map_err(|e| ServerError::Config(format!("metrics endpoint on {address}: {e}")))?;
        let mut registry = Registry::with_prefix("onekv");
        registry.register_collector(Box::new(ServerCollector(shared)));
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let thread = std::thread::Builder::new()
            .name("kv-metrics".into())
            .spawn(move || serve(&listener, &registry, &stop))
            .map_err(|e| ServerError::Config(format!("cannot start threads: {e}")))?;
        Ok(MetricsEndpoint {
            address,
            stopping,
            waker,
            thread: Some(thread),
        })
    }

    /// Where it listens (the port the system chose, for port 0).
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the blocked accept: on Linux, shutting a listening socket
        // down makes accept fail at once (connecting to it could fail, on
        // a host without IPv6 loopback or behind a firewall).
        // SAFETY: shutdown on a descriptor this struct owns; it is closed
        // only when `waker` drops, after this.
        unsafe { libc::shutdown(self.waker.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(listener: &TcpListener, registry: &Registry, stopping: &AtomicBool) {
    for conn in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        match conn {
            // A scraper that misbehaves only loses its own answer.
            Ok(stream) => {
                let _ = answer(stream, registry);
            }
            Err(e) => {
                if stopping.load(Ordering::SeqCst) {
                    return;
                }
                // Out of descriptors, most likely: the control plane's
                // timeouts free some; try again shortly.
                tracing::warn!("metrics endpoint: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Reads one request head and answers it, then closes the connection.
fn answer(mut stream: TcpStream, registry: &Registry) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    // The whole head within the timeout, not each read: a scraper that
    // trickles bytes is cut off too.
    let started = std::time::Instant::now();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
        let left = IO_TIMEOUT.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf)? {
            0 => break,
            n => head.extend_from_slice(&buf[..n]),
        }
    }
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, target) = (
        words.next().unwrap_or_default(),
        words.next().unwrap_or_default(),
    );
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    let (status, body) = match (method, path) {
        (b"GET", b"/metrics") => {
            let mut body = String::new();
            match prometheus_client::encoding::prometheus_text::encode(&mut body, registry) {
                Ok(()) => ("200 OK", body),
                Err(_) => ("500 Internal Server Error", "encoding failed\n".into()),
            }
        }
        (b"GET", _) => ("404 Not Found", "onekv: see /metrics\n".into()),
        _ => ("405 Method Not Allowed", "only GET\n".into()),
    };
    // One write: the head and body in one segment.
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(reply.as_bytes())?;
    stream.flush()
}

/// Reads the server's figures at each scrape.
struct ServerCollector(Arc<Shared>);

impl std::fmt::Debug for ServerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerCollector")
    }
}

impl Collector for ServerCollector {
    fn encode(&self, mut out: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let shared = &self.0;
        // Occupancy comes from the last index scan: ask for a fresh one
        // (the reclaimer does it at most once a second).
        shared.stats_wanted.store(true, Relaxed);
        shared.wake_reclaimer();
        let s = shared.stats();
        let c = &shared.counters;
        let bytes = Some(&Unit::Bytes);

        gauge(
            &mut out,
            "clients_connected",
            "Clients connected now.",
            None,
            s.clients_connected,
        )?;
        gauge(
            &mut out,
            "control_connections",
            "Control channels open, connected or not yet.",
            None,
            s.connections,
        )?;
        counter(&mut out, "connects", "Clients admitted.", None, s.connects)?;
        {
            let family = ConstCounter::new(0u64);
            let mut m = out.encode_descriptor(
                "connects_refused",
                "Connections refused, by reason.",
                None,
                family.metric_type(),
            )?;
            for why in Refusal::ALL {
                let labels = [("reason", why.label())];
                ConstCounter::new(c.refused(why)).encode(m.encode_family(&labels)?)?;
            }
        }
        counter(
            &mut out,
            "disconnects",
            "Clients that said goodbye.",
            None,
            s.disconnects,
        )?;
        counter(&mut out, "departures", "Clients that left without a goodbye (crashed, timed out, cut off); their space was reclaimed.", None, s.departures)?;
        counter(
            &mut out,
            "leases",
            "Heap chunks leased to clients.",
            None,
            s.leases,
        )?;
        counter(
            &mut out,
            "give_backs",
            "Extents clients gave back.",
            None,
            s.give_backs,
        )?;
        counter(
            &mut out,
            "give_backs_refused",
            "Give-backs refused: they named space the client did not hold.",
            None,
            s.refused_give_backs,
        )?;
        counter(
            &mut out,
            "malformed_messages",
            "Control messages that could not be decoded or made no sense.",
            None,
            s.malformed,
        )?;
        gauge(
            &mut out,
            "heap_size",
            "Heap bytes in the region.",
            bytes,
            s.heap_size,
        )?;
        gauge(
            &mut out,
            "heap_leased",
            "Heap bytes leased to connected clients.",
            bytes,
            s.heap_leased,
        )?;
        gauge(
            &mut out,
            "heap_free",
            "Heap bytes free, including those waiting out their grace period.",
            bytes,
            s.heap_free,
        )?;
        gauge(
            &mut out,
            "live",
            "Bytes of the blocks the index references (last scan).",
            bytes,
            s.live_bytes,
        )?;
        gauge(
            &mut out,
            "region_size",
            "Size of the region now.",
            bytes,
            s.region_bytes,
        )?;
        gauge(
            &mut out,
            "region_max_size",
            "Size the region may grow to.",
            bytes,
            s.max_region_bytes,
        )?;
        counter(&mut out, "growths", "Times the heap grew.", None, s.growths)?;
        gauge(
            &mut out,
            "index_slots",
            "Slots of the index in force.",
            None,
            s.index_slots,
        )?;
        gauge(
            &mut out,
            "index_slots_used",
            "Slots in use (last scan).",
            None,
            s.live_slots,
        )?;
        emit(
            &mut out,
            "index_occupancy_ratio",
            "Fraction of the index's slots in use (last scan); it doubles at --resize-at.",
            None,
            ConstGauge::new(s.occupancy()),
        )?;
        counter(
            &mut out,
            "index_scans",
            "Scans of the index (reclamation, stats).",
            None,
            s.index_scans,
        )?;
        counter(
            &mut out,
            "resizes",
            "Index resizes this server completed.",
            None,
            s.resizes,
        )?;
        counter(
            &mut out,
            "resizes_declined",
            "Resize requests declined: the index was not full enough to warrant one.",
            None,
            s.declined_resizes,
        )?;
        gauge(
            &mut out,
            "frozen_slots",
            "Frozen slots in the index at the last scan (outside a resize: stray bits about to be thawed).",
            None,
            s.frozen_slots,
        )?;
        counter(
            &mut out,
            "thawed_slots",
            "Stray frozen slots thawed (found by a scan or reported by a writer).",
            None,
            s.thawed_slots,
        )?;
        gauge(
            &mut out,
            "resizing",
            "1 while a resize migrates the index.",
            None,
            u64::from(s.resizing),
        )?;
        gauge(
            &mut out,
            "epoch",
            "Changes of the geometry since the region was created.",
            None,
            s.epoch,
        )?;
        gauge(
            &mut out,
            "corrupt_slots",
            "Slots pointing at space that cannot be a block, found by the scans.",
            None,
            s.corrupt_slots,
        )?;
        emit(
            &mut out,
            "control_cpu",
            "CPU time of the control plane and the reclaimer.",
            Some(&Unit::Seconds),
            ConstCounter::new(s.server_cpu_us as f64 / 1e6),
        )
    }
}

fn emit(
    out: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    metric: impl EncodeMetric,
) -> Result<(), std::fmt::Error> {
    metric.encode(out.encode_descriptor(name, help, unit, metric.metric_type())?)
}

fn counter(
    out: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    value: u64,
) -> Result<(), std::fmt::Error> {
    emit(out, name, help, unit, ConstCounter::new(value))
}

fn gauge(
    out: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    value: u64,
) -> Result<(), std::fmt::Error> {
    // Byte counts fit an i64 (the region is at most 2^47 bytes).
    let value = i64::try_from(value).unwrap_or(i64::MAX);
    emit(out, name, help, unit, ConstGauge::new(value))
}
