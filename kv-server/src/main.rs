//! `kv-server`: the onekv daemon, and an offline checker of region files.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use kv_cluster::member::{MemberEvent, MemberSpec, Membership};
use kv_cluster::{placement, ClusterConfig, ClusterUrl};
use kv_common::size::parse_size;
use kv_common::Address;
use kv_server::directory::Directory;
use kv_server::region::CheckMode;
use kv_server::regions_made::MissingRegions;
use kv_server::shard_host::ShardHost;
use kv_server::{Server, ServerConfig};

/// Serves a onekv region. Clients read and write it with one-sided verbs;
/// this process only answers control messages (connect, heap leases, stats)
/// and reclaims the space of overwritten values and departed clients.
///
/// The region outlives the process: restarting on the same address reopens
/// it with its data. A file that is not a onekv region of this version is
/// refused, never overwritten. The file is created readable by its owner
/// only and locked while a server (or `check`) uses it.
///
/// rdma: each connection is served from the device and GID (RoCE v2 first)
/// that hold the address it arrived at; rdma://0.0.0.0:PORT registers the
/// region on every device. ONEKV_RDMA_DEVICE and ONEKV_RDMA_GID_INDEX
/// override the choice.
#[derive(Parser)]
#[command(version, about, long_about, args_conflicts_with_subcommands = true)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Where to serve: shm:///dev/shm/NAME (region file NAME, control socket
    /// NAME.sock), or rdma://HOST:PORT when built with the rdma feature.
    #[arg(long, value_parser = Address::parse)]
    listen: Option<Address>,
    /// Initial size of a new region (index + heap), allocated up front. The
    /// region grows (in steps of its size, 64 MiB to 1 GiB) when its heap
    /// fills, up to --max-memory; an existing region starts at its own size.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    memory: u64,
    /// Largest size the region may grow to (default: the size of the file
    /// system that holds it). Writes fail with "heap full" only there.
    #[arg(long, value_parser = parse_size)]
    max_memory: Option<u64>,
    /// Index buckets (8 slots each, power of two, at least 8) of a new
    /// region (default 128). The index doubles while clients keep working
    /// when it is --resize-at full, or when a key finds its buckets full;
    /// set this to skip the early doublings when the key count is known.
    #[arg(long)]
    buckets: Option<u64>,
    /// Most buckets the index may grow to (default: no cap).
    #[arg(long)]
    max_buckets: Option<u64>,
    /// Fraction of the index's slots in use at which it doubles.
    #[arg(long, default_value_t = 0.8)]
    resize_at: f64,
    /// Index size up to which any client may have it doubled on request
    /// (`kv resize`); beyond, a request is honoured only when the index is
    /// at least half as full as --resize-at, so that no client can balloon
    /// it. Declined requests are counted (metric resizes_declined).
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    resize_on_request_up_to: u64,
    /// File backing the region of an rdma server (default
    /// /dev/shm/onekv-rdma-PORT). A shm address names its own file.
    #[arg(long)]
    region_file: Option<PathBuf>,
    /// Create a new region file readable and writable by its group too (0660
    /// instead of 0600), for clients running as other users of that group.
    #[arg(long)]
    group_access: bool,
    /// File whose contents clients must present to connect (trailing newline ignored).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Longest a client operation may take before it retries, in
    /// milliseconds (1 to 60000); freed space is reused after four times
    /// this.
    #[arg(long, default_value_t = 50, value_parser = op_deadline_ms())]
    op_deadline_ms: u64,
    /// Most clients connected at once (at most 4095); more are refused with
    /// a clear error. Open control connections are capped at twice this,
    /// and below what the descriptor limit allows (the soft limit is raised
    /// to the hard one at start; 64 descriptors stay for everything else).
    #[arg(long, default_value_t = 1024)]
    max_clients: u64,
    /// Seconds a new control connection may take to send its Connect.
    #[arg(long, default_value_t = 10)]
    handshake_timeout: u64,
    /// Seconds a connected client may stay silent on its control channel
    /// before it is cut off and its space reclaimed (it reconnects by itself
    /// at its next operation). 0: never.
    #[arg(long, default_value_t = 0)]
    idle_timeout: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g.
    /// 127.0.0.1:9464): clients, connects and refusals by reason, leases,
    /// heap and index use, resizes, control-plane CPU time. Off by default.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Log the server's statistics this often, in seconds (0: only at exit).
    #[arg(long, default_value_t = 60)]
    stats_interval: u64,
    /// Join the cluster etcd://HOST:PORT[,HOST:PORT...]/NAME (made with
    /// `kv-server cluster create`) and serve the shards its map gives this
    /// server. Each shard is a region of its own, served at an address
    /// derived from --listen: shm NAME.shard-S, rdma PORT+1+S. The other
    /// options apply to each shard.
    #[arg(long, value_parser = ClusterUrl::parse)]
    cluster: Option<ClusterUrl>,
    /// This server's name in the cluster (default: its --listen address).
    /// The map names shard owners by it: a restarted server must keep it to
    /// serve its shards again.
    #[arg(long, requires = "cluster", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    member_name: Option<String>,
    /// This server's failure domain (a rack, a host, a data centre): in a
    /// cluster with --replicas, no two copies of a shard go to servers of
    /// one zone. A server without a zone is a zone of its own.
    #[arg(long, requires = "cluster")]
    zone: Option<String>,
    /// Seconds of this server's etcd lease. A server that has not renewed
    /// it for three quarters of this starts nothing (no shard, no move)
    /// until etcd answers; if etcd then says the lease expired, it stops
    /// serving every shard and joins again. While etcd cannot be reached
    /// it serves its shards on, but in a cluster with --replicas it stops
    /// serving its copies (they may be failed over once the lease
    /// expires) until etcd says the lease lives. The copies of a server
    /// whose lease expired fail over within about this long.
    #[arg(long, default_value_t = 3, requires = "cluster",
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    lease_ttl: u64,
    /// Serve a shard from an empty region when its region is missing
    /// although this member made it (etcd records that): its keys are then
    /// gone. Without it such a server stops, saying where the region was
    /// made, rather than serve "not found" for every key the shard held (a
    /// server started with another --listen, or after a reboot emptied
    /// /dev/shm). With --replicas, only when no other server holds the
    /// shard's data (an empty copy passes for a level one): otherwise
    /// start the server again once its copies have failed over (a lease
    /// TTL), and it gets fresh ones from the other servers.
    #[arg(long, requires = "cluster")]
    recreate_missing_regions: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Make a cluster, or show one.
    Cluster {
        #[command(subcommand)]
        action: ClusterCommand,
    },
    /// Check a region file no server is using: both header records must be
    /// valid and the one in force current (when it was lost, the index is
    /// located in the heap instead); every slot must point at a block
    /// inside the heap that passes its checksum, holds a key that belongs
    /// in that bucket, and overlaps no other block; no slot may be frozen.
    /// Exits 0 when clean, 1 when damage was found, 2 on errors.
    Check {
        /// The region file (e.g. /dev/shm/onekv).
        region: PathBuf,
        /// Rewrite a damaged header (from its twin record, or from the index
        /// located in the heap), empty the damaged slots (their keys read
        /// as absent afterwards), naming each, and thaw frozen slots. First revokes every client
        /// key and waits for their verbs under way to land.
        #[arg(long)]
        repair: bool,
        /// The --op-deadline-ms of the server that last ran on the region:
        /// --repair waits four times this (at least a second) after revoking.
        #[arg(long, default_value_t = 50, value_parser = op_deadline_ms())]
        op_deadline_ms: u64,
    },
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Record a new cluster in etcd. Servers then join it with
    /// `kv-server --cluster URL --listen ADDR`.
    Create {
        /// etcd://HOST:PORT[,HOST:PORT...]/NAME
        #[arg(value_parser = ClusterUrl::parse)]
        url: ClusterUrl,
        /// Shards of the cluster (fixed from now on); a key's shard comes
        /// from its hash.
        #[arg(long, default_value_t = kv_cluster::DEFAULT_SHARDS)]
        shards: u32,
        /// Servers that must have joined before the shards are dealt out
        /// (so that all of them get a share from the start).
        #[arg(long, default_value_t = 1)]
        initial_members: u32,
        /// Copies of each shard (1 to 3), each on a server of its own (and
        /// of its own --zone): a primary, which clients read, and backups.
        /// A write returns once every copy has it. Needs at least as many
        /// --initial-members.
        #[arg(long, default_value_t = 1)]
        replicas: u32,
        /// The --op-deadline-ms every member must run (1 to 60000; a
        /// server started with another is refused). Unset: the first
        /// member to join sets it with its own.
        #[arg(long, value_parser = op_deadline_ms())]
        op_deadline_ms: Option<u64>,
    },
    /// Print the cluster's members and which shards each serves.
    Status {
        #[arg(value_parser = ClusterUrl::parse)]
        url: ClusterUrl,
    },
}

