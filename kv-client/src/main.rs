//! `kv`: a command-line client for poking at a onekv server.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kv_client::{Client, ClientOptions};

/// Reads and writes a onekv server with one-sided verbs, like any embedded
/// client. Keys and values are taken as the bytes of the arguments; a value
/// too large for a command line comes from a file or standard input.
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// Server address, e.g. shm:///dev/shm/onekv.
    #[arg(long, env = "ONEKV_SERVER", default_value = "shm:///dev/shm/onekv")]
    server: String,
    /// File holding the server's shared secret, if it requires one.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Store VALUE under KEY. Without VALUE, the value is read from
    /// --value-file, or else from standard input (all of it, byte for byte).
    Put {
        key: String,
        value: Option<String>,
        /// Read the value from this file instead.
        #[arg(long, conflicts_with = "value")]
        value_file: Option<PathBuf>,
    },
    /// Print the value of KEY; exits with status 1 if there is none.
    Get { key: String },
    /// Remove KEY; exits with status 1 if there was none.
    Del { key: String },
    /// Add N (default 1, may be negative) to the counter KEY, creating it at
    /// 0 first, and print its new value. Fails if KEY holds a value `put`
    /// stored; `get` prints a counter in decimal.
    Incr {
        key: String,
        #[arg(default_value_t = 1, allow_negative_numbers = true)]
        n: i64,
    },
    /// Print the server's statistics.
    Stats,
    /// Double the server's index now (it also doubles by itself when the
    /// index fills) and print the new geometry once it is in force.
    Resize,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kv: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> Result<ExitCode, String> {
    let mut options = ClientOptions::default();
    if let Some(path) = &args.secret_file {
        options.secret = Some(kv_common::secret::read_secret_file(path)?);
    }
    let mut kv = Client::connect_with(&args.server, options).map_err(|e| e.to_string())?;
    let code = match args.command {
        Command::Put {
            key,
            value,
            value_file,
        } => {
            let value = match (value, value_file) {
                (Some(v), _) => v.into_bytes(),
                (None, Some(path)) => std::fs::read(&path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?,
                (None, None) => {
                    let mut v = Vec::new();
                    std::io::stdin()
                        .read_to_end(&mut v)
                        .map_err(|e| format!("reading the value from standard input: {e}"))?;
                    v
                }
            };
            kv.put(key.as_bytes(), &value).map_err(|e| e.to_string())?;
            ExitCode::SUCCESS
        }
        Command::Get { key } => match kv.get(key.as_bytes()).map_err(|e| e.to_string())? {
            Some(value) => {
                let mut out = std::io::stdout().lock();
                out.write_all(&value)
                    .and_then(|_| out.write_all(b"\n"))
                    .map_err(|e| e.to_string())?;
                ExitCode::SUCCESS
            }
            None => {
                eprintln!("kv: key not found: {key}");
                ExitCode::from(1)
            }
        },
        Command::Del { key } => {
            if kv.delete(key.as_bytes()).map_err(|e| e.to_string())? {
                ExitCode::SUCCESS
            } else {
                eprintln!("kv: key not found: {key}");
                ExitCode::from(1)
            }
        }
        Command::Incr { key, n } => {
            let value = kv.incr(key.as_bytes(), n).map_err(|e| e.to_string())?;
            println!("{value}");
            ExitCode::SUCCESS
        }
        Command::Stats => {
            let s = kv.server_stats().map_err(|e| e.to_string())?;
            let g = kv.geometry();
            println!("clients_connected {}", s.clients_connected);
            println!("control_connections {}", s.connections);
            println!("connects {}", s.connects);
            println!("rejected_connects {}", s.rejected_connects);
            println!("disconnects {}", s.disconnects);
            println!("departures {}", s.departures);
            println!("leases {}", s.leases);
            println!("give_backs {}", s.give_backs);
            println!("refused_give_backs {}", s.refused_give_backs);
            println!("malformed_messages {}", s.malformed);
            println!("epoch {}", s.epoch);
            println!("resizes {}", s.resizes);
            println!("resizing {}", s.resizing);
            println!("buckets {} (slots {})", s.bucket_count, s.index_slots);
            println!(
                "live_slots {} (as of index scan {})",
                s.live_slots, s.index_scans
            );
            println!("occupancy {:.3}", s.occupancy());
            println!("region_bytes {}", s.region_bytes);
            println!("max_region_bytes {}", s.max_region_bytes);
            println!("growths {}", s.growths);
            println!("live_bytes {}", s.live_bytes);
            println!("corrupt_slots {}", s.corrupt_slots);
            println!("heap_bytes {}", s.heap_size);
            println!("heap_free_bytes {}", s.heap_free);
            println!("heap_leased_bytes {}", s.heap_leased);
            println!("chunk_bytes {}", g.chunk_size);
            println!("max_value_bytes {}", kv.max_value());
            println!("server_cpu_us {}", s.server_cpu_us);
            ExitCode::SUCCESS
        }
        Command::Resize => {
            let before = kv.geometry().bucket_count;
            let g = kv.resize().map_err(|e| e.to_string())?;
            println!(
                "buckets {before} -> {} (epoch {}, region {} bytes)",
                g.bucket_count, g.epoch, g.region_len
            );
            ExitCode::SUCCESS
        }
    };
    kv.close().map_err(|e| e.to_string())?;
    Ok(code)
}
