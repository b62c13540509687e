//! `kv-bench load|run`: a YCSB workload against onekv.

use std::path::PathBuf;

use clap::Args;

use crate::driver::{run_phase, Phase, RunOptions};
use crate::plot;
use crate::properties::Properties;
use crate::report;
use crate::store::Onekv;
use crate::target::Target;
use crate::workload::Workload;

#[derive(Args, Clone)]
pub struct WorkloadArgs {
    /// YCSB workload file, e.g. benches/workloads/workloada.
    #[arg(long, short = 'P', value_name = "FILE")]
    pub workload: PathBuf,
    /// Set a workload property, overriding the file (repeatable):
    /// -p recordcount=100000 -p requestdistribution=uniform
    #[arg(short = 'p', value_name = "KEY=VALUE")]
    pub property: Vec<String>,
    /// Worker threads (the same as -p threadcount=N).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seed of every generator: one seed, one sequence of keys, values and operations.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also draw the results as an SVG picture: throughput over time and
    /// latency percentiles (run/load), or throughput per target and their
    /// latency percentiles (compare).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// onekv server address, or a cluster's etcd://HOST:PORT/NAME (or its
    /// members' cluster+rdma://HOST:PORT,...); by
    /// default an embedded server on a temporary shm region, which starts
    /// at the server's default size and grows.
    #[arg(long)]
    pub server: Option<String>,
    /// File holding the server's shared secret.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Print a status line (operations so far, current ops/s) this often,
    /// in seconds, instead of a progress bar (default: a bar on a terminal,
    /// else every 10 s).
    #[arg(long, value_name = "SECS")]
    pub status_interval: Option<f64>,
    /// Initial region size of the embedded server (default: the server's
    /// default; it grows as the data does).
    #[arg(long, value_parser = kv_common::size::parse_size)]
    pub memory: Option<u64>,
    /// Size the embedded server's region may grow to (default: the
    /// server's); at it, writes fail with "region full" once a collection
    /// finds no space.
    #[arg(long, value_parser = kv_common::size::parse_size)]
    pub max_memory: Option<u64>,
    /// Keys each onekv client remembers the slot of (slot hints: one round
    /// trip per operation on a key used recently; 0 turns them off).
    /// Default: the client's (65 536 over rdma, 4 096 over shm).
    #[arg(long, value_name = "N")]
    pub slot_cache_entries: Option<usize>,
}

impl WorkloadArgs {
    /// The workload file with -p and --threads applied, validated; warnings
    /// (unknown properties) are printed.
    pub fn workload(&self) -> Result<Workload, String> {
        let mut props = Properties::load(&self.workload)?;
        for p in &self.property {
            props.set_override(p)?;
        }
        if let Some(t) = self.threads {
            props.set_override(&format!("threadcount={t}"))?;
        }
        let (w, warnings) = Workload::from_properties(&props)?;
        for warning in warnings {
            eprintln!("kv-bench: warning: {warning}");
        }
        Ok(w)
    }

    pub fn secret(&self) -> Result<Option<Vec<u8>>, String> {
        self.secret_file
            .as_deref()
            .map(kv_common::secret::read_secret_file)
            .transpose()
    }

    pub fn status_interval(&self) -> Result<Option<std::time::Duration>, String> {
        self.status_interval
            .map(|s| {
                std::time::Duration::try_from_secs_f64(s)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        format!("--status-interval {s}: must be a positive number of seconds")
                    })
            })
            .transpose()
    }

    pub fn workload_name(&self) -> String {
        self.workload
            .file_name()
            .map_or_else(|| "workload".into(), |n| n.to_string_lossy().into_owned())
    }
}

/// Bytes a workload's data needs, with room for blocks waiting out their
/// grace period and for the index (for stores that cannot grow, like LMDB's
/// map).
pub fn memory_for(w: &Workload) -> u64 {
    // Saturating: a workload too big for any memory is refused by its
    // store, not by an overflow here.
    let records = w.insertcount.saturating_add(w.run_inserts());
    let record = w.fieldcount * (w.fieldlength + 4) + 64 + 64;
    let bytes = records.saturating_mul(record).saturating_mul(3);
    bytes.max(64 << 20).saturating_add(64 << 20)
}

/// Runs `phases` of the workload, in order, on onekv.
pub fn run(args: WorkloadArgs, phases: &[Phase]) -> Result<(), String> {
    let w = args.workload()?;
    let target = Target::open(args.server.as_deref(), args.memory, args.max_memory)?;
    let store = Onekv {
        address: target.address.clone(),
        secret: args.secret()?,
        slot_cache_entries: args.slot_cache_entries,
    };
    println!(
        "onekv {} on {}: {} records, {}, {} threads, seed {}",
        args.workload_name(),
        target.address,
        w.recordcount,
        w.describe_run(),
        w.threadcount,
        args.seed
    );
    let options = RunOptions::for_terminal(args.seed, args.status_interval()?);
    let mut results = Vec::new();
    let mut out = std::io::stdout().lock();
    let load = match phases.contains(&Phase::Run) {
        true => w.for_load_before_run(),
        false => w.clone(),
    };
    for &phase in phases {
        let phase_w = match phase {
            Phase::Load => &load,
            Phase::Run => &w,
        };
        let result = run_phase(&store, phase_w, phase, &options)?;
        report::print_ycsb(&mut out, &result).map_err(|e| e.to_string())?;
        if let Some(why) = (phase == Phase::Load)
            .then(|| result.load_cut_short(w.insertcount))
            .flatten()
        {
            return Err(format!("the load phase {why}"));
        }
        results.push(result);
    }
    let phases: Vec<_> = results
        .iter()
        .map(|r| report::phase_json("onekv", r))
        .collect();
    if let Some(lines) = target.growth_report() {
        std::io::Write::write_all(&mut out, format!("{lines}\n").as_bytes())
            .map_err(|e| e.to_string())?;
    }
    if let Some(path) = &args.json {
        report::write_json(
            path,
            &serde_json::json!({ "workload": args.workload_name(), "phases": phases }),
        )?;
    }
    if let Some(path) = &args.plot {
        let series: Vec<_> = results
            .iter()
            .map(|r| plot::Series {
                name: plot::phase_name(r.phase),
                result: r,
            })
            .collect();
        let title = format!(
            "onekv, YCSB {}: {} records, threads {}",
            args.workload_name(),
            w.recordcount,
            w.threadcount
        );
        plot::run(path, &title, &series)?;
    }
    Ok(())
}