/// An operation deadline a cluster can live with: its grace period (four
/// of them) and every wait built on it stay within minutes.
fn op_deadline_ms() -> clap::builder::RangedU64ValueParser {
    clap::value_parser!(u64).range(1..=60_000)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    // Serving fails with status 1; `check` keeps 1 for "damage found".
    let (result, error_status) = match args.command {
        Some(Command::Check {
            region,
            repair,
            op_deadline_ms,
        }) => {
            let mode = if repair {
                let grace = Duration::from_millis(
                    op_deadline_ms.saturating_mul(kv_common::protocol::GRACE_DEADLINES.into()),
                );
                CheckMode::Repair {
                    settle: grace.max(Duration::from_secs(1)),
                }
            } else {
                CheckMode::Report
            };
            (check(&region, mode), 2)
        }
        Some(Command::Cluster { action }) => (cluster(action).map(|()| ExitCode::SUCCESS), 1),
        None => (serve(args.serve).map(|()| ExitCode::SUCCESS), 1),
    };
    result.unwrap_or_else(|e| {
        eprintln!("kv-server: {e}");
        ExitCode::from(error_status)
    })
}

fn check(path: &std::path::Path, mode: CheckMode) -> Result<ExitCode, String> {
    let repair = mode != CheckMode::Report;
    let report = kv_server::region::check(path, mode).map_err(|e| e.to_string())?;
    if let Some(h) = &report.header {
        let action = if report.header_repaired {
            "rewritten"
        } else {
            "damaged"
        };
        println!("header {action}: {}", h.what);
    }
    for d in &report.damaged {
        let action = if repair { "emptied" } else { "damaged" };
        println!(
            "{action}: bucket {} slot {} (slot value {:#018x}, block at {}): {}",
            d.pos.bucket,
            d.pos.index,
            d.slot.0,
            d.slot.offset(),
            d.what
        );
    }
    if report.frozen > 0 {
        println!(
            "{} frozen slots (a resize interrupted, or stray bits that stall writers): {}",
            report.frozen,
            if repair {
                format!("{} thawed", report.thawed)
            } else {
                "--repair or the next server start thaws them".to_string()
            }
        );
    }
    println!(
        "{} slots checked, {} damaged, {} repaired",
        report.slots,
        report.damaged.len(),
        report.repaired
    );
    Ok(if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn cluster(action: ClusterCommand) -> Result<(), String> {
    use kv_cluster::etcd::BlockingEtcd;
    match action {
        ClusterCommand::Create {
            url,
            shards,
            initial_members,
            replicas,
            op_deadline_ms,
        } => {
            let config = ClusterConfig {
                shards,
                initial_members,
                replicas,
            };
            let mut etcd = BlockingEtcd::connect(&url).map_err(|e| e.to_string())?;
            etcd.create(&config, op_deadline_ms)
                .map_err(|e| e.to_string())?;
            println!(
                "created {url}: {shards} shards of {replicas} cop{}, dealt once {initial_members} servers have joined",
                if replicas == 1 { "y" } else { "ies" }
            );
            Ok(())
        }
        ClusterCommand::Status { url } => {
            let mut etcd = BlockingEtcd::connect(&url).map_err(|e| e.to_string())?;
            let state = etcd.state().map_err(|e| e.to_string())?;
            print!(
                "{}",
                kv_cluster::records::describe(&state.config, &state.members, state.shard_map())
            );
            let op_deadline = etcd.describe_op_deadline().map_err(|e| e.to_string())?;
            println!("{op_deadline}");
            Ok(())
        }
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    let listen = args
        .listen
        .clone()
        .ok_or("--listen is required to serve (see --help)")?;
    let config = server_config(&args, listen)?;
    let (stop_tx, stop_rx) = mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = stop_tx.send(());
    })
    .map_err(|e| format!("cannot install signal handler: {e}"))?;
    report_sigbus();
    match args.cluster {
        Some(url) => {
            let name = args
                .member_name
                .unwrap_or_else(|| config.address.to_string());
            let ttl = Duration::from_secs(args.lease_ttl);
            let missing = match args.recreate_missing_regions {
                true => MissingRegions::Recreate,
                false => MissingRegions::Refuse,
            };
            let host =
                ShardHost::new(config, name, url.clone(), missing).map_err(|e| e.to_string())?;
            if let Some(at) = host.metrics_address() {
                tracing::info!("metrics of every shard served here at http://{at}/metrics");
            }
            serve_shards(host, url, (ttl, args.zone), &stop_rx)
        }
        None => serve_region(config, args.stats_interval, &stop_rx),
    }
}

/// As a cluster member: serves what the map gives it while it holds its
/// lease, nothing while it may not. The first stop signal drains it (its
/// shards move to the other servers, or, in a cluster of several copies,
/// each of its copies is replaced by a fresh one elsewhere, its primaries
/// handed over; then it leaves); a second, a copy here that no other
/// server can take, etcd silent past ETCD_SILENCE_LIMIT, or a drain
/// longer than DRAIN_LIMIT leaves at once.
fn serve_shards(
    host: ShardHost,
    url: ClusterUrl,
    (ttl, zone): (Duration, Option<String>),
    stop: &mpsc::Receiver<()>,
) -> Result<(), String> {
    let (events_tx, events) = mpsc::channel();
    let spec = MemberSpec {
        id: host.member().to_string(),
        listen: host.listen().to_string(),
        ttl,
        zone,
        op_deadline_ms: u64::try_from(host.op_deadline().as_millis()).unwrap_or(u64::MAX),
    };
    // Bound before joining: a second process on this address fails here.
    let directory = Directory::serve(host.listen(), host.member(), &url.name)
        .map_err(|e| format!("{}: {e}", host.listen()))?;
    let membership = Membership::join(url, spec, events_tx).map_err(|e| e.to_string())?;
    let mut host = host;
    host.set_lease(membership.lease_deadline());
    let mut member = Member {
        host,
        directory,
        membership,
        joined: false,
        placeable: false,
    };
    let mut stopping = Stopping::default();
    loop {
        if stop.try_recv().is_ok() {
            stopping.signalled();
        }
        if stopping.leaves_now(&member, ttl) {
            break;
        }
        if stopping.draining() {
            member.membership.drain();
        }
        member.tend()?;
        match events.recv_timeout(Duration::from_millis(200)) {
            Ok(event) => member.hear(event)?,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err("the membership thread ended".into())
            }
        }
    }
    tracing::info!("leaving the cluster");
    member.host.stop_all();
    member.membership.leave();
    Ok(())
}

