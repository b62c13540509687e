//! The Prometheus endpoint (`kv-server --metrics-listen ADDR`): `GET
//! /metrics` answers in Prometheus' text format (0.0.4).
//!
//! Each scrape reads the counters the control plane keeps anyway (atomics)
//! and the pool's two totals (one short lock, as a `Stats` request does):
//! no metric is kept twice, and the control thread never waits for HTTP.
//!
//! The HTTP side (`http.rs`) answers every connection from one thread
//! with deadlines, so slow or idle connections delay no scrape.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use kv_common::protocol::ServerStats;

use crate::control::{Counters, Refusal, Shared};
use crate::http::{Answer, HttpServer, Request};
use crate::ServerError;

const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A running endpoint; dropping it stops it.
pub struct MetricsEndpoint {
    http: HttpServer,
}

impl MetricsEndpoint {
    pub(crate) fn start(address: SocketAddr, shared: Arc<Shared>) -> Result<Self, ServerError> {
        let failed =
            |e: std::io::Error| ServerError::Config(format!("metrics endpoint on {address}: {e}"));
        let listener = TcpListener::bind(address).map_err(failed)?;
        let mut registry = Registry::with_prefix("onekv");
        registry.register_collector(Box::new(ServerCollector(shared)));
        let http = HttpServer::start(listener, "kv-metrics", move |r| answer(r, &registry))
            .map_err(failed)?;
        Ok(MetricsEndpoint { http })
    }

    /// Where it listens (the port the system chose, for port 0).
    pub fn address(&self) -> SocketAddr {
        self.http.address()
    }
}

/// `GET /metrics`: the figures; anything else: why not.
fn answer(request: &Request, registry: &Registry) -> Answer {
    let (status, body) = match (request.method, request.path) {
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
    Answer {
        status,
        content_type: CONTENT_TYPE,
        body,
    }
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
        clients(&mut out, &s, &shared.counters)?;
        requests(&mut out, &s)?;
        heap(&mut out, &s)?;
        index(&mut out, &s)?;
        resizes(&mut out, &s)?;
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

/// Who is connected, who was admitted or refused, and how they left.
fn clients(
    out: &mut DescriptorEncoder,
    s: &ServerStats,
    c: &Counters,
) -> Result<(), std::fmt::Error> {
    gauge(
        out,
        "clients_connected",
        "Clients connected now.",
        None,
        s.clients_connected,
    )?;
    gauge(
        out,
        "control_connections",
        "Control channels open, connected or not yet.",
        None,
        s.connections,
    )?;
    counter(out, "connects", "Clients admitted.", None, s.connects)?;
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
        out,
        "disconnects",
        "Clients that said goodbye.",
        None,
        s.disconnects,
    )?;
    counter(out, "departures", "Clients that left without a goodbye (crashed, timed out, cut off); their space was reclaimed.", None, s.departures)?;
    Ok(())
}

/// What connected clients asked of the control plane.
fn requests(out: &mut DescriptorEncoder, s: &ServerStats) -> Result<(), std::fmt::Error> {
    counter(
        out,
        "leases",
        "Heap chunks leased to clients.",
        None,
        s.leases,
    )?;
    counter(
        out,
        "give_backs",
        "Extents clients gave back.",
        None,
        s.give_backs,
    )?;
    counter(
        out,
        "give_backs_refused",
        "Give-backs refused: they named space the client did not hold.",
        None,
        s.refused_give_backs,
    )?;
    counter(
        out,
        "unlinked_reports",
        "Unlinked blocks clients reported.",
        None,
        s.reported_blocks,
    )?;
    counter(
        out,
        "freed_on_report",
        "Reported blocks freed after a check, without an index scan.",
        None,
        s.freed_on_report,
    )?;
    counter(
        out,
        "unlinked_reports_refused",
        "Reports that freed nothing: still referenced, undeclared, already freed, or dropped.",
        None,
        s.refused_reports,
    )?;
    counter(
        out,
        "malformed_messages",
        "Control messages that could not be decoded or made no sense.",
        None,
        s.malformed,
    )?;
    Ok(())
}

/// The heap and the region it lives in.
fn heap(out: &mut DescriptorEncoder, s: &ServerStats) -> Result<(), std::fmt::Error> {
    let bytes = Some(&Unit::Bytes);
    gauge(
        out,
        "heap_size",
        "Heap bytes in the region.",
        bytes,
        s.heap_size,
    )?;
    gauge(
        out,
        "heap_leased",
        "Heap bytes leased to connected clients.",
        bytes,
        s.heap_leased,
    )?;
    gauge(
        out,
        "heap_free",
        "Heap bytes free, including those waiting out their grace period.",
        bytes,
        s.heap_free,
    )?;
    gauge(
        out,
        "live",
        "Bytes of the blocks the index references (last scan).",
        bytes,
        s.live_bytes,
    )?;
    gauge(
        out,
        "region_size",
        "Size of the region now.",
        bytes,
        s.region_bytes,
    )?;
    gauge(
        out,
        "region_max_size",
        "Size the region may grow to.",
        bytes,
        s.max_region_bytes,
    )?;
    counter(out, "growths", "Times the heap grew.", None, s.growths)?;
    Ok(())
}

/// How full the index is, as the last scan found it.
fn index(out: &mut DescriptorEncoder, s: &ServerStats) -> Result<(), std::fmt::Error> {
    gauge(
        out,
        "index_slots",
        "Slots of the index in force.",
        None,
        s.index_slots,
    )?;
    gauge(
        out,
        "index_slots_used",
        "Slots in use (last scan).",
        None,
        s.live_slots,
    )?;
    emit(
        out,
        "index_occupancy_ratio",
        "Fraction of the index's slots in use (last scan); it doubles at --resize-at.",
        None,
        ConstGauge::new(s.occupancy()),
    )?;
    counter(
        out,
        "index_scans",
        "Scans of the index (reclamation, stats).",
        None,
        s.index_scans,
    )?;
    Ok(())
}

/// Resizes of the index and the geometry's changes.
fn resizes(out: &mut DescriptorEncoder, s: &ServerStats) -> Result<(), std::fmt::Error> {
    counter(
        out,
        "resizes",
        "Index resizes this server completed.",
        None,
        s.resizes,
    )?;
    counter(
        out,
        "resizes_declined",
        "Resize requests declined: the index was not full enough to warrant one.",
        None,
        s.declined_resizes,
    )?;
    gauge(
        out,
        "frozen_slots",
        "Frozen slots in the index at the last scan (outside a resize: stray bits about to be thawed).",
        None,
        s.frozen_slots,
    )?;
    counter(
        out,
        "thawed_slots",
        "Stray frozen slots thawed (found by a scan or reported by a writer).",
        None,
        s.thawed_slots,
    )?;
    gauge(
        out,
        "resizing",
        "1 while a resize migrates the index.",
        None,
        u64::from(s.resizing),
    )?;
    gauge(
        out,
        "epoch",
        "Changes of the geometry since the region was created.",
        None,
        s.epoch,
    )?;
    Ok(())
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
