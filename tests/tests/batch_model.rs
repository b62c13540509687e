//! Random sequences of single-key and multi-key calls, against one store and
//! a model map: the batch paths are built from the single-key paths' rules
//! (which slots to read, what a block holds, when a hint holds), so every
//! call must return what the model says, whichever path served it, with
//! hints on and off, and while the index resizes under the calls.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use kv_client::{Client, ClientOptions, Error, Values};
use onekv_tests::TestServer;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// Keys a case draws from: few, so that calls meet each other's keys.
const KEYS: u8 = 12;
/// Keys from here up are also incremented (as counters).
const COUNTER_KEYS: u8 = 8;

#[derive(Debug, Clone)]
enum Op {
    Put(u8, Vec<u8>),
    Get(u8),
    Delete(u8),
    Incr(u8, i64),
    PutMany(Vec<(u8, Vec<u8>)>),
    GetMany(Vec<u8>),
    DeleteMany(Vec<u8>),
}

/// What the model holds for a key.
#[derive(Debug, Clone, PartialEq)]
enum Held {
    Bytes(Vec<u8>),
    Counter(i64),
}

impl Held {
    /// What a GET returns for it: a counter as its decimal text.
    fn as_get(&self) -> Vec<u8> {
        match self {
            Held::Bytes(b) => b.clone(),
            Held::Counter(n) => n.to_string().into_bytes(),
        }
    }
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::collection::vec(any::<u8>(), 0..40),
        1 => prop::collection::vec(any::<u8>(), 200..1500),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS;
    let keys = prop::collection::vec(0..KEYS, 1..24);
    prop_oneof![
        3 => (key.clone(), value()).prop_map(|(k, v)| Op::Put(k, v)),
        3 => key.clone().prop_map(Op::Get),
        1 => key.clone().prop_map(Op::Delete),
        1 => (COUNTER_KEYS..KEYS, -5i64..5).prop_map(|(k, d)| Op::Incr(k, d)),
        2 => prop::collection::vec((0..KEYS, value()), 1..24).prop_map(Op::PutMany),
        3 => keys.clone().prop_map(Op::GetMany),
        1 => keys.prop_map(Op::DeleteMany),
    ]
}

/// One case: its own keys (`prefix`), a fresh model.
struct Case<'c> {
    client: &'c mut Client,
    prefix: u64,
    model: BTreeMap<u8, Held>,
    /// Kept across the case's multi-key GETs, as a caller reusing its
    /// buffers would.
    values: Values,
}

impl Case<'_> {
    fn key(&self, k: u8) -> Vec<u8> {
        format!("case{}-key{k}", self.prefix).into_bytes()
    }

    fn keys(&self, ks: &[u8]) -> Vec<Vec<u8>> {
        ks.iter().map(|&k| self.key(k)).collect()
    }

    fn get(&self, k: u8) -> Option<Vec<u8>> {
        self.model.get(&k).map(Held::as_get)
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Put(k, v) => {
                self.client.put(self.key(*k), v).map_err(fail)?;
                self.model.insert(*k, Held::Bytes(v.clone()));
            }
            Op::Get(k) => {
                let got = self.client.get(self.key(*k)).map_err(fail)?;
                prop_assert_eq!(got, self.get(*k), "get of key {}", k);
            }
            Op::Delete(k) => {
                let existed = self.client.delete(self.key(*k)).map_err(fail)?;
                prop_assert_eq!(
                    existed,
                    self.model.remove(k).is_some(),
                    "delete of key {}",
                    k
                );
            }
            Op::Incr(k, d) => self.incr(*k, *d)?,
            Op::PutMany(pairs) => {
                let pairs: Vec<(Vec<u8>, Vec<u8>)> = pairs
                    .iter()
                    .map(|(k, v)| (self.key(*k), v.clone()))
                    .collect();
                self.client.put_many(&pairs).map_err(fail)?;
                // Later pairs win, as if put one after another.
                for (k, v) in op_pairs(op) {
                    self.model.insert(k, Held::Bytes(v));
                }
            }
            Op::GetMany(ks) => {
                let keys = self.keys(ks);
                let want: Vec<Option<Vec<u8>>> = ks.iter().map(|&k| self.get(k)).collect();
                // Into reused buffers every other time.
                let got = if ks.len() % 2 == 0 {
                    self.client.get_many(&keys).map_err(fail)?
                } else {
                    self.client
                        .get_many_into(&keys, &mut self.values)
                        .map_err(fail)?;
                    self.values.iter().map(|v| v.map(<[u8]>::to_vec)).collect()
                };
                prop_assert_eq!(got, want, "get_many of {:?}", ks);
            }
            Op::DeleteMany(ks) => {
                let got = self.client.delete_many(&self.keys(ks)).map_err(fail)?;
                // A key named twice is there for its first delete only.
                let want: Vec<bool> = ks.iter().map(|k| self.model.remove(k).is_some()).collect();
                prop_assert_eq!(got, want, "delete_many of {:?}", ks);
            }
        }
        Ok(())
    }

    fn incr(&mut self, k: u8, d: i64) -> Result<(), TestCaseError> {
        let got = self.client.incr(self.key(k), d);
        match self.model.get(&k) {
            Some(Held::Bytes(_)) => {
                prop_assert!(
                    matches!(got, Err(Error::NotACounter)),
                    "incr of bytes: {:?}",
                    got
                );
            }
            held => {
                let n = match held {
                    Some(Held::Counter(n)) => n + d,
                    _ => d,
                };
                prop_assert_eq!(got.map_err(fail)?, n, "incr of key {}", k);
                self.model.insert(k, Held::Counter(n));
            }
        }
        Ok(())
    }
}

