//! A client process that is meant to be killed: it inserts, updates and
//! deletes its own keys with tagged values as fast as it can, forever, so
//! that a `kill -9` lands at a random point of some operation.
//!
//! usage: kv-churn ADDRESS NAME KEYS

use std::process::ExitCode;

use onekv_tests::tagged_value;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: kv-churn ADDRESS NAME KEYS");
        return ExitCode::from(2);
    }
    let (address, name) = (&args[1], &args[2]);
    let Ok(keys) = args[3].parse::<u64>() else {
        eprintln!("KEYS must be a number");
        return ExitCode::from(2);
    };
    let mut kv = match kv_client::Client::connect(address) {
        Ok(kv) => kv,
        Err(e) => {
            eprintln!("kv-churn {name}: {e}");
            return ExitCode::from(1);
        }
    };
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (std::process::id() as u64) << 20;
    for seq in 1.. {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let key = format!("{name}-{}", rng % keys.max(1));
        let result = if rng.is_multiple_of(5) {
            kv.delete(key.as_bytes()).map(|_| ())
        } else {
            let value = tagged_value(&key, name, seq, (rng >> 16) as usize % 3000);
            kv.put(key.as_bytes(), &value)
        };
        if let Err(e) = result {
            eprintln!("kv-churn {name}: {e}");
            return ExitCode::from(1);
        }
    }
    ExitCode::SUCCESS
}
