//! Put, get, delete, and what a round trip costs.
//!
//! ```sh
//! cargo run -p kv-client --example basic                    # embedded server
//! cargo run -p kv-client --example basic shm:///dev/shm/onekv
//! ```

mod support;

use kv_client::{Client, Error};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let target = support::server()?;
    let mut kv = Client::connect(&target.address)?;
    println!(
        "connected: {} buckets, values up to {} bytes",
        kv.geometry().bucket_count,
        kv.max_value()
    );

    kv.put(b"greeting", b"hello")?;
    assert_eq!(kv.get(b"greeting")?.as_deref(), Some(&b"hello"[..]));

    // An update replaces the value; readers see the old one or the new one.
    kv.put(b"greeting", b"hello, world")?;
    let before = kv.verb_stats();
    let value = kv.get(b"greeting")?;
    let used = kv.verb_stats().since(&before);
    println!(
        "greeting = {:?} ({} round trips, {} bytes read)",
        value.as_deref().map(String::from_utf8_lossy),
        used.round_trips,
        used.bytes_read
    );

    // A buffer reused across reads saves an allocation per GET.
    let mut buf = Vec::new();
    assert!(kv.get_into(b"greeting", &mut buf)?);

    assert!(kv.delete(b"greeting")?);
    assert_eq!(kv.get(b"greeting")?, None);
    assert!(!kv.delete(b"greeting")?, "already gone");

    // Errors are typed: decide on the variant, not on the message.
    match kv.put(b"", b"no key") {
        Err(Error::EmptyKey) => println!("an empty key is refused"),
        other => return Err(format!("expected EmptyKey, got {other:?}").into()),
    }

    let stats = kv.server_stats()?;
    println!(
        "server: {} client(s), {} of {} heap bytes free",
        stats.clients_connected, stats.heap_free, stats.heap_size
    );
    kv.close()?;
    Ok(())
}
