//! Connections shared by many threads. A [`Client`] is one connection with
//! its own local buffer and leased heap space, used by one thread at a time;
//! a pool hands each thread one for as long as it needs it and takes it back
//! afterwards, so a program with hundreds of short tasks holds only as many
//! connections (and leases) as run at once. A cluster's clients
//! ([`crate::ClusterClient`]) are pooled alike ([`ClusterPool`]).

use std::ops::{Deref, DerefMut};

use crossbeam::queue::ArrayQueue;

use crate::{Client, ClientOptions, Result};

/// What a [`Pool`] holds: a client made from an address and options.
pub trait Connect: Sized + sealed::Sealed {
    /// # Errors
    ///
    /// The client's own, as it connects.
    fn connect_with(address: &str, options: ClientOptions) -> Result<Self>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::Client {}
    impl Sealed for crate::ClusterClient {}
}

impl Connect for Client {
    fn connect_with(address: &str, options: ClientOptions) -> Result<Self> {
        Client::connect_with(address, options)
    }
}

impl Connect for crate::ClusterClient {
    fn connect_with(address: &str, options: ClientOptions) -> Result<Self> {
        crate::ClusterClient::connect_with(address, options)
    }
}

/// A set of connections to one server, handed out one per thread.
pub type ClientPool = Pool<Client>;

/// A set of clients of one cluster (`etcd://HOST:PORT/NAME`, or its
/// members' `cluster+rdma://...`), handed out one per thread; each reaches
/// every shard.
pub type ClusterPool = Pool<crate::ClusterClient>;

/// A connection borrowed from a [`ClientPool`].
pub type PooledClient<'a> = Borrowed<'a, Client>;

/// Clients handed out one per thread: [`ClientPool`], [`ClusterPool`].
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
pub struct Pool<C: Connect> {
    address: String,
    options: ClientOptions,
    /// Connections not handed out; one beyond its capacity is closed.
    idle: ArrayQueue<C>,
}

impl<C: Connect> Pool<C> {
    /// A pool that keeps up to `max_idle` connections (at least one) for
    /// reuse; more may be handed out at once, and those returned beyond
    /// `max_idle` are closed. Connects one now, so a wrong address or
    /// secret fails here rather than in the first worker.
    ///
    /// # Errors
    ///
    /// As [`Client::connect_with`](crate::Client::connect_with) (or
    /// `ClusterClient::connect_with`).
    pub fn new(address: &str, options: ClientOptions, max_idle: usize) -> Result<Pool<C>> {
        let first = C::connect_with(address, options.clone())?;
        let idle = ArrayQueue::new(max_idle.max(1));
        // The queue is empty and holds at least one.
        let _ = idle.push(first);
        Ok(Pool {
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
    pub fn get(&self) -> Result<Borrowed<'_, C>> {
        let client = match self.idle.pop() {
            Some(c) => c,
            None => C::connect_with(&self.address, self.options.clone())?,
        };
        Ok(Borrowed {
            pool: self,
            client: Some(client),
        })
    }

    /// Connections waiting in the pool now.
    pub fn idle(&self) -> usize {
        self.idle.len()
    }
}

/// A client borrowed from a [`Pool`]; it derefs to the client and goes
/// back to the pool when dropped.
pub struct Borrowed<'a, C: Connect> {
    pool: &'a Pool<C>,
    /// Some until dropped.
    client: Option<C>,
}

impl<C: Connect> Deref for Borrowed<'_, C> {
    type Target = C;

    fn deref(&self) -> &C {
        self.client
            .as_ref()
            .expect("a pooled client is present until drop")
    }
}

impl<C: Connect> DerefMut for Borrowed<'_, C> {
    fn deref_mut(&mut self) -> &mut C {
        self.client
            .as_mut()
            .expect("a pooled client is present until drop")
    }
}

impl<C: Connect> Drop for Borrowed<'_, C> {
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
