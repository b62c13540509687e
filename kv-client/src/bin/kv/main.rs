//! `kv`: a command-line client for poking at a onekv server, one command
//! per run or at an interactive prompt (`repl`).

use std::ffi::OsString;
use std::io::{IsTerminal, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kv_client::{Client, ClientOptions, Geometry};

mod quoting;
mod repl;
mod store;

use store::Store;

/// Reads and writes a onekv server with one-sided verbs, like any embedded
/// client. Keys and values are taken as the bytes of the arguments; a value
/// too large for a command line comes from a file or standard input.
///
/// With no command, opens a prompt that takes the same commands (plus
/// `help` and `quit`), with history and line editing. There, as in
/// redis-cli, values are shown in double quotes with other than printable
/// ASCII escaped (\n, \xff), and typed the same way: "hello world",
/// "\x00\x01". --raw shows them as they are.
///
/// Exit status: 0 on success, 1 when `get` or `del` finds no such key, 2 on
/// errors (the prompt exits 0 at `quit` or end of input, 2 if it cannot
/// connect, if a line of its input is not UTF-8, or if its answers cannot
/// be written: the lines after are not run).
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// Server address, e.g. shm:///dev/shm/onekv, or a cluster's:
    /// etcd://HOST:PORT[,HOST:PORT...]/NAME, or its members'
    /// cluster+rdma://HOST:PORT[,HOST:PORT...] (cluster+shm:///PATH[,...]).
    #[arg(long, env = "ONEKV_SERVER", default_value = "shm:///dev/shm/onekv")]
    server: String,
    /// File holding the server's shared secret, if it requires one.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// At the prompt, print values as they are instead of quoted.
    #[arg(long)]
    raw: bool,
    /// How many races against other writers of its key a command may lose
    /// before it gives up ("gave up after N attempts under contention").
    #[arg(long, default_value_t = ClientOptions::default().max_attempts,
          value_parser = clap::value_parser!(u32).range(1..))]
    max_attempts: u32,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
#[command(disable_help_subcommand = true)]
enum Command {
    /// Store VALUE under KEY. Without VALUE, the value is read from
    /// --value-file, or else from standard input (all of it, byte for byte).
    Put {
        #[arg(allow_hyphen_values = true)]
        key: OsString,
        #[arg(allow_hyphen_values = true)]
        value: Option<OsString>,
        /// Read the value from this file instead.
        #[arg(long, conflicts_with = "value")]
        value_file: Option<PathBuf>,
    },
    /// Print the value of KEY (as it is stored: a newline follows it only
    /// on a terminal); exits with status 1 if there is none.
    Get {
        #[arg(allow_hyphen_values = true)]
        key: OsString,
    },
    /// Remove KEY; exits with status 1 if there was none.
    Del {
        #[arg(allow_hyphen_values = true)]
        key: OsString,
    },
    /// Add N (default 1, may be negative) to the counter KEY, creating it at
    /// 0 first, and print its new value. Fails if KEY holds a value `put`
    /// stored (in a cluster with --replicas, a counter is its decimal text,
    /// so a number `put` there counts on from it), or if the result would
    /// lie beyond ±2^61 (the counter is then unchanged); `get` prints a
    /// counter in decimal.
    Incr {
        #[arg(allow_hyphen_values = true)]
        key: OsString,
        #[arg(default_value_t = 1, allow_negative_numbers = true)]
        n: i64,
    },
    /// Print the server's statistics (of a cluster: the server of shard
    /// --shard).
    Stats {
        #[arg(long)]
        shard: Option<u32>,
    },
    /// Double the server's index now (it also doubles by itself when the
    /// index fills) and print the new geometry once it is in force (of a
    /// cluster: shard --shard's).
    Resize {
        #[arg(long)]
        shard: Option<u32>,
    },
    /// Of a cluster: its members, the shards each serves, the shard map's
    /// epoch, the move under way and (read from etcd) the --op-deadline-ms
    /// every member runs.
    Cluster,
}

/// What a command found, for the caller to print its own way.
enum Outcome {
    Stored,
    Value(Option<Vec<u8>>),
    Deleted(bool),
    Counter(i64),
    /// Lines of `name value`.
    Report(Vec<String>),
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
    let mut options = ClientOptions::default().with_max_attempts(args.max_attempts);
    if let Some(path) = &args.secret_file {
        options = options.with_secret(kv_common::secret::read_secret_file(path)?);
    }
    let mut kv = Store::connect(&args.server, options)?;
    let code = match args.command {
        None => {
            let style = match args.raw {
                true => repl::Style::Raw,
                false => repl::Style::Annotated,
            };
            repl::run(&mut kv, &args.server, style)?;
            ExitCode::SUCCESS
        }
        Some(command) => {
            let missing = command.key().map(|k| k.to_string_lossy().into_owned());
            match execute(&mut kv, command)? {
                Outcome::Value(None) | Outcome::Deleted(false) => {
                    eprintln!("kv: key not found: {}", missing.unwrap_or_default());
                    ExitCode::from(1)
                }
                // Byte for byte into a file or a pipe (`kv get photo >
                // photo.jpg`); a line of its own on a terminal.
                Outcome::Value(Some(value)) => print_out(|out| {
                    out.write_all(&value)?;
                    match std::io::stdout().is_terminal() {
                        true => out.write_all(b"\n"),
                        false => Ok(()),
                    }
                })?,
                Outcome::Counter(n) => print_out(|out| writeln!(out, "{n}"))?,
                Outcome::Report(lines) => {
                    print_out(|out| lines.iter().try_for_each(|l| writeln!(out, "{l}")))?
                }
                Outcome::Stored | Outcome::Deleted(true) => ExitCode::SUCCESS,
            }
        }
    };
    kv.close().map_err(|e| e.to_string())?;
    Ok(code)
}

