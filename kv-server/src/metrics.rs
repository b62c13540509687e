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
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use kv_common::protocol::ServerStats;

use crate::control::{Refusal, Shared};
use crate::http::{Answer, HttpServer, Request};
use crate::ServerError;

const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A running endpoint; dropping it stops it.
pub struct MetricsEndpoint {
    http: HttpServer,
}

/// The servers a scrape reads: one unlabelled, or shards by number.
pub(crate) type Servers = Box<dyn Fn() -> Vec<(Option<u32>, Arc<Shared>)> + Send + Sync>;

impl MetricsEndpoint {
    pub(crate) fn start(address: SocketAddr, servers: Servers) -> Result<Self, ServerError> {
        let failed =
            |e: std::io::Error| ServerError::Config(format!("metrics endpoint on {address}: {e}"));
        let listener = TcpListener::bind(address).map_err(failed)?;
        let mut registry = Registry::with_prefix("onekv");
        registry.register_collector(Box::new(ServerCollector(servers)));
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

/// Reads the servers' figures at each scrape.
struct ServerCollector(Servers);

impl std::fmt::Debug for ServerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerCollector")
    }
}

/// One server's figures in a scrape, and its shard.
struct Source {
    shard: Option<String>,
    stats: ServerStats,
    shared: Arc<Shared>,
}

/// A family's value for one server.
enum Value {
    Counter(u64),
    Gauge(u64),
    Seconds(f64),
    Ratio(f64),
}

impl Value {
    fn encode(self, to: MetricEncoder) -> Result<(), std::fmt::Error> {
        match self {
            Value::Counter(v) => ConstCounter::new(v).encode(to),
            // Byte counts fit an i64 (the region is at most 2^47 bytes).
            Value::Gauge(v) => ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(to),
            Value::Seconds(v) => ConstCounter::new(v).encode(to),
            Value::Ratio(v) => ConstGauge::new(v).encode(to),
        }
    }

    fn metric_type(&self) -> MetricType {
        match self {
            Value::Counter(_) | Value::Seconds(_) => MetricType::Counter,
            Value::Gauge(_) | Value::Ratio(_) => MetricType::Gauge,
        }
    }
}

/// A metric family: name, help, unit, and its value for a server.
type Family = (
    &'static str,
    &'static str,
    Option<Unit>,
    fn(&ServerStats) -> Value,
);

const BYTES: Option<Unit> = Some(Unit::Bytes);