/// Longest a stop signal waits for the shards here to move away.
const DRAIN_LIMIT: Duration = Duration::from_secs(300);
/// Longest a drain waits for an etcd that does not answer (three lease
/// TTLs if longer).
const ETCD_SILENCE_LIMIT: Duration = Duration::from_secs(10);

/// The stop signals a member has had, and how its drain is going.
#[derive(Default)]
struct Stopping {
    signals: u32,
    drain_started: Option<Instant>,
    /// Since when, in the drain, etcd has not confirmed the lease.
    etcd_silent_since: Option<Instant>,
}

impl Stopping {
    fn signalled(&mut self) {
        self.signals += 1;
        if self.signals == 1 {
            self.drain_started = Some(Instant::now());
            tracing::info!("draining: the shards here move to the other servers first (a second signal leaves at once)");
        }
    }

    fn draining(&self) -> bool {
        self.signals == 1
    }

    /// Whether the member leaves now (saying why when it cuts a drain
    /// short): drained, a second signal, or a drain that cannot finish.
    fn leaves_now(&mut self, member: &Member, ttl: Duration) -> bool {
        let Some(started) = self.drain_started else {
            return false;
        };
        if self.signals >= 2 {
            return true;
        }
        let stuck = !member.placeable;
        if member.host.is_empty() || (stuck && !member.host.keeps_copies()) {
            return true;
        }
        // A copy replacing one here goes to a server outside its group and
        // its zones: with none, waiting out the drain limit helps nobody.
        if stuck {
            tracing::warn!("leaving without a drain: no other server can take this server's copies (too few servers, or none outside a copy's zones); they fail over to the others, one copy fewer each");
            return true;
        }
        // Nothing moves without etcd: through an outage the drain would
        // wait out its limit, and an operator's stop hang with it. A
        // restart or an election of etcd's takes less than this.
        let patience = (ttl * 3).max(ETCD_SILENCE_LIMIT);
        self.etcd_silent_since = match member.membership.holds_lease() {
            true => None,
            false => self.etcd_silent_since.or(Some(Instant::now())),
        };
        if self
            .etcd_silent_since
            .is_some_and(|since| since.elapsed() > patience)
        {
            tracing::warn!("leaving without a drain: etcd has not confirmed this server's lease for {patience:?}, and no shard moves without it; once etcd answers, the shards here fail over to their other copies, or (without copies) wait for this server to return");
            return true;
        }
        if started.elapsed() > DRAIN_LIMIT {
            tracing::warn!(
                "leaving before the drain finished: it took longer than {DRAIN_LIMIT:?}"
            );
            return true;
        }
        false
    }
}

