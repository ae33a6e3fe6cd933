//! How many later turns a new conversation brings, from the fleet's recent traffic.
//!
//! kv_aware credits a conversation's first turn for staying at its key's owner (see
//! `placement::kv_aware`): the credit is the future value of affinity, the turns that will
//! follow. Traffic of single questions (a shared system prompt and one user message each)
//! brings none, and there the credit only sends each question away from the backend holding
//! its prompt to compute that prompt again. So the credit is worth as many later turns as the
//! traffic shows, at most one.

use std::sync::Mutex;

/// Each request's decay, `0.5^(1 / 256)`: a count weighs half after 256 requests, so the
/// estimate follows a change of traffic within a few hundred requests, and a burst of a dozen
/// first turns does not swing it. A constant, not a `powf` a request.
const DECAY: f64 = 0.997_296_056_085_470_1;

/// Recent first turns and later turns, each decayed per request.
#[derive(Debug, Default)]
pub struct TurnMix {
    counts: Mutex<Counts>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    first: f64,
    later: f64,
}

impl TurnMix {
    /// One request was placed, a later turn of its conversation if `has_history`.
    pub fn record(&self, has_history: bool) {
        // A poisoned lock still holds two plain numbers.
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.first = c.first * DECAY + f64::from(u8::from(!has_history));
        c.later = c.later * DECAY + f64::from(u8::from(has_history));
    }

    /// Later turns per conversation: later turns over first turns, with one of each assumed
    /// (so 1 before any traffic, today's credit, and a few first turns without a follow-up
    /// already pull it well below).
    pub fn later_turns(&self) -> f64 {
        let c = *self.counts.lock().unwrap_or_else(|e| e.into_inner());
        (c.later + 1.0) / (c.first + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decay_halves_a_count_in_a_half_life() {
        assert!((DECAY - 0.5f64.powf(1.0 / 256.0)).abs() < 1e-15);
    }

    #[test]
    fn one_before_any_traffic() {
        assert_eq!(TurnMix::default().later_turns(), 1.0);
    }

    #[test]
    fn single_questions_bring_no_later_turns() {
        let mix = TurnMix::default();
        for _ in 0..8 {
            mix.record(false);
        }
        let t = mix.later_turns();
        assert!(t > 0.1 && t < 0.12, "{t}");
    }

    #[test]
    fn three_turn_conversations_bring_two() {
        let mix = TurnMix::default();
        for _ in 0..200 {
            mix.record(false);
            mix.record(true);
            mix.record(true);
        }
        let t = mix.later_turns();
        assert!((t - 2.0).abs() < 0.05, "{t}");
    }

    #[test]
    fn a_change_of_traffic_shows_within_a_few_hundred_requests() {
        let mix = TurnMix::default();
        for _ in 0..1000 {
            mix.record(false);
            mix.record(true);
        }
        assert!((mix.later_turns() - 1.0).abs() < 0.01);
        for _ in 0..512 {
            mix.record(false);
        }
        // Two half-lives: the old traffic's later turns weigh a quarter, against three
        // quarters of a window of first turns.
        let t = mix.later_turns();
        assert!(t > 0.12 && t < 0.17, "{t}");
    }
}