/// Every family but the refusals (labelled by reason), in the order shown.
const FAMILIES: &[Family] = &[
    ("clients_connected", "Clients connected now.", None, |s| Value::Gauge(s.clients_connected)),
    ("control_connections", "Control channels open, connected or not yet.", None, |s| Value::Gauge(s.connections)),
    ("connects", "Clients admitted.", None, |s| Value::Counter(s.connects)),
    ("disconnects", "Clients that said goodbye.", None, |s| Value::Counter(s.disconnects)),
    ("departures", "Clients that left without a goodbye (crashed, timed out, cut off); their space was reclaimed.", None, |s| Value::Counter(s.departures)),
    ("leases", "Heap chunks leased to clients.", None, |s| Value::Counter(s.leases)),
    ("give_backs", "Extents clients gave back.", None, |s| Value::Counter(s.give_backs)),
    ("give_backs_refused", "Give-backs refused: they named space the client did not hold.", None, |s| Value::Counter(s.refused_give_backs)),
    ("unlinked_reports", "Unlinked blocks clients reported.", None, |s| Value::Counter(s.reported_blocks)),
    ("freed_on_report", "Reported blocks freed after a check, without an index scan.", None, |s| Value::Counter(s.freed_on_report)),
    ("unlinked_reports_refused", "Reports that freed nothing: still referenced, undeclared, already freed, or dropped.", None, |s| Value::Counter(s.refused_reports)),
    ("malformed_messages", "Control messages that could not be decoded or made no sense.", None, |s| Value::Counter(s.malformed)),
    ("heap_size", "Heap bytes in the region.", BYTES, |s| Value::Gauge(s.heap_size)),
    ("heap_leased", "Heap bytes leased to connected clients.", BYTES, |s| Value::Gauge(s.heap_leased)),
    ("heap_free", "Heap bytes free, including those waiting out their grace period.", BYTES, |s| Value::Gauge(s.heap_free)),
    ("live", "Bytes of the blocks the index references (last scan).", BYTES, |s| Value::Gauge(s.live_bytes)),
    ("region_size", "Size of the region now.", BYTES, |s| Value::Gauge(s.region_bytes)),
    ("region_max_size", "Size the region may grow to.", BYTES, |s| Value::Gauge(s.max_region_bytes)),
    ("growths", "Times the heap grew.", None, |s| Value::Counter(s.growths)),
    ("index_slots", "Slots of the index in force.", None, |s| Value::Gauge(s.index_slots)),
    ("index_slots_used", "Slots in use (last scan).", None, |s| Value::Gauge(s.live_slots)),
    ("index_occupancy_ratio", "Fraction of the index's slots in use (last scan); it doubles at --resize-at.", None, |s| Value::Ratio(s.occupancy())),
    ("index_scans", "Scans of the index (reclamation, stats).", None, |s| Value::Counter(s.index_scans)),
    ("resizes", "Index resizes this server completed.", None, |s| Value::Counter(s.resizes)),
    ("resizes_declined", "Resize requests declined: the index was not full enough to warrant one.", None, |s| Value::Counter(s.declined_resizes)),
    ("frozen_slots", "Frozen slots in the index at the last scan (outside a resize or a shard's move: stray bits about to be thawed).", None, |s| Value::Gauge(s.frozen_slots)),
    ("thawed_slots", "Stray frozen slots thawed (found by a scan or reported by a writer).", None, |s| Value::Counter(s.thawed_slots)),
    ("header_repairs", "Times the header (a record, the epoch word) was found changed from the geometry in force and written back.", None, |s| Value::Counter(s.header_repairs)),
    ("faulted_clients", "Clients cut off because the device refused a request of theirs (over rdma: a write outside their leases, a key not theirs).", None, |s| Value::Counter(s.faulted_clients)),
    ("write_grant_failures", "Leases that could not be made writable for their client (its memory window); the client was cut off.", None, |s| Value::Counter(s.write_grant_failures)),
    ("resizing", "1 while a resize migrates the index (or a shard's move froze it).", None, |s| Value::Gauge(u64::from(s.resizing))),
    ("epoch", "Changes of the geometry since the region was created.", None, |s| Value::Gauge(s.epoch)),
    ("corrupt_slots", "Slots pointing at space that cannot be a block, found by the scans.", None, |s| Value::Gauge(s.corrupt_slots)),
    ("control_cpu", "CPU time of the control plane and the reclaimer.", Some(Unit::Seconds), |s| Value::Seconds(s.server_cpu_us as f64 / 1e6)),
];

impl Collector for ServerCollector {
    fn encode(&self, mut out: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sources: Vec<Source> = (self.0)()
            .into_iter()
            .map(|(shard, shared)| {
                // Occupancy comes from the last index scan: ask for a fresh
                // one (the reclaimer does it at most once a second).
                shared.stats_wanted.store(true, Relaxed);
                shared.wake_reclaimer();
                Source {
                    shard: shard.map(|s| s.to_string()),
                    stats: shared.stats(),
                    shared,
                }
            })
            .collect();
        let Some(first) = sources.first() else {
            return Ok(());
        };
        // Each family once, with a sample per server (and per reason).
        for (name, help, unit, value) in FAMILIES {
            let kind = value(&first.stats).metric_type();
            let mut family = out.encode_descriptor(name, help, unit.as_ref(), kind)?;
            for source in &sources {
                let labels = shard_label(source);
                value(&source.stats).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = out.encode_descriptor(
            "connects_refused",
            "Connections refused, by reason.",
            None,
            MetricType::Counter,
        )?;
        for source in &sources {
            for why in Refusal::ALL {
                let mut labels = shard_label(source);
                labels.push(("reason", why.label()));
                let refused = source.shared.counters.refused(why);
                Value::Counter(refused).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// A shard's label, none for a server alone.
fn shard_label(source: &Source) -> Vec<(&'static str, &str)> {
    source
        .shard
        .as_deref()
        .map(|s| ("shard", s))
        .into_iter()
        .collect()
}
