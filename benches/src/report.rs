//! Results in YCSB's output format (so existing tooling parses them), plus
//! onekv's own lines (round trips and bytes per operation, CAS failures,
//! server CPU), and the same as JSON.

use std::io::Write;

use serde_json::{json, Value};

use crate::driver::{OpStats, Phase, PhaseResult};

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

fn per_op(total: u64, ops: u64) -> f64 {
    total as f64 / ops.max(1) as f64
}

pub fn print_ycsb(out: &mut dyn Write, r: &PhaseResult) -> std::io::Result<()> {
    let phase = if r.phase == Phase::Load {
        "load"
    } else {
        "run"
    };
    writeln!(out, "# {phase} phase")?;
    writeln!(out, "[OVERALL], RunTime(ms), {}", r.runtime.as_millis())?;
    writeln!(out, "[OVERALL], Throughput(ops/sec), {:.1}", r.throughput())?;
    if let Some(cpu) = r.server_cpu_us {
        writeln!(
            out,
            "[OVERALL], ServerCpuTime(ms), {:.3}",
            cpu as f64 / 1000.0
        )?;
    }
    for (kind, s) in &r.ops {
        let name = kind.ycsb_name();
        let h = &s.latency;
        let n = s.operations();
        writeln!(out, "[{name}], Operations, {n}")?;
        writeln!(
            out,
            "[{name}], AverageLatency(us), {:.3}",
            h.mean() / 1000.0
        )?;
        writeln!(out, "[{name}], MinLatency(us), {:.3}", us(h.min()))?;
        writeln!(out, "[{name}], MaxLatency(us), {:.3}", us(h.max()))?;
        writeln!(
            out,
            "[{name}], 50thPercentileLatency(us), {:.3}",
            us(h.value_at_quantile(0.50))
        )?;
        writeln!(
            out,
            "[{name}], 95thPercentileLatency(us), {:.3}",
            us(h.value_at_quantile(0.95))
        )?;
        writeln!(
            out,
            "[{name}], 99thPercentileLatency(us), {:.3}",
            us(h.value_at_quantile(0.99))
        )?;
        writeln!(
            out,
            "[{name}], 99.9thPercentileLatency(us), {:.3}",
            us(h.value_at_quantile(0.999))
        )?;
        writeln!(out, "[{name}], Return=OK, {}", s.ok)?;
        if s.not_found > 0 {
            writeln!(out, "[{name}], Return=NOT_FOUND, {}", s.not_found)?;
        }
        if s.errors > 0 {
            writeln!(out, "[{name}], Return=ERROR, {}", s.errors)?;
        }
        if s.verbs.verbs > 0 {
            writeln!(
                out,
                "[{name}], RoundTripsPerOp, {:.3}",
                per_op(s.verbs.round_trips, n)
            )?;
            writeln!(out, "[{name}], WaitsPerOp, {:.3}", per_op(s.verbs.waits, n))?;
            writeln!(
                out,
                "[{name}], BytesReadPerOp, {:.1}",
                per_op(s.verbs.bytes_read, n)
            )?;
            writeln!(
                out,
                "[{name}], BytesWrittenPerOp, {:.1}",
                per_op(s.verbs.bytes_written, n)
            )?;
            writeln!(out, "[{name}], CasFailures, {}", s.verbs.cas_failures)?;
        }
    }
    if let Some(e) = &r.first_error {
        writeln!(out, "# first error: {e}")?;
    }
    Ok(())
}

fn op_json(s: &OpStats) -> Value {
    let h = &s.latency;
    let n = s.operations();
    json!({
        "operations": n,
        "average_latency_us": h.mean() / 1000.0,
        "min_latency_us": us(h.min()),
        "max_latency_us": us(h.max()),
        "p50_latency_us": us(h.value_at_quantile(0.50)),
        "p95_latency_us": us(h.value_at_quantile(0.95)),
        "p99_latency_us": us(h.value_at_quantile(0.99)),
        "p999_latency_us": us(h.value_at_quantile(0.999)),
        "return_ok": s.ok,
        "return_not_found": s.not_found,
        "return_error": s.errors,
        "round_trips_per_op": (s.verbs.verbs > 0).then(|| per_op(s.verbs.round_trips, n)),
        "waits_per_op": (s.verbs.verbs > 0).then(|| per_op(s.verbs.waits, n)),
        "bytes_read_per_op": (s.verbs.verbs > 0).then(|| per_op(s.verbs.bytes_read, n)),
        "bytes_written_per_op": (s.verbs.verbs > 0).then(|| per_op(s.verbs.bytes_written, n)),
        "cas_failures": (s.verbs.verbs > 0).then_some(s.verbs.cas_failures),
    })
}

pub fn phase_json(target: &str, r: &PhaseResult) -> Value {
    let ops: serde_json::Map<String, Value> = r
        .ops
        .iter()
        .map(|(k, s)| (k.ycsb_name().to_string(), op_json(s)))
        .collect();
    json!({
        "target": target,
        "phase": if r.phase == Phase::Load { "load" } else { "run" },
        "runtime_ms": r.runtime.as_millis() as u64,
        "throughput_ops_per_sec": r.throughput(),
        "server_cpu_ms": r.server_cpu_us.map(|c| c as f64 / 1000.0),
        "operations": ops,
        "first_error": r.first_error,
    })
}

pub fn write_json(path: &std::path::Path, value: &Value) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {}: {e}", path.display()))
}
