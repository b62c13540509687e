//! Counters changed in place by the NIC's atomics, and batches that read
//! or write many keys in a couple of round trips.
//!
//! ```sh
//! cargo run -p kv-client --example counters_and_batches [ADDRESS]
//! ```

mod support;

use kv_client::Client;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let target = support::server()?;

    // Two threads add to one counter; every increment counts.
    std::thread::scope(|s| -> kv_client::Result<()> {
        let adders: Vec<_> = (0..2)
            .map(|_| {
                let address = &target.address;
                s.spawn(move || -> kv_client::Result<()> {
                    let mut kv = Client::connect(address)?;
                    for _ in 0..500 {
                        kv.incr(b"page-views", 1)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for a in adders {
            a.join().expect("adder panicked")?;
        }
        Ok(())
    })?;
    let mut kv = Client::connect(&target.address)?;
    assert_eq!(kv.get_counter(b"page-views")?, Some(1000));
    // A GET reads a counter as decimal text.
    assert_eq!(kv.get(b"page-views")?.as_deref(), Some(&b"1000"[..]));
    // compare_and_set returns what the counter held: swapped only if that
    // is what we expected.
    assert_eq!(kv.compare_and_set(b"page-views", 1000, 0)?, Some(1000));
    println!(
        "page-views counted 1000 increments, then reset to {:?}",
        kv.get_counter(b"page-views")?
    );

    // Batches: the buckets of all keys in one round trip, their blocks in
    // the next.
    let pairs: Vec<(String, String)> = (0..20)
        .map(|i| (format!("user{i}"), format!("profile of user {i}")))
        .collect();
    kv.put_many(&pairs)?;
    let keys: Vec<&str> = pairs.iter().map(|(k, _)| k.as_str()).collect();
    let before = kv.verb_stats();
    let values = kv.get_many(&keys)?;
    let used = kv.verb_stats().since(&before);
    assert!(values
        .iter()
        .zip(&pairs)
        .all(|(v, (_, want))| v.as_deref() == Some(want.as_bytes())));
    println!(
        "get_many of {} keys: {} round trips",
        keys.len(),
        used.round_trips
    );
    let removed = kv.delete_many(&keys[..10])?;
    assert!(removed.iter().all(|&r| r));
    kv.close()?;
    Ok(())
}
