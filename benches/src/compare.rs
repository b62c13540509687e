//! `kv-bench compare`: one generated workload against several stores.

use std::path::Path;

use clap::Args;

use crate::driver::{run_phase, OpKind, Phase, PhaseResult, RunOptions};
use crate::plot;
use crate::report;
use crate::store::{Lmdb, Onekv, Redis, StoreFactory};
use crate::target::Target;
use crate::workload::Workload;
use crate::ycsb::{memory_for, WorkloadArgs};

#[derive(Args)]
pub struct CompareArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Stores to run, in order: onekv, redis, lmdb.
    #[arg(long, value_delimiter = ',', default_value = "onekv,redis,lmdb")]
    targets: Vec<String>,
    /// Redis to use; by default a redis-server started here on loopback
    /// (skipped, with a message, when none is installed).
    #[arg(long)]
    redis_url: Option<String>,
    /// Redis writes sent per pipeline (1: no pipelining, as a plain client).
    #[arg(long, default_value_t = 1)]
    redis_pipeline: usize,
}

struct Row {
    name: String,
    load: PhaseResult,
    run: PhaseResult,
}

pub fn run(args: CompareArgs) -> Result<(), String> {
    let w = args.workload.workload()?;
    println!(
        "compare {}: {} records of {}x{} B, {}, {} threads, seed {}",
        args.workload.workload_name(),
        w.recordcount,
        w.fieldcount,
        w.fieldlength,
        w.describe_run(),
        w.threadcount,
        args.workload.seed
    );
    let options = RunOptions::for_terminal(args.workload.seed, args.workload.status_interval()?);
    let mut rows = Vec::new();
    for name in &args.targets {
        let Some(store) = open_target(name, &args, &w)? else {
            continue;
        };
        eprintln!("{name}: load phase");
        let load = run_phase(
            &*store.factory,
            &w.for_load_before_run(),
            Phase::Load,
            &options,
        )?;
        if let Some(why) = load.load_cut_short(w.insertcount) {
            println!("{name}: left out: the load phase {why}");
            continue;
        }
        eprintln!("{name}: run phase");
        let run = run_phase(&*store.factory, &w, Phase::Run, &options)?;
        if let Some(e) = &run.first_error {
            println!("{name}: errors during the run phase: first: {e}");
        }
        drop(store);
        rows.push(Row {
            name: name.clone(),
            load,
            run,
        });
    }
    print_table(&rows);
    if let Some(path) = &args.workload.json {
        write_json(path, &args, &rows)?;
    }
    if let Some(path) = &args.workload.plot {
        plot_runs(path, &args, &w, &rows)?;
    }
    Ok(())
}

/// A store to compare, fresh and empty.
struct OpenStore {
    /// The onekv server started for it, if one was (dropped first).
    _server: Option<Target>,
    factory: Box<dyn StoreFactory>,
}

/// Opens target `name`; None when it cannot run here (it says why).
fn open_target(name: &str, args: &CompareArgs, w: &Workload) -> Result<Option<OpenStore>, String> {
    let (server, factory): (_, Box<dyn StoreFactory>) = match name {
        "onekv" => {
            let t = Target::open(
                args.workload.server.as_deref(),
                args.workload.memory,
                args.workload.max_memory,
            )?;
            let f = Onekv {
                address: t.address.clone(),
                secret: args.workload.secret()?,
                slot_cache_entries: args.workload.slot_cache_entries,
            };
            (Some(t), Box::new(f))
        }
        "redis" => match Redis::start(args.redis_url.as_deref()) {
            Ok(mut r) => {
                r.pipeline = args.redis_pipeline;
                (None, Box::new(r))
            }
            Err(e) => {
                println!("skipping redis: {e}");
                return Ok(None);
            }
        },
        "lmdb" => match Lmdb::open(lmdb_map_size(w)) {
            Ok(l) => (None, Box::new(l)),
            Err(e) => {
                println!("skipping lmdb: {e}");
                return Ok(None);
            }
        },
        other => return Err(format!("unknown target '{other}' (use onekv, redis, lmdb)")),
    };
    Ok(Some(OpenStore {
        _server: server,
        factory,
    }))
}

/// LMDB's map (it cannot grow): twice what the data needs, in whole MiB,
/// or as much as the address space holds (then LMDB refuses it).
fn lmdb_map_size(w: &Workload) -> usize {
    let bytes = memory_for(w)
        .saturating_mul(2)
        .checked_next_multiple_of(1 << 20)
        .unwrap_or(u64::MAX);
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

/// Both phases of every target, to `--json`.
fn write_json(path: &Path, args: &CompareArgs, rows: &[Row]) -> Result<(), String> {
    let phases: Vec<_> = rows
        .iter()
        .flat_map(|r| {
            [
                report::phase_json(&r.name, &r.load),
                report::phase_json(&r.name, &r.run),
            ]
        })
        .collect();
    report::write_json(
        path,
        &serde_json::json!({ "workload": args.workload.workload_name(), "phases": phases }),
    )
}

/// Every target's run phase, to `--plot`.
fn plot_runs(path: &Path, args: &CompareArgs, w: &Workload, rows: &[Row]) -> Result<(), String> {
    let series: Vec<_> = rows
        .iter()
        .map(|r| plot::Series {
            name: &r.name,
            result: &r.run,
        })
        .collect();
    let title = format!(
        "YCSB {}: {} records, {}, threads {}",
        args.workload.workload_name(),
        w.recordcount,
        w.describe_run(),
        w.threadcount
    );
    plot::compare(path, &title, &series)
}

fn print_table(rows: &[Row]) {
    let kinds: Vec<OpKind> = {
        let mut k: Vec<OpKind> = rows
            .iter()
            .flat_map(|r| r.run.ops.keys().copied())
            .collect();
        k.sort();
        k.dedup();
        k
    };
    let base = rows
        .iter()
        .find(|r| r.name == "onekv")
        .map(|r| r.run.throughput());
    let mut header = format!("{:<7} {:>12} {:>9}", "target", "run ops/s", "vs onekv");
    for k in &kinds {
        header += &format!(" {:>30}", format!("{} p50/p99 us (rt/op)", k.ycsb_name()));
    }
    header += &format!(" {:>12} {:>13}", "load ops/s", "server CPU ms");
    println!("{header}");
    for r in rows {
        let ratio = base.map_or("-".to_string(), |b| {
            format!("{:.2}x", r.run.throughput() / b)
        });
        let mut line = format!("{:<7} {:>12.0} {:>9}", r.name, r.run.throughput(), ratio);
        for k in &kinds {
            let cell = r.run.ops.get(k).map_or("-".to_string(), |s| {
                // Round trips per operation, for stores that count them.
                let rt = match s.verbs.verbs {
                    0 => String::new(),
                    _ => format!(
                        " ({:.2})",
                        s.verbs.round_trips as f64 / s.operations().max(1) as f64
                    ),
                };
                format!(
                    "{:.1} / {:.1}{rt}",
                    s.latency.value_at_quantile(0.5) as f64 / 1000.0,
                    s.latency.value_at_quantile(0.99) as f64 / 1000.0
                )
            });
            line += &format!(" {cell:>30}");
        }
        let cpu = r
            .run
            .server_cpu_us
            .map_or("-".to_string(), |c| format!("{:.1}", c as f64 / 1000.0));
        line += &format!(" {:>12.0} {:>13}", r.load.throughput(), cpu);
        println!("{line}");
    }
}