fn op_pairs(op: &Op) -> Vec<(u8, Vec<u8>)> {
    match op {
        Op::PutMany(pairs) => pairs.clone(),
        _ => Vec::new(),
    }
}

fn fail(e: Error) -> TestCaseError {
    TestCaseError::fail(format!("call failed: {e}"))
}

/// Runs random cases against one server, each case on keys of its own.
fn agrees_with_the_model(server: &TestServer, options: ClientOptions) {
    let client = RefCell::new(Client::connect_with(&server.address, options).expect("connect"));
    // Over rdma (the Soft-RoCE VM, where every verb is emulated) fewer
    // cases: they prove the same paths over the other transport.
    let cases = match onekv_tests::rdma_host() {
        Some(_) => 6,
        None => 48,
    };
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let prefix = Cell::new(0);
    let ops = prop::collection::vec(op(), 1..60);
    let result = runner.run(&ops, |ops| {
        prefix.set(prefix.get() + 1);
        let mut client = client.borrow_mut();
        let mut case = Case {
            client: &mut client,
            prefix: prefix.get(),
            model: BTreeMap::new(),
            values: Values::new(),
        };
        for op in &ops {
            case.apply(op)?;
        }
        // Whatever path wrote them, every key reads back as the model has it.
        for k in 0..KEYS {
            let got = case.client.get(case.key(k)).map_err(fail)?;
            prop_assert_eq!(got, case.get(k), "final get of key {}", k);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Whether the client remembers slots (hints) or always reads the index.
enum Hints {
    On,
    Off,
}

fn options(hints: Hints) -> ClientOptions {
    let entries = match hints {
        Hints::On => 65_536,
        Hints::Off => 0,
    };
    ClientOptions::default().with_slot_cache_entries(entries)
}

#[test]
fn single_and_batch_calls_agree_with_a_model_with_hints() {
    let server = TestServer::start(|_| {});
    agrees_with_the_model(&server, options(Hints::On));
}

#[test]
fn single_and_batch_calls_agree_with_a_model_without_hints() {
    let server = TestServer::start(|_| {});
    agrees_with_the_model(&server, options(Hints::Off));
}

#[test]
fn single_and_batch_calls_agree_with_a_model_while_the_index_resizes() {
    // Eight buckets: the index doubles again and again under the calls.
    let server = TestServer::start(|c| c.buckets = Some(8));
    agrees_with_the_model(&server, options(Hints::On));
}

#[test]
fn get_many_into_refills_the_same_buffers() {
    let srv = TestServer::start(|_| {});
    let mut kv = Client::connect(&srv.address).unwrap();
    // More keys than one batch holds; every third absent.
    let keys: Vec<String> = (0..70).map(|i| format!("buf-{i}")).collect();
    for (i, k) in keys.iter().enumerate().filter(|(i, _)| i % 3 != 0) {
        kv.put(k, vec![i as u8; 100 + i]).unwrap();
    }
    let mut values = Values::new();
    kv.get_many_into(&keys, &mut values).unwrap();
    let first: Vec<Option<*const u8>> = values.iter().map(|v| v.map(<[u8]>::as_ptr)).collect();
    for round in 0..3 {
        kv.get_many_into(&keys, &mut values).unwrap();
        assert_eq!(values.len(), keys.len());
        for (i, v) in values.iter().enumerate() {
            let want = (i % 3 != 0).then(|| vec![i as u8; 100 + i]);
            assert_eq!(v.map(<[u8]>::to_vec), want, "round {round} key {i}");
            // The same buffer, refilled: nothing allocated for it.
            assert_eq!(v.map(<[u8]>::as_ptr), first[i], "round {round} key {i}");
        }
    }
    // Fewer keys: the rest of the buffers are kept, not reported.
    kv.get_many_into(&keys[..2], &mut values).unwrap();
    assert_eq!(values.len(), 2);
    assert_eq!(values.get(2), None);
}
