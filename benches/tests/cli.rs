//! kv-bench end to end: YCSB workloads over an embedded shm server.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kv-bench"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(args)
        .output()
        .expect("run kv-bench")
}

/// Every value of a `[SECTION], name, value` line, in order (load, then run).
fn fields(stdout: &str, section: &str, name: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| {
            let mut parts = l.split(", ");
            (parts.next() == Some(section) && parts.next() == Some(name))
                .then(|| parts.next().and_then(|v| v.parse().ok()))
                .flatten()
        })
        .collect()
}

fn field(stdout: &str, section: &str, name: &str) -> Option<f64> {
    fields(stdout, section, name).first().copied()
}

#[test]
fn runs_workload_a_and_reports_in_ycsb_format() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("a.json");
    let out = bench(&[
        "run",
        "--workload",
        "workloads/workloada",
        "-p",
        "recordcount=300",
        "-p",
        "operationcount=2000",
        "--threads",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(field(&stdout, "[INSERT]", "Operations"), Some(300.0));
    let reads = field(&stdout, "[READ]", "Operations").unwrap();
    let updates = field(&stdout, "[UPDATE]", "Operations").unwrap();
    assert_eq!(reads + updates, 2000.0);
    assert!((reads - 1000.0).abs() < 150.0, "read share off: {reads}");
    assert_eq!(field(&stdout, "[READ]", "Return=OK"), Some(reads));
    // A GET reads buckets, then the block (plus, a few times in a hundred,
    // the block of another key sharing the fingerprint in a lower slot);
    // one of a key read or written within a hint's life reads both at once.
    let round_trips = field(&stdout, "[READ]", "RoundTripsPerOp").unwrap();
    assert!((1.0..2.1).contains(&round_trips), "{round_trips}");
    assert!(field(&stdout, "[OVERALL]", "Throughput(ops/sec)").unwrap() > 0.0);
    assert!(field(&stdout, "[OVERALL]", "ServerCpuTime(ms)").is_some());

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        report["phases"][1]["operations"]["READ"]["operations"].as_f64(),
        Some(reads)
    );
}

