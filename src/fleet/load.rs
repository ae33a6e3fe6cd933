//! What placement sees of the fleet's load, and the charge each request puts on it: per
//! backend its requests in flight, prefill queued, slot wait and the rates that price them.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::charge::{Expected, InflightGuard};
use super::roster::Fleet;
use crate::placement::disagg::Bias;
use crate::placement::BackendLoad;

impl Fleet {
    /// Current health and load of every backend, in ring-index order. An ejected backend
    /// counts as unhealthy.
    pub fn loads(&self) -> Vec<BackendLoad> {
        let now = Instant::now();
        self.backends
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let engine = b.telemetry().fresh(self.stale_after);
                let inflight = b.inflight();
                let engine_load = b
                    .telemetry()
                    .others_load(self.stale_after)
                    .map(|others| others + inflight);
                BackendLoad {
                    healthy: self.available(i, now),
                    weight: b.weight,
                    inflight,
                    queued_prefill: b.queued_prefill(),
                    decoding: b.decoding(),
                    prefill_rate: self.prefill_rate(i),
                    prefill_spread: self.prefill_spread(i),
                    slot_wait_s: b.slot_wait_s(now, inflight.max(engine_load.unwrap_or(0))),
                    decode_step_s: b.decode_step_seconds().unwrap_or(0.0),
                    engine_load,
                    kv_usage: engine.and_then(|e| e.kv_usage),
                    adapter_load_s: 0.0,
                }
            })
            .collect()
    }

    /// The prefill rate placement uses for backend `i` (see
    /// [`BackendState::effective_prefill_rate`]).
    pub fn prefill_rate(&self, i: usize) -> f64 {
        let explore = f64::from_bits(self.explore_rate.load(Ordering::Relaxed));
        self.backends
            .get(i)
            .map_or(0.0, |b| b.effective_prefill_rate(explore))
    }

    /// How far backend `i`'s rate may be off (see [`BackendState::prefill_spread`]).
    pub fn prefill_spread(&self, i: usize) -> f64 {
        let measured = f64::from_bits(self.explore_rate.load(Ordering::Relaxed)) > 0.0;
        self.backends
            .get(i)
            .map_or(1.0, |b| b.prefill_spread(measured))
    }

    /// How long a request placed on backend `i` with `est_ttft_s` to its first token and
    /// `max_output` tokens to write is expected to hold it: the output is at most the
    /// fleet's typical reply, at the backend's learned decode step.
    pub fn expected(&self, i: usize, est_ttft_s: f64, max_output: u64) -> Expected {
        let typical = f64::from_bits(self.typical_output.load(Ordering::Relaxed));
        let tokens = match typical {
            t if t > 0.0 => (max_output as f64).min(t),
            _ => max_output as f64,
        };
        let step = self
            .backends
            .get(i)
            .and_then(|b| b.decode_step_seconds())
            .unwrap_or(0.0);
        Expected {
            ttft_s: est_ttft_s,
            decode_s: tokens * step,
        }
    }

    /// How far from their predictions the first tokens of whole and of split requests came
    /// (0 until some have shown it).
    pub fn pd_bias(&self) -> Bias {
        let read = |i: usize| f64::from_bits(self.pd_bias[i].load(Ordering::Relaxed));
        Bias {
            whole_s: read(0),
            split_s: read(1),
        }
    }

    /// The KV transfer rate the engines have shown, bytes a second (`None` until they have).
    pub fn transfer_bytes_per_s(&self) -> Option<f64> {
        self.transfer.bytes_per_s()
    }

    /// A whole (`split` false) or split request's first token came `error_s` after (negative:
    /// before) its prediction: that path's bias moves toward it.
    pub fn observe_pd_error(&self, split: bool, error_s: f64) {
        if !error_s.is_finite() {
            return;
        }
        // A tenth each, bounded: a few dozen requests set it, one outlier does not.
        let e = error_s.clamp(-1.0, 5.0);
        let _ = self.pd_bias[usize::from(split)].fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |bits| {
                let old = f64::from_bits(bits);
                Some((old + 0.1 * (e - old)).to_bits())
            },
        );
    }

    /// A request finished with `tokens` of output: the fleet's typical reply moves toward it.
    pub fn observe_output(&self, tokens: u64) {
        // A tenth each: a few dozen replies set it, one outlier does not.
        let _ = self
            .typical_output
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let old = f64::from_bits(bits);
                let new = match old {
                    o if o > 0.0 => o + 0.1 * (tokens as f64 - o),
                    _ => tokens as f64,
                };
                Some(new.max(1.0).to_bits())
            });
    }

    /// Count a request with `prefill` estimated uncached tokens against backend `i` (and its
    /// data-parallel rank `rank`, when pinned to one) until the guard drops.
    pub fn charge(
        &self,
        i: usize,
        prefill: u64,
        rank: Option<u32>,
        expected: Expected,
    ) -> InflightGuard {
        let live = self.backends[i].live.clone();
        live.inflight.fetch_add(1, Ordering::Relaxed);
        InflightGuard::new(live, prefill, rank, expected)
    }

    /// Like [`Fleet::charge`], but only while backend `i` has fewer than `cap` (per unit of
    /// weight) requests in flight, and fewer than `bound` when given (a placement's load bound,
    /// absolute); the check and the charge are one atomic step.
    pub fn try_charge(
        &self,
        i: usize,
        prefill: u64,
        rank: Option<u32>,
        (cap, bound): (u64, Option<u64>),
        expected: Expected,
    ) -> Option<InflightGuard> {
        let backend = &self.backends[i];
        let limit = cap
            .saturating_mul(backend.weight as u64)
            .min(bound.unwrap_or(u64::MAX));
        backend
            .live
            .inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v < limit).then_some(v + 1)
            })
            .ok()?;
        Some(InflightGuard::new(
            backend.live.clone(),
            prefill,
            rank,
            expected,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::fleet::learn::PrefillCounters;
    use crate::fleet::telemetry::EngineStats;
    use crate::placement::UNMEASURED_RATE_SPREAD;

    fn fleet(backends: &str) -> Fleet {
        let yaml = format!("kvroute:\n  listen: \"127.0.0.1:1\"\n  backends:\n{backends}");
        Fleet::new(&Config::from_yaml(&yaml).unwrap()).unwrap()
    }

    fn expect(ttft_s: f64, decode_s: f64) -> Expected {
        Expected { ttft_s, decode_s }
    }

    /// Within 50 ms: the ends are stored in whole milliseconds and the test's clock runs on.
    fn near(a: f64, b: f64) -> bool {
        (a - b).abs() < 0.05
    }

    #[test]
    fn past_its_slots_a_request_waits_for_the_earliest_expected_end() {
        let f = fleet("    - addr: \"127.0.0.1:2\"\n");
        let wait = |f: &Fleet| f.loads()[0].slot_wait_s;
        let _a = f.charge(0, 800, None, expect(2.0, 3.0));
        let _b = f.charge(0, 800, None, expect(8.0, 2.0));
        let _c = f.charge(0, 800, None, expect(1.0, 0.5));
        assert_eq!(wait(&f), 0.0, "slots unknown: no wait is priced");
        f.observe_scrape(
            0,
            EngineStats {
                slots: Some(2),
                ..EngineStats::default()
            },
            None,
        );
        // Three in flight on two slots: a fourth waits for the second of them to end (5 s).
        assert!(near(wait(&f), 5.0), "{}", wait(&f));
        drop(_c);
        // Two in flight: the third gets the first slot to free up.
        assert!(near(wait(&f), 5.0), "{}", wait(&f));
        let a = _a;
        a.first_byte();
        // Answered: only its decode is left.
        assert!(near(wait(&f), 3.0), "{}", wait(&f));
        drop(a);
        assert_eq!(wait(&f), 0.0, "a slot is free");
        // Another router's requests count as busy: their ends are unknown, so the last end
        // known stands for them.
        f.backends()[0].telemetry().store(
            EngineStats {
                running: Some(3.0),
                ..EngineStats::default()
            },
            None,
            1,
        );
        assert!(near(wait(&f), 10.0), "{}", wait(&f));
    }

    #[test]
    fn a_reply_is_expected_as_long_as_the_fleets_typical_one() {
        let f = fleet("    - addr: \"127.0.0.1:2\"\n");
        assert_eq!(
            f.expected(0, 0.5, 4096),
            expect(0.5, 0.0),
            "no step learned"
        );
        f.backends()[0].observe_decode(crate::fleet::learn::DecodeCounters {
            seconds: 0.0,
            tokens: 0.0,
        });
        f.backends()[0].observe_decode(crate::fleet::learn::DecodeCounters {
            seconds: 2.0,
            tokens: 200.0,
        });
        assert!(near(f.expected(0, 0.5, 4096).decode_s, 40.96));
        // Replies of about 300 tokens: a 4,096-token ceiling is not what a slot is held for,
        // but a 16-token one is.
        for _ in 0..50 {
            f.observe_output(300);
        }
        assert!(near(f.expected(0, 0.5, 4096).decode_s, 3.0));
        assert!(near(f.expected(0, 0.5, 16).decode_s, 0.16));
    }

    #[test]
    fn a_rate_is_priced_with_how_far_it_may_be_off() {
        let f = fleet(
            "    - addr: \"127.0.0.1:2\"\n    - addr: \"127.0.0.1:3\"\n      prefill_tokens_per_s: 9000\n",
        );
        let spread = |i: usize| f.loads()[i].prefill_spread;
        assert_eq!(spread(0), 1.0, "nothing measured anywhere: all alike");
        assert_eq!(spread(1), 1.0, "the operator's rate");
        let scrape = |tokens: f64, seconds: f64| EngineStats {
            prefill: Some(PrefillCounters {
                tokens,
                seconds,
                requests: None,
                paired: true,
            }),
            ..EngineStats::default()
        };
        f.observe_scrape(0, scrape(0.0, 0.0), None);
        f.observe_scrape(0, scrape(800.0, 6.0), None);
        assert_eq!(
            spread(0),
            1.0,
            "one paired prefill proves a lower bound: priced at it"
        );
        // Another backend, nothing measured of it while backend 0 is.
        let h = fleet("    - addr: \"127.0.0.1:2\"\n    - addr: \"127.0.0.1:3\"\n");
        h.observe_scrape(0, scrape(0.0, 0.0), None);
        h.observe_scrape(0, scrape(800.0, 6.0), None);
        assert_eq!(h.loads()[1].prefill_spread, UNMEASURED_RATE_SPREAD);
        // Counters not paired: the fit may read high until the window fills.
        let g = fleet("    - addr: \"127.0.0.1:2\"\n");
        let unpaired = |tokens: f64, seconds: f64, requests: f64| EngineStats {
            prefill: Some(PrefillCounters {
                tokens,
                seconds,
                requests: Some(requests),
                paired: false,
            }),
            ..EngineStats::default()
        };
        g.observe_scrape(0, unpaired(0.0, 0.0, 0.0), None);
        for k in 1..=4 {
            let k = f64::from(k);
            g.observe_scrape(0, unpaired(2_000.0 * k, k, k), None);
        }
        assert_eq!(g.loads()[0].prefill_spread, 1.25, "a fit over 4 intervals");
    }
}
