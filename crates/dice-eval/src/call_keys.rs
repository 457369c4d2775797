//! The keys of timed calls' inputs (python/protocol.py `Seeds.timed_call`), handed to a timing
//! process only when its timer asks for them.
//!
//! The candidate's process holds the run seed, so a call's inputs are known to it as soon as its
//! key is. With the keys of a whole round handed over when the round began (as before), a
//! program could make the round's coming inputs itself in its first timed call, compute all
//! their outputs in one batched launch, reported honestly, and answer the later calls with
//! copies: a speedup no caller of one forward ever gets. On a GPU the timer now asks for one
//! call's key right before making that call's inputs, and the evaluator answers only the next
//! call of the round: a program that asks ahead has to report calls it has not run, and the work
//! it then does outside its reported intervals is what the clock check measures
//! (runtime.rs `check_clock`). On the CPU a round's inputs are made before its first call (python/
//! protocol.py `Timer._timed_premade`), so its keys go at once. The baseline's process asks the
//! same way (its rounds then pay the same messages, which the clock check compares) and gets the
//! same key for each call, hence the same inputs.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};

/// Every timed call's key, by call, drawn at its first use.
#[derive(Default)]
pub(crate) struct CallKeys {
    keys: BTreeMap<u64, u64>,
}

impl CallKeys {
    /// The key of call `call` (the baseline's call of the number gets the candidate's).
    pub(crate) fn of_call(&mut self, call: u64) -> u64 {
        *self.keys.entry(call).or_insert_with(|| {
            // SipHash under the keys std draws from the operating system per process (and steps
            // for every `RandomState`): unpredictable outside this process.
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
        })
    }
}

/// A round's asks for keys: calls `first` .. `end` in order, on a GPU one at a time.
pub(crate) struct RoundAsks {
    next: u64,
    end: u64,
    one_at_a_time: bool,
}

impl RoundAsks {
    pub(crate) fn new(first_call: u64, n: u32, one_at_a_time: bool) -> Self {
        RoundAsks {
            next: first_call,
            end: first_call + u64::from(n),
            one_at_a_time,
        }
    }

    /// The reply to a timer's ask (`{"event": "keys", "first": F, "n": K}`); None where the ask
    /// breaks the protocol: not the round's next calls, past its end, or more than one call at
    /// a time where the round takes them so.
    pub(crate) fn answer(&mut self, ask: &Value, keys: &mut CallKeys) -> Option<Value> {
        let (first, n) = (ask["first"].as_u64()?, ask["n"].as_u64()?);
        let end = first.checked_add(n)?;
        if first != self.next || n == 0 || end > self.end || (self.one_at_a_time && n > 1) {
            return None;
        }
        self.next = end;
        let keys: Vec<u64> = (first..end).map(|call| keys.of_call(call)).collect();
        Some(json!({"op": "keys", "keys": keys}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(first: u64, n: u64) -> Value {
        json!({"event": "keys", "first": first, "n": n})
    }

    fn keys_of(reply: Option<Value>) -> Vec<u64> {
        serde_json::from_value(reply.expect("answered")["keys"].clone()).unwrap()
    }

    /// A call's key is drawn once, whichever side asks first; a GPU round hands out its calls'
    /// keys one at a time and in order; a CPU round all at once.
    #[test]
    fn keys_go_out_one_call_at_a_time_and_the_same_to_both_sides() {
        let mut keys = CallKeys::default();
        let mut baseline = RoundAsks::new(10, 3, true);
        let mut candidate = RoundAsks::new(10, 3, true);
        let first = keys_of(baseline.answer(&ask(10, 1), &mut keys));
        assert!(
            candidate.answer(&ask(11, 1), &mut keys).is_none(),
            "asked ahead"
        );
        assert!(
            candidate.answer(&ask(10, 2), &mut keys).is_none(),
            "two at once"
        );
        assert_eq!(keys_of(candidate.answer(&ask(10, 1), &mut keys)), first);
        assert!(
            candidate.answer(&ask(10, 1), &mut keys).is_none(),
            "asked again"
        );
        let second = keys_of(candidate.answer(&ask(11, 1), &mut keys));
        assert_ne!(first, second, "two calls drew one key");
        keys_of(candidate.answer(&ask(12, 1), &mut keys));
        assert!(
            candidate.answer(&ask(13, 1), &mut keys).is_none(),
            "past the round"
        );

        let mut cpu = RoundAsks::new(10, 3, false);
        let all = keys_of(cpu.answer(&ask(10, 3), &mut keys));
        assert_eq!((all.len(), &all[..1]), (3, &first[..]));
        assert!(cpu.answer(&json!({"event": "keys"}), &mut keys).is_none());
        assert_eq!(keys.of_call(11), second[0]);
    }
}