/// Writes a one-shot result to standard output; a closed pipe (`kv stats
/// | head -1`) is an error message and status 2, not a panic.
fn print_out(
    write: impl FnOnce(&mut std::io::StdoutLock) -> std::io::Result<()>,
) -> Result<ExitCode, String> {
    let mut out = std::io::stdout().lock();
    write(&mut out)
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing the result: {e}"))?;
    Ok(ExitCode::SUCCESS)
}

impl Command {
    fn key(&self) -> Option<&OsString> {
        match self {
            Command::Put { key, .. }
            | Command::Get { key }
            | Command::Del { key }
            | Command::Incr { key, .. } => Some(key),
            Command::Stats { .. } | Command::Resize { .. } | Command::Cluster => None,
        }
    }
}

/// Runs one command; errors are the client's, as text.
fn execute(kv: &mut Store, command: Command) -> Result<Outcome, String> {
    let e = |e: kv_client::Error| e.to_string();
    Ok(match command {
        Command::Put {
            key,
            value,
            value_file,
        } => {
            let value = match (value, value_file) {
                (Some(v), _) => v.into_encoded_bytes(),
                (None, Some(path)) => {
                    let what = path.display().to_string();
                    let file = std::fs::File::open(&path)
                        .map_err(|e| format!("cannot read {what}: {e}"))?;
                    read_value(file, &what)?
                }
                (None, None) => read_value(std::io::stdin(), "standard input")?,
            };
            kv.put(key.as_bytes(), &value).map_err(e)?;
            Outcome::Stored
        }
        Command::Get { key } => Outcome::Value(kv.get(key.as_bytes()).map_err(e)?),
        Command::Del { key } => Outcome::Deleted(kv.delete(key.as_bytes()).map_err(e)?),
        Command::Incr { key, n } => Outcome::Counter(kv.incr(key.as_bytes(), n).map_err(e)?),
        Command::Stats { shard } => Outcome::Report(stats(kv.server(shard)?)?),
        Command::Cluster => Outcome::Report(kv.cluster_status()?),
        Command::Resize { shard } => {
            let kv = kv.server(shard)?;
            let before = kv.geometry().bucket_count;
            let g: Geometry = kv.resize().map_err(e)?;
            Outcome::Report(vec![format!(
                "buckets {before} -> {} (epoch {}, region {} bytes)",
                g.bucket_count, g.epoch, g.region_len
            )])
        }
    })
}

/// A value from `source`, read no further than one byte past the largest
/// value a server takes: an endless source (/dev/zero, a pipe that never
/// closes) fails at the limit rather than fill the memory.
fn read_value(source: impl Read, what: &str) -> Result<Vec<u8>, String> {
    let limit = kv_common::layout::MAX_VALUE;
    let mut value = Vec::new();
    source
        .take(limit as u64 + 1)
        .read_to_end(&mut value)
        .map_err(|e| format!("cannot read {what}: {e}"))?;
    if value.len() > limit {
        return Err(format!(
            "the value in {what} is larger than the {limit}-byte limit"
        ));
    }
    Ok(value)
}

fn stats(kv: &mut Client) -> Result<Vec<String>, String> {
    let s = kv.server_stats().map_err(|e| e.to_string())?;
    let g = kv.geometry();
    Ok(vec![
        format!("clients_connected {}", s.clients_connected),
        format!("control_connections {}", s.connections),
        format!("connects {}", s.connects),
        format!("rejected_connects {}", s.rejected_connects),
        format!("disconnects {}", s.disconnects),
        format!("departures {}", s.departures),
        format!("leases {}", s.leases),
        format!("give_backs {}", s.give_backs),
        format!("refused_give_backs {}", s.refused_give_backs),
        format!("reported_blocks {}", s.reported_blocks),
        format!("freed_on_report {}", s.freed_on_report),
        format!("refused_reports {}", s.refused_reports),
        format!("malformed_messages {}", s.malformed),
        format!("epoch {}", s.epoch),
        format!("resizes {}", s.resizes),
        format!("resizing {}", s.resizing),
        format!("declined_resizes {}", s.declined_resizes),
        format!("frozen_slots {}", s.frozen_slots),
        format!("thawed_slots {}", s.thawed_slots),
        format!("header_repairs {}", s.header_repairs),
        format!("faulted_clients {}", s.faulted_clients),
        format!("write_grant_failures {}", s.write_grant_failures),
        format!("buckets {} (slots {})", s.bucket_count, s.index_slots),
        format!(
            "live_slots {} (as of index scan {})",
            s.live_slots, s.index_scans
        ),
        format!("occupancy {:.3}", s.occupancy()),
        format!("region_bytes {}", s.region_bytes),
        format!("max_region_bytes {}", s.max_region_bytes),
        format!("growths {}", s.growths),
        format!("live_bytes {}", s.live_bytes),
        format!("corrupt_slots {}", s.corrupt_slots),
        format!("heap_bytes {}", s.heap_size),
        format!("heap_free_bytes {}", s.heap_free),
        format!("heap_leased_bytes {}", s.heap_leased),
        format!("chunk_bytes {}", g.chunk_size),
        format!("max_value_bytes {}", kv.max_value()),
        format!("server_cpu_us {}", s.server_cpu_us),
    ])
}
