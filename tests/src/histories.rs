//! Histories of registers (one per key) checked for linearizability with
//! stateright's LinearizabilityTester, round by round: each round ends
//! with a read of every key by a reader of its own, which fixes the
//! values the next round starts from.

use stateright::semantics::register::{Register, RegisterOp, RegisterRet};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester};

use crate::{or_abort, parse_tagged};

pub type Value = Option<Vec<u8>>;

/// One entry of a log: a key, a thread, what it asked or got.
pub enum Event {
    Invoke(usize, usize, RegisterOp<Value>),
    Return(usize, usize, RegisterRet<Value>),
}

impl Event {
    /// Ends a round, after its final reads.
    pub fn round_end() -> Event {
        Event::Invoke(usize::MAX, 0, RegisterOp::Read)
    }
}

/// Ends a round in `log`: the reads by thread `reader` that fix each of
/// `keys` keys' value (`read(k)`), then the round's end.
pub fn end_round(
    log: &std::sync::Mutex<Vec<Event>>,
    keys: usize,
    reader: usize,
    mut read: impl FnMut(usize) -> Value,
) {
    for k in 0..keys {
        let v = read(k);
        let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
        log.push(Event::Invoke(k, reader, RegisterOp::Read));
        log.push(Event::Return(k, reader, RegisterRet::ReadOk(v)));
    }
    log.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Event::round_end());
}

/// Checks each round of `events` for each of `keys` keys (named by
/// `name`), where thread `final_reader` made the reads that end a round;
/// panics with the history of the first key that is not linearizable.
/// Returns how many rounds it checked.
pub fn check_rounds(
    events: &[Event],
    keys: usize,
    final_reader: usize,
    name: impl Fn(usize) -> String,
) -> usize {
    let mut state: Vec<Value> = vec![None; keys];
    let mut rounds_checked = 0;
    for round in events.split(|e| matches!(e, Event::Invoke(usize::MAX, ..))) {
        if round.is_empty() {
            continue;
        }
        for (k, start) in state.iter_mut().enumerate() {
            let mut tester = LinearizabilityTester::new(Register(start.clone()));
            let mut final_read = None;
            for e in round {
                match e {
                    Event::Invoke(kk, t, op) if *kk == k => {
                        tester.on_invoke(*t, op.clone()).expect("valid history");
                    }
                    Event::Return(kk, t, ret) if *kk == k => {
                        tester.on_return(*t, ret.clone()).expect("valid history");
                        if *t == final_reader {
                            if let RegisterRet::ReadOk(v) = ret {
                                final_read = Some(v.clone());
                            }
                        }
                    }
                    _ => {}
                }
            }
            if !tester.is_consistent() {
                let shown: Vec<String> = round
                    .iter()
                    .filter_map(|e| match e {
                        Event::Invoke(kk, t, op) if *kk == k => {
                            Some(format!("t{t} invoke {}", show_op(op)))
                        }
                        Event::Return(kk, t, ret) if *kk == k => {
                            Some(format!("t{t} return {}", show_ret(ret)))
                        }
                        _ => None,
                    })
                    .collect();
                panic!(
                    "round {rounds_checked}, key {}: history is not linearizable; start {:?}\n{}",
                    name(k),
                    start.as_deref().map(short),
                    shown.join("\n")
                );
            }
            *start = final_read.expect("round ends with a read");
        }
        rounds_checked += 1;
    }
    rounds_checked
}

/// Aborts unless `v` is absent or a whole value written for `name`.
pub fn check_owner(name: &str, v: &Value) {
    if let Some(v) = v {
        let Some((owner, _, _)) = parse_tagged(v) else {
            or_abort(Err("torn value"), "get")
        };
        if owner != name {
            or_abort(Err(format!("{name} read {owner}'s value")), "get")
        }
    }
}

fn short(v: &[u8]) -> String {
    parse_tagged(v).map_or_else(|| "<torn>".into(), |(_, w, seq)| format!("{w}#{seq}"))
}

fn show_op(op: &RegisterOp<Value>) -> String {
    match op {
        RegisterOp::Read => "read".into(),
        RegisterOp::Write(Some(v)) => format!("put {}", short(v)),
        RegisterOp::Write(None) => "delete".into(),
    }
}

fn show_ret(ret: &RegisterRet<Value>) -> String {
    match ret {
        RegisterRet::WriteOk => "ok".into(),
        RegisterRet::ReadOk(v) => format!("{:?}", v.as_deref().map(short)),
    }
}