#[test]
fn workload_d_reads_only_inserted_keys() {
    let out = bench(&[
        "--workload",
        "workloads/workloadd",
        "-p",
        "operationcount=3000",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let inserts = fields(&stdout, "[INSERT]", "Operations");
    assert_eq!(inserts[0], 1000.0, "load phase");
    assert!(inserts[1] > 50.0, "run-phase inserts: {inserts:?}");
    assert_eq!(
        field(&stdout, "[READ]", "Return=NOT_FOUND"),
        None,
        "{stdout}"
    );
}

/// A load into a store at its cap stops at the first refused insert and
/// says why, instead of going on through every remaining record, each
/// refused after a collection of its own.
#[test]
fn a_load_into_a_full_store_stops_at_its_first_failed_insert() {
    let out = bench(&[
        "load",
        "--workload",
        "workloads/workloadc",
        "--memory",
        "4MiB",
        "--max-memory",
        "4MiB",
        "--threads",
        "2",
        "-p",
        "recordcount=50000",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("stopped at its first failed insert") && stderr.contains("--max-memory"),
        "{stderr}"
    );
    let stored = field(&stdout, "[INSERT]", "Return=OK").unwrap_or(0.0);
    let failed = field(&stdout, "[INSERT]", "Return=ERROR").unwrap_or(0.0);
    assert!(stored > 1000.0, "only {stored} records fit: {stdout}");
    // Each thread stops at its next insert once one has failed.
    assert!(
        (1.0..=2.0).contains(&failed),
        "{failed} failed inserts: {stdout}"
    );
}

/// `compare` leaves out a target whose load failed: its run would read
/// missing keys and look fast.
#[test]
fn compare_leaves_out_a_target_whose_load_failed() {
    let out = bench(&[
        "compare",
        "--workload",
        "workloads/workloadc",
        "--targets",
        "onekv",
        "--memory",
        "4MiB",
        "--max-memory",
        "4MiB",
        "-p",
        "recordcount=50000",
        "-p",
        "operationcount=1000",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("onekv: left out: the load phase stopped at its first failed insert"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stdout.contains("READ"),
        "a run phase was reported: {stdout}"
    );
}

#[test]
fn workload_f_and_target_throttling() {
    let out = bench(&[
        "run",
        "--workload",
        "workloads/workloadf",
        "-p",
        "operationcount=300",
        "-p",
        "target=1000",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(field(&stdout, "[READ-MODIFY-WRITE]", "Operations").unwrap() > 0.0);
    // 300 operations at 1000/s cannot finish in under ~0.3 s.
    let runtimes: Vec<f64> = stdout
        .lines()
        .filter(|l| l.starts_with("[OVERALL], RunTime(ms)"))
        .filter_map(|l| l.rsplit(", ").next()?.parse().ok())
        .collect();
    assert!(runtimes[1] >= 290.0, "run phase took {} ms", runtimes[1]);
}

#[test]
fn scans_and_bad_values_are_refused_with_the_key_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = dir.path().join("workloade");
    std::fs::write(&e, "recordcount=10\nreadproportion=0\nupdateproportion=0\nscanproportion=0.95\ninsertproportion=0.05\n").unwrap();
    let out = bench(&["run", "--workload", e.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("range scans"));

    let out = bench(&[
        "run",
        "--workload",
        "workloads/workloada",
        "-p",
        "operationcount=-1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("operationcount"));

    let out = bench(&[
        "run",
        "--workload",
        "workloads/workloada",
        "-p",
        "recordcount=20",
        "-p",
        "operationcount=20",
        "-p",
        "hbase.table=t",
    ]);
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown workload property 'hbase.table'")
    );
}

#[test]
fn compare_runs_the_same_workload_on_each_available_target() {
    let out = bench(&[
        "compare",
        "--workload",
        "workloads/workloadb",
        "-p",
        "recordcount=500",
        "-p",
        "operationcount=2000",
        "--targets",
        "onekv,lmdb,redis",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("target"))
        .collect();
    assert!(
        table
            .iter()
            .any(|l| l.starts_with("onekv") && l.contains("1.00x")),
        "{stdout}"
    );
    assert!(table.iter().any(|l| l.starts_with("lmdb")), "{stdout}");
    // Redis is either measured or skipped with a reason, never a failure.
    assert!(
        stdout.contains("skipping redis") || table.iter().any(|l| l.starts_with("redis")),
        "{stdout}"
    );
}

#[test]
fn maxexecutiontime_ends_the_run_phase() {
    let started = std::time::Instant::now();
    let out = bench(&[
        "run",
        "--workload",
        "workloads/workloadc",
        "-p",
        "operationcount=100000000",
        "-p",
        "target=2000",
        "-p",
        "maxexecutiontime=1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let reads = field(&stdout, "[READ]", "Operations").unwrap();
    assert!(
        reads > 0.0 && reads < 10_000.0,
        "{reads} reads in a 1 s run at 2000/s"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(60));
}

#[test]
fn a_run_bounded_by_its_time_alone_loads_every_record_first() {
    // At 1000 inserts/s the load outlasts maxexecutiontime three times,
    // and the run, without a count, lasts that long.
    let out = bench(&[
        "run",
        "--workload",
        "workloads/workloadc",
        "-p",
        "recordcount=3000",
        "-p",
        "operationcount=0",
        "-p",
        "target=1000",
        "-p",
        "maxexecutiontime=1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert_eq!(field(&stdout, "[INSERT]", "Operations"), Some(3000.0));
    let reads = field(&stdout, "[READ]", "Operations").unwrap_or(0.0);
    assert!(reads > 0.0, "{stdout}");
    assert_eq!(
        field(&stdout, "[READ]", "Return=OK"),
        Some(reads),
        "{stdout}"
    );
}

/// The texts of an SVG file, which must be well-formed XML with an `svg`
/// root, and how many polylines (plotted series) it draws.
fn svg_texts(path: &std::path::Path) -> (Vec<String>, usize) {
    let text = std::fs::read_to_string(path).expect("the plot was written");
    let doc = roxmltree::Document::parse(&text).expect("the plot is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(|t| t.trim().to_string()))
        .collect();
    let lines = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .count();
    (texts, lines)
}

#[test]
fn compare_and_run_draw_their_results_as_svg() {
    let dir = tempfile::tempdir().expect("dir");
    let compare_svg = dir.path().join("compare.svg");
    let out = bench(&[
        "compare",
        "--workload",
        "workloads/workloada",
        "-p",
        "recordcount=500",
        "-p",
        "operationcount=2000",
        "--targets",
        "onekv,lmdb",
        "--plot",
        compare_svg.to_str().expect("utf-8 path"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (texts, lines) = svg_texts(&compare_svg);
    for want in [
        "run phase throughput",
        "latency percentiles",
        "onekv",
        "lmdb",
        "onekv READ",
        "onekv UPDATE",
        "lmdb READ",
        "lmdb UPDATE",
        "p99.9",
    ] {
        assert!(texts.iter().any(|t| t == want), "no {want:?} in {texts:?}");
    }
    // A line per target and operation (legend swatches are paths).
    assert!(lines >= 4, "{lines} polylines");

    let run_svg = dir.path().join("run.svg");
    let out = bench(&[
        "run",
        "--workload",
        "workloads/workloadb",
        "-p",
        "recordcount=500",
        "-p",
        "operationcount=5000",
        "--plot",
        run_svg.to_str().expect("utf-8 path"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (texts, lines) = svg_texts(&run_svg);
    for want in [
        "throughput over time",
        "load",
        "run",
        "load INSERT",
        "run READ",
        "run UPDATE",
    ] {
        assert!(texts.iter().any(|t| t == want), "no {want:?} in {texts:?}");
    }
    assert!(lines >= 5, "{lines} polylines");
}