/// A member's shards and membership, as the daemon runs them.
struct Member {
    host: ShardHost,
    /// Hands the map to clients without etcd, at this member's address.
    directory: Directory,
    membership: Membership,
    joined: bool,
    /// Whether other live members could take each copy here (a drain
    /// needs that).
    placeable: bool,
}

impl Member {
    /// Between events: a failed shard server ends the daemon; a finished
    /// move is taken in; a lease known gone fences at once, not when its
    /// event is read.
    fn tend(&mut self) -> Result<(), String> {
        if let Some(why) = self.host.failure() {
            return Err(why);
        }
        let membership = &self.membership;
        self.host.poll(|| membership.holds_lease());
        if self.joined && membership.lease_lost() {
            tracing::warn!("the etcd lease is gone: serving nothing until joined again");
            self.leave_serving();
        } else if self.joined && self.host.keeps_copies() && !membership.holds_lease() {
            // Its copies may be failed over from the moment the lease
            // expires: they stop now, while it is still held (a quarter of
            // the TTL of margin), and start again once etcd says it lives
            // (`poll` follows the map then). The price: a replicated
            // cluster's shards wait out an etcd outage.
            if self.host.serves_any() {
                tracing::warn!(
                    "the etcd lease is unconfirmed: this server's copies stop until etcd answers"
                );
                self.host.stop_all();
            }
        }
        Ok(())
    }

