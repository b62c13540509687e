//! A client process for multi-process tests: writes its own keys with
//! tagged values, reads its own and other writers' keys, and exits non-zero
//! on any value that is torn, foreign or older than its own last write.
//!
//! usage: kv-stress ADDRESS NAME OPS PEERS   (PEERS: comma-separated names)

use std::collections::HashMap;
use std::process::ExitCode;

use onekv_tests::{parse_tagged, tagged_value};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: kv-stress ADDRESS NAME OPS PEERS");
        return ExitCode::from(2);
    }
    let (address, name, peers) = (&args[1], &args[2], &args[4]);
    let Ok(ops) = args[3].parse::<u64>() else {
        eprintln!("OPS must be a number");
        return ExitCode::from(2);
    };
    match run(address, name, ops, peers.split(',').collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv-stress {name}: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(address: &str, name: &str, ops: u64, peers: Vec<&str>) -> Result<(), String> {
    let mut kv = kv_client::Client::connect(address).map_err(|e| e.to_string())?;
    let mut last: HashMap<String, u64> = HashMap::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ name.len() as u64;
    let mut buf = Vec::new();
    for seq in 1..=ops {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let own = format!("{name}-{}", rng % 16);
        match rng % 4 {
            0 | 1 => {
                let value = tagged_value(&own, name, seq, (rng >> 8) as usize % 1500);
                kv.put(own.as_bytes(), &value).map_err(|e| e.to_string())?;
                last.insert(own, seq);
            }
            2 => {
                if kv
                    .get_into(own.as_bytes(), &mut buf)
                    .map_err(|e| e.to_string())?
                {
                    let (key, writer, got) = parse_tagged(&buf).ok_or("torn value")?;
                    if key != own || writer != name || Some(&got) != last.get(&own) {
                        return Err(format!(
                            "{own}: read {key}/{writer}/{got}, wrote {:?}",
                            last.get(&own)
                        ));
                    }
                } else if last.contains_key(&own) {
                    return Err(format!("{own}: written but not found"));
                }
            }
            _ => {
                let peer = peers[(rng >> 20) as usize % peers.len()];
                let key = format!("{peer}-{}", (rng >> 32) % 16);
                if kv
                    .get_into(key.as_bytes(), &mut buf)
                    .map_err(|e| e.to_string())?
                {
                    let (k, writer, _) = parse_tagged(&buf).ok_or("torn value")?;
                    if k != key || writer != peer {
                        return Err(format!("{key}: read a value of {k} by {writer}"));
                    }
                }
            }
        }
    }
    let s = kv.verb_stats();
    println!(
        "{name}: {ops} ops, {} round trips, {} cas failures",
        s.round_trips, s.cas_failures
    );
    kv.close().map_err(|e| e.to_string())
}
