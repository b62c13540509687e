//! Connections shared by many threads. A [`Client`] is one connection with
//! its own local buffer and leased heap space, used by one thread at a time;
//! a pool hands each thread one for as long as it needs it and takes it back
//! afterwards, so a program with hundreds of short tasks holds only as many
//! connections (and leases) as run at once.

use std::ops::{Deref, DerefMut};

use crossbeam::queue::ArrayQueue;

use crate::{Client, ClientOptions, Result};

/// A set of connections to one server, handed out one per thread.
///
/// ```no_run
/// let pool = kv_client::ClientPool::new("shm:///dev/shm/onekv", Default::default(), 8)?;
/// std::thread::scope(|s| {
///     for t in 0..8 {
///         let pool = &pool;
///         s.spawn(move || -> kv_client::Result<()> {
///             let mut kv = pool.get()?; // back in the pool when dropped
///             kv.put(format!("worker{t}").as_bytes(), b"ready")
///         });
///     }
/// });
/// # Ok::<(), kv_client::Error>(())
/// ```
pub struct ClientPool {
    address: String,
    options: ClientOptions,
    /// Connections not handed out; one beyond its capacity is closed.
    idle: ArrayQueue<Client>,
}

impl ClientPool {
    /// A pool that keeps up to `max_idle` connections (at least one) for
    /// reuse; more may be handed out at once, and those returned beyond
    /// `max_idle` are closed. Connects one now, so a wrong address or
    /// secret fails here rather than in the first worker.
    ///
    /// # Errors
    ///
    /// As [`Client::connect_with`](crate::Client::connect_with).
    pub fn new(address: &str, options: ClientOptions, max_idle: usize) -> Result<ClientPool> {
        let first = Client::connect_with(address, options.clone())?;
        let idle = ArrayQueue::new(max_idle.max(1));
        // The queue is empty and holds at least one.
        let _ = idle.push(first);
        Ok(ClientPool {
            address: address.to_string(),
            options,
            idle,
        })
    }

    /// A connection for this thread: an idle one, or a new one when none
    /// is idle. It returns to the pool when the guard is dropped.
    ///
    /// # Errors
    ///
    /// As [`Client::connect_with`](crate::Client::connect_with), when a new connection is made.
    pub fn get(&self) -> Result<PooledClient<'_>> {
        let client = match self.idle.pop() {
            Some(c) => c,
            None => Client::connect_with(&self.address, self.options.clone())?,
        };
        Ok(PooledClient {
            pool: self,
            client: Some(client),
        })
    }

    /// Connections waiting in the pool now.
    pub fn idle(&self) -> usize {
        self.idle.len()
    }
}

/// A connection borrowed from a [`ClientPool`]; it derefs to [`Client`] and
/// goes back to the pool when dropped.
pub struct PooledClient<'a> {
    pool: &'a ClientPool,
    /// Some until dropped.
    client: Option<Client>,
}

impl Deref for PooledClient<'_> {
    type Target = Client;

    fn deref(&self) -> &Client {
        self.client
            .as_ref()
            .expect("a pooled client is present until drop")
    }
}

impl DerefMut for PooledClient<'_> {
    fn deref_mut(&mut self) -> &mut Client {
        self.client
            .as_mut()
            .expect("a pooled client is present until drop")
    }
}

impl Drop for PooledClient<'_> {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            // A client dropped by a panic may be mid-way through anything:
            // it is closed, not handed to the next thread. A full pool
            // closes it too (Client's drop says goodbye).
            if !std::thread::panicking() {
                let _ = self.pool.idle.push(client);
            }
        }
    }
}
