//! Many threads, one pool of connections: each task borrows a client for
//! as long as it runs.
//!
//! ```sh
//! cargo run -p kv-client --example threads [ADDRESS]
//! ```

mod support;

use kv_client::{ClientOptions, ClientPool};

const THREADS: usize = 4;
const KEYS_PER_THREAD: usize = 1000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let target = support::server()?;
    let pool = ClientPool::new(&target.address, ClientOptions::default(), THREADS)?;
    let started = std::time::Instant::now();
    std::thread::scope(|s| -> kv_client::Result<()> {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let pool = &pool;
                s.spawn(move || -> kv_client::Result<()> {
                    let mut kv = pool.get()?;
                    for i in 0..KEYS_PER_THREAD {
                        let key = format!("thread{t}:key{i}");
                        kv.put(key.as_bytes(), format!("value {i}").as_bytes())?;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().expect("worker panicked")?;
        }
        Ok(())
    })?;
    let elapsed = started.elapsed();

    // Any connection sees every thread's writes.
    let mut kv = pool.get()?;
    for t in 0..THREADS {
        let key = format!("thread{t}:key{}", KEYS_PER_THREAD - 1);
        let value = kv.get(key.as_bytes())?.ok_or("a write is missing")?;
        assert_eq!(value, format!("value {}", KEYS_PER_THREAD - 1).into_bytes());
    }
    println!(
        "{} puts from {THREADS} threads in {elapsed:.2?}; {} connections in the pool",
        THREADS * KEYS_PER_THREAD,
        pool.idle() + 1
    );
    Ok(())
}
