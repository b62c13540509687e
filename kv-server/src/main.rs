//! `kv-server`: the onekv daemon.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use clap::Parser;
use kv_common::size::parse_size;
use kv_common::Address;
use kv_server::{Server, ServerConfig};

/// Serves a onekv region. Clients read and write it with one-sided verbs;
/// this process only answers control messages (connect, heap leases, stats).
///
/// The region outlives the process: restarting on the same address reopens
/// it with its data. A file that is not a onekv region of this version is
/// refused, never overwritten.
///
/// rdma: the device is ONEKV_RDMA_DEVICE (default: the first one) and the
/// GID index ONEKV_RDMA_GID_INDEX (default 1, RoCEv2 over IPv4).
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// Where to serve: shm:///dev/shm/NAME (region file NAME, control socket
    /// NAME.sock), or rdma://HOST:PORT when built with the rdma feature.
    #[arg(long, value_parser = Address::parse)]
    listen: Address,
    /// Size of a new region (index + heap). An existing region keeps its size.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    memory: u64,
    /// Index buckets (8 slots each, power of two) of a new region; by default
    /// the index takes about 1/16 of the memory.
    #[arg(long)]
    buckets: Option<u64>,
    /// File backing the region of an rdma server (default
    /// /dev/shm/onekv-rdma-PORT). A shm address names its own file.
    #[arg(long)]
    region_file: Option<PathBuf>,
    /// File whose contents clients must present to connect (trailing newline ignored).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Longest a client operation may take before it retries, in
    /// milliseconds; freed space is reused after four times this.
    #[arg(long, default_value_t = 50)]
    op_deadline_ms: u64,
    /// Log the server's statistics this often, in seconds (0: only at exit).
    #[arg(long, default_value_t = 60)]
    stats_interval: u64,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run(Args::parse()) {
        eprintln!("kv-server: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    let mut config = ServerConfig::new(args.listen);
    config.memory = args.memory;
    config.buckets = args.buckets;
    config.region_file = args.region_file;
    config.op_deadline = Duration::from_millis(args.op_deadline_ms);
    if let Some(path) = &args.secret_file {
        config.secret = Some(kv_common::secret::read_secret_file(path)?);
    }

    let (stop_tx, stop_rx) = mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = stop_tx.send(());
    })
    .map_err(|e| format!("cannot install signal handler: {e}"))?;

    let server = Server::start(config).map_err(|e| e.to_string())?;
    let interval = match args.stats_interval {
        0 => Duration::MAX,
        s => Duration::from_secs(s),
    };
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop_rx.recv_timeout(interval) {
        tracing::info!(stats = ?server.stats(), "stats");
    }
    tracing::info!("shutting down");
    let stats = server.shutdown();
    tracing::info!(?stats, "stopped");
    Ok(())
}