    /// Err when the cluster refused this member: the daemon ends.
    fn hear(&mut self, event: MemberEvent) -> Result<(), String> {
        match event {
            MemberEvent::Joined { incarnation } => {
                tracing::info!(incarnation, "member of the cluster");
                self.joined = true;
            }
            MemberEvent::State(state) => {
                self.host.saw(&state);
                let (live, draining) = (state.live_zones(), state.draining_ids());
                let members = placement::Members {
                    live: &live,
                    draining: &draining,
                    held_back: &[],
                };
                self.placeable = state.shard_map().is_none_or(|map| {
                    placement::copies_can_move(map, &members, self.host.member())
                });
                if self.joined {
                    self.directory.show(Some(&state));
                }
                let membership = &self.membership;
                if let (true, Some(map)) = (self.joined, state.shard_map()) {
                    self.host.follow(map, || membership.holds_lease());
                }
            }
            // Said once per time out of the cluster: a member that cannot
            // reach etcd tries to join again every half second.
            MemberEvent::Fenced { why } if self.joined => {
                tracing::warn!("serving nothing until joined again: {why}");
                self.leave_serving();
            }
            MemberEvent::Fenced { why } => tracing::debug!("not joined: {why}"),
            MemberEvent::Refused { why } => return Err(why),
        }
        Ok(())
    }

