//! `kv-bench`: measures onekv with YCSB workloads, side by side with the
//! stores a user might pick instead. With no `--server` it starts an
//! embedded server on a temporary shm region, so it runs on a fresh machine.

use clap::{Parser, Subcommand};

use driver::Phase;

mod compare;
mod driver;
mod generator;
mod micro;
mod plot;
mod properties;
mod report;
mod store;
mod target;
mod workload;
mod ycsb;

/// Load generator and benchmarks for onekv.
///
/// With a workload and no subcommand, runs the load phase then the run
/// phase. Workload files are YCSB's (Java properties); the core workloads
/// A, B, C, D and F ship in benches/workloads/.
#[derive(Parser)]
#[command(version, about, long_about, args_conflicts_with_subcommands = true)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    workload: Option<ycsb::WorkloadArgs>,
}

#[derive(Subcommand)]
enum Command {
    /// Load phase only: insert the workload's records. A load stops at its
    /// first failed insert (a full store, say) and exits with its error.
    Load(ycsb::WorkloadArgs),
    /// Run phase. Against the embedded server (no --server) the records are
    /// loaded first, since it starts empty; against a server, pass --load
    /// to load first too.
    Run {
        #[command(flatten)]
        workload: ycsb::WorkloadArgs,
        /// Run the load phase before the run phase.
        #[arg(long)]
        load: bool,
    },
    /// Run the same generated workload (same seed: same keys, values and
    /// operations) against onekv and its peers, and print one table.
    Compare(compare::CompareArgs),
    /// GET and PUT loops with fixed-size keys and values, 1 and N threads,
    /// against raw one-sided verbs as the baseline measured in the same run.
    Micro(micro::MicroArgs),
}

fn main() {
    let args = Args::parse();
    let result = match (args.command, args.workload) {
        (Some(Command::Load(w)), _) => ycsb::run(w, &[Phase::Load]),
        (Some(Command::Run { workload, load }), _) => {
            let load = load || workload.server.is_none();
            let phases: &[Phase] = if load {
                &[Phase::Load, Phase::Run]
            } else {
                &[Phase::Run]
            };
            ycsb::run(workload, phases)
        }
        (Some(Command::Compare(c)), _) => compare::run(c),
        (Some(Command::Micro(m)), _) => micro::run(m),
        (None, Some(w)) => ycsb::run(w, &[Phase::Load, Phase::Run]),
        (None, None) => Err("give a workload (--workload FILE) or a subcommand; see --help".into()),
    };
    if let Err(e) = result {
        eprintln!("kv-bench: {e}");
        std::process::exit(1);
    }
}
