//! `kv-bench`: measures onekv. With no `--server` it starts an embedded
//! server on a temporary shm region, so it runs on a fresh machine as is.

use clap::{Parser, Subcommand};

mod micro;
mod target;

#[derive(Parser)]
#[command(version, about, long_about)]
/// Load generator and benchmarks for onekv.
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// GET and PUT loops with fixed-size keys and values, 1 and N threads,
    /// against raw one-sided verbs as the baseline measured in the same run.
    Micro(micro::MicroArgs),
}

fn main() {
    let args = Args::parse();
    let result = match args.command {
        Command::Micro(a) => micro::run(a),
    };
    if let Err(e) = result {
        eprintln!("kv-bench: {e}");
        std::process::exit(1);
    }
}