    /// Out of the cluster until joined again: no shard, no map.
    fn leave_serving(&mut self) {
        self.joined = false;
        self.directory.show(None);
        self.host.leave();
    }
}

fn server_config(args: &ServeArgs, listen: Address) -> Result<ServerConfig, String> {
    let mut config = ServerConfig::new(listen);
    config.memory = args.memory;
    config.max_memory = args.max_memory;
    config.buckets = args.buckets;
    config.max_buckets = args.max_buckets;
    config.resize_at = args.resize_at;
    config.resize_on_request_up_to = args.resize_on_request_up_to;
    config.region_file = args.region_file.clone();
    config.group_access = args.group_access;
    config.op_deadline = Duration::from_millis(args.op_deadline_ms);
    config.max_clients = args.max_clients;
    config.metrics_listen = args.metrics_listen;
    config.timeouts.handshake = Duration::from_secs(args.handshake_timeout);
    config.timeouts.idle = (args.idle_timeout > 0).then(|| Duration::from_secs(args.idle_timeout));
    if let Some(path) = &args.secret_file {
        config.secret = Some(kv_common::secret::read_secret_file(path)?);
    }
    Ok(config)
}

fn serve_region(
    config: ServerConfig,
    stats_interval: u64,
    stop_rx: &mpsc::Receiver<()>,
) -> Result<(), String> {
    let server = Server::start(config).map_err(|e| e.to_string())?;
    if let Some(at) = server.metrics_address() {
        tracing::info!("metrics at http://{at}/metrics");
    }
    let interval = match stats_interval {
        0 => Duration::MAX,
        s => Duration::from_secs(s),
    };
    let mut stats_logged = Instant::now();
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop_rx.recv_timeout(Duration::from_secs(1)) {
        if let Some(why) = server.failure() {
            server.shutdown();
            return Err(why);
        }
        if stats_logged.elapsed() >= interval {
            tracing::info!(stats = ?server.stats(), "stats");
            stats_logged = Instant::now();
        }
    }
    tracing::info!("shutting down");
    let stats = server.shutdown();
    tracing::info!(?stats, "stopped");
    Ok(())
}

/// A SIGBUS in the server is a page of the region gone: its file was
/// truncated under the server (nothing can keep a writable file from
/// shrinking). Say so, rather than die with a bare "Bus error"; the server
/// also notices a shorter file within a second and stops.
fn report_sigbus() {
    extern "C" fn on_sigbus(_: libc::c_int) {
        const MESSAGE: &[u8] = b"kv-server: SIGBUS: a page of the region is gone (was its file \
truncated under the server?); what lay past the file's end is lost: restore the file and run \
`kv-server check`\n";
        // SAFETY: write(2) and _exit(2) are async-signal-safe, and MESSAGE
        // is a static buffer of the length passed.
        unsafe {
            // The process exits either way: a failed write has no one to
            // tell (stderr is what failed).
            let _unreported = libc::write(2, MESSAGE.as_ptr().cast(), MESSAGE.len());
            libc::_exit(135);
        }
    }
    // SAFETY: installs a handler that calls only async-signal-safe
    // functions, with a zeroed (empty) mask and no flags.
    let installed = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut action.sa_mask) == 0
            && libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) == 0
    };
    if !installed {
        tracing::warn!(
            "cannot install the SIGBUS handler: {}",
            std::io::Error::last_os_error()
        );
    }
}
