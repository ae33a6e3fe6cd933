//! Prefill/decode disaggregation, decided per request from the cost model rather than a token
//! threshold: serve the request whole on the decode server placement chose, or prefill it on
//! a prefill server and have the decode server read the KV cache from there.
//!
//! For the decode server `d` (chosen by kv_aware among the backends that decode: its prefix,
//! its load, the stall its prefill would put on the streams there), a request of `P` prompt
//! tokens with `m(b)` of them cached on backend `b`:
//!
//! ```text
//! stall(b, n) = decode_stall_weight * decoding(b) * max(0, n / rate(b) - step(b))
//! whole       = est_ttft(d, P - m(d)) + stall(d, P - m(d))
//! split(p)    = est_ttft(p, P - m(p)) + stall(p, P - m(p))
//!               + transfer(P - m(d)) + slot_wait(d) + step(d)
//!               + duplicate_prefill_weight * max(0, m(d) - m(p)) / rate(p)
//! transfer(n) = n * kv_bytes_per_token / bandwidth + base
//! ```
//!
//! A stall is priced beyond one decode step: a stream's tokens already come a step apart, and
//! an engine that chunks its prefills mixes a few hundred prompt tokens into most steps, so a
//! prefill shorter than a step at most doubles one gap, which the stream's inter-token tail
//! does not show (unified sharegpt: ITL p99 10.1 ms with every turn prefilled beside the
//! streams). Priced whole at par, a chat's 170-token turn beside ten streams cost 70 stream-ms
//! and went to a prefill server, for a first token twice as late; a 30k-token prompt's 1.2 s
//! stall is still priced nearly whole.
//!
//! The last term is the work a split throws away: the prefill server computes the prefix the
//! decode server already holds (and will not read), and other requests queue behind it; kv_aware
//! prices a copy of a prefix held elsewhere the same way.
//!
//! Each path's TTFT carries a learned bias ([`Bias`]): how much later (or sooner) than
//! predicted the first tokens of requests served that way came. A split pays the two legs'
//! own round trips and the decode server's admission after its read, which the model does
//! not price; a whole request's prediction is pessimistic where the queue it counts drains
//! faster than priced. Compared raw, a split that saves a few milliseconds would be paid for
//! with more.
//!
//! The request is split on the prefill server with the lowest `split(p)` when that is below
//! `whole`, or whatever the costs when it must be (`decision: always`, or a decode server that
//! takes nothing whole: SGLang's). A follow-up turn whose history sits on its decode server has little left to
//! compute there, so it stays whole; a long cold prompt beside busy streams goes to a prefill
//! server, and only the blocks the decode server lacks are moved.

use super::kv_aware::est_ttft_s;
use super::snapshot::{BackendLoad, Snapshot};

/// What moving KV cache from a prefill to a decode server costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transfer {
    pub bytes_per_token: f64,
    pub bytes_per_s: f64,
    pub base_s: f64,
}

impl Transfer {
    pub fn seconds(&self, tokens: u64) -> f64 {
        self.base_s + tokens as f64 * self.bytes_per_token / self.bytes_per_s.max(1.0)
    }
}

/// The decision and the figures it was made from (decision log, `/debug/backends`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdChoice {
    /// The prefill server, when the request is split.
    pub prefill: Option<usize>,
    /// The cost of serving it whole on the decode server, seconds.
    pub whole_s: f64,
    /// Its predicted TTFT served whole (the cost without the stall), as the cost model
    /// prices it before the learned bias: what a whole request's first token is checked
    /// against.
    pub whole_ttft_s: f64,
    /// The cost of the best split, when any prefill server could take it.
    pub split_s: Option<f64>,
    /// The best split's predicted TTFT (its cost without the stall on the prefill server's
    /// streams), before the learned bias: what the first token is checked against.
    pub split_ttft_s: Option<f64>,
    /// The tokens the best split's prefill server computes (those it lacks).
    pub prefill_tokens: u64,
    /// The best split's KV transfer time, seconds.
    pub transfer_s: f64,
    /// The tokens the transfer moves (those the decode server lacks).
    pub transfer_tokens: u64,
    /// The learned biases the costs carry.
    pub bias: Bias,
}

/// The stall a prefill of `tokens` puts on the streams decoding on `b` beyond their own step,
/// in seconds of cost.
fn stall_s(b: &BackendLoad, tokens: u64, weight: f64) -> f64 {
    let beyond = tokens as f64 / b.prefill_rate.max(1.0) - b.decode_step_s;
    weight * b.decoding as f64 * beyond.max(0.0)
}

/// How far the first tokens of whole and of split requests have come from their predictions,
/// seconds (positive: later), learned: each path is judged by what it has shown, so neither is
/// chosen for the other's optimism.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Bias {
    pub whole_s: f64,
    pub split_s: f64,
}

/// What the decision weighs besides the fleet: the model's terms and whether a split is
/// required.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitTerms {
    pub decode_stall_weight: f64,
    pub duplicate_prefill_weight: f64,
    pub transfer: Transfer,
    pub bias: Bias,
    /// Split on the best prefill server whatever the costs (still whole when none can).
    pub must_split: bool,
}

/// Split or serve whole the request of `prompt` tokens placed on decode server `d`;
/// `prefill_ok(p)`: `p` may prefill it (its role, health, cap, not `d`).
pub fn decide(
    snap: &Snapshot,
    d: usize,
    prompt: u64,
    terms: &SplitTerms,
    prefill_ok: &dyn Fn(usize) -> bool,
) -> PdChoice {
    let (decode_stall_weight, transfer, bias) =
        (terms.decode_stall_weight, &terms.transfer, terms.bias);
    let matched = |i: usize| snap.matched.get(i).copied().unwrap_or(0).min(prompt);
    let dec = &snap.backends[d];
    let local = prompt - matched(d);
    let whole_ttft_s = est_ttft_s(dec, local);
    let whole_s = (whole_ttft_s + bias.whole_s).max(0.0) + stall_s(dec, local, decode_stall_weight);
    let transfer_s = transfer.seconds(local);
    // Once the KV is there, the decode server still admits the request and runs a step.
    let after_s = transfer_s + dec.slot_wait_s + dec.decode_step_s;
    let best = (0..snap.backends.len())
        .filter(|&p| p != d && prefill_ok(p))
        .map(|p| {
            let b = &snap.backends[p];
            let n = prompt - matched(p);
            let ttft = est_ttft_s(b, n) + after_s;
            let dup = matched(d).saturating_sub(matched(p)) as f64 / b.prefill_rate.max(1.0);
            let cost = (ttft + bias.split_s).max(0.0)
                + stall_s(b, n, decode_stall_weight)
                + terms.duplicate_prefill_weight * dup;
            (p, cost, ttft, n)
        })
        // Ties go to the lower index: the decision is deterministic.
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    PdChoice {
        prefill: best
            .filter(|b| terms.must_split || b.1 < whole_s)
            .map(|b| b.0),
        whole_s,
        whole_ttft_s,
        split_s: best.map(|b| b.1),
        split_ttft_s: best.map(|b| b.2),
        prefill_tokens: best.map_or(0, |b| b.3),
        transfer_s,
        transfer_tokens: local,
        bias,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Ring;

    const TRANSFER: Transfer = Transfer {
        // Llama 3 8B in bf16 over 25 GB/s: 5.2 us a token.
        bytes_per_token: 131_072.0,
        bytes_per_s: 25e9,
        base_s: 0.002,
    };

    fn ring_of(backends: usize) -> Ring {
        let addrs: Vec<(std::net::SocketAddr, u32)> = (0..backends)
            .map(|i| (([127, 0, 0, 1], 9100 + i as u16).into(), 1))
            .collect();
        Ring::new(&addrs)
    }

    fn decide_on(loads: &[BackendLoad], matched: &[u64], prompt: u64) -> PdChoice {
        let ring = ring_of(loads.len());
        let snap = Snapshot {
            backends: loads,
            ring: &ring,
            matched,
            later_turns: 1.0,
        };
        // Backend 0 decodes; the others prefill.
        decide(&snap, 0, prompt, &terms(1.0, Bias::default()), &|p| p != 0)
    }

    fn terms(decode_stall_weight: f64, bias: Bias) -> SplitTerms {
        SplitTerms {
            decode_stall_weight,
            duplicate_prefill_weight: 1.0,
            transfer: TRANSFER,
            bias,
            must_split: false,
        }
    }

    fn busy_decoder(streams: u64) -> BackendLoad {
        BackendLoad {
            decoding: streams,
            inflight: streams,
            decode_step_s: 0.02,
            ..BackendLoad::idle()
        }
    }

    #[test]
    fn a_long_cold_prompt_beside_busy_streams_is_prefilled_elsewhere() {
        let loads = [busy_decoder(32), BackendLoad::idle(), BackendLoad::idle()];
        let c = decide_on(&loads, &[0, 0, 0], 30_000);
        assert_eq!(c.prefill, Some(1));
        // Whole: 1.2 s of prefill plus its stall on 32 streams.
        assert!(c.whole_s > 30.0, "{c:?}");
        let split = c.split_s.unwrap();
        assert!(split > 1.2 && split < 1.5, "{c:?}");
        assert_eq!(c.transfer_tokens, 30_000);
        assert!((c.transfer_s - (0.002 + 30_000.0 * 131_072.0 / 25e9)).abs() < 1e-9);
    }

    #[test]
    fn a_follow_up_whose_history_the_decoder_holds_stays_whole() {
        let loads = [busy_decoder(32), BackendLoad::idle()];
        // 29,900 of 30,000 tokens cached on the decoder: 100 to compute there.
        let c = decide_on(&loads, &[29_900, 0], 30_000);
        assert_eq!(c.prefill, None, "{c:?}");
        assert_eq!(c.transfer_tokens, 100);
        assert!(c.split_s.unwrap() > c.whole_s);
    }

    /// A long chat's next turn beside thirty streams: 1,000 new tokens on the decoder that
    /// holds the other 9,000. Served there, it stalls the streams 600 stream-ms beyond their
    /// step; split, it waits ~390 ms longer for its first token on a cold prefill server, so
    /// the split wins until it is charged for recomputing the 9,000 tokens the decoder holds
    /// and would not read.
    #[test]
    fn a_split_pays_for_the_prefix_the_prefill_server_recomputes() {
        let loads = [busy_decoder(30), BackendLoad::idle()];
        let ring = ring_of(2);
        let snap = Snapshot {
            backends: &loads,
            ring: &ring,
            matched: &[9_000, 0],
            later_turns: 1.0,
        };
        let free = SplitTerms {
            duplicate_prefill_weight: 0.0,
            ..terms(1.0, Bias::default())
        };
        let c = decide(&snap, 0, 10_000, &free, &|p| p != 0);
        assert_eq!(c.prefill, Some(1), "{c:?}");
        let c = decide(&snap, 0, 10_000, &terms(1.0, Bias::default()), &|p| p != 0);
        assert_eq!(c.prefill, None, "{c:?}");
        assert_eq!((c.prefill_tokens, c.transfer_tokens), (10_000, 1_000));
        // The same prompt cold on both: nothing is recomputed, and the split goes.
        let snap = Snapshot {
            matched: &[0, 0],
            ..snap
        };
        let c = decide(&snap, 0, 10_000, &terms(1.0, Bias::default()), &|p| p != 0);
        assert_eq!(c.prefill, Some(1), "{c:?}");
    }

    /// A chat's turn of 170 new tokens beside ten streams whose engine steps every 20 ms: its
    /// prefill (7 ms at 25,000 tokens/s) fits in one step, so the streams' gaps stay what
    /// they are and the turn is served where its history is, even at par; 1,000 new tokens
    /// (40 ms) stall each stream 20 ms beyond its step and go.
    #[test]
    fn a_prefill_within_one_decode_step_stalls_nothing() {
        let loads = [busy_decoder(10), BackendLoad::idle()];
        let ring = ring_of(2);
        let snap = Snapshot {
            backends: &loads,
            ring: &ring,
            matched: &[1_830, 1_700],
            later_turns: 1.0,
        };
        let c = decide(&snap, 0, 2_000, &terms(1.0, Bias::default()), &|p| p != 0);
        assert_eq!(c.prefill, None, "{c:?}");
        assert!((c.whole_s - c.whole_ttft_s).abs() < 1e-12, "{c:?}");
        let snap = Snapshot {
            matched: &[1_000, 1_000],
            ..snap
        };
        let c = decide(&snap, 0, 2_000, &terms(1.0, Bias::default()), &|p| p != 0);
        assert_eq!(c.prefill, Some(1), "{c:?}");
        assert!(
            (c.whole_s - c.whole_ttft_s - 10.0 * 0.02).abs() < 1e-9,
            "{c:?}"
        );
    }

    #[test]
    fn an_idle_decoder_serves_short_prompts_whole_whatever_the_prefill_servers() {
        let loads = [BackendLoad::idle(), BackendLoad::idle()];
        let c = decide_on(&loads, &[0, 0], 200);
        assert_eq!(c.prefill, None, "{c:?}");
    }

    #[test]
    fn only_the_blocks_the_decoder_lacks_move_and_the_prefill_server_with_the_prefix_wins() {
        let mut loads = [busy_decoder(16), BackendLoad::idle(), BackendLoad::idle()];
        // Backend 2 holds the shared 8k system prompt; backend 1 is idle but cold.
        loads[2].queued_prefill = 2_000;
        let c = decide_on(&loads, &[4_000, 0, 8_000], 12_000);
        assert_eq!(c.prefill, Some(2), "{c:?}");
        assert_eq!(c.transfer_tokens, 8_000);
    }

    #[test]
    fn a_required_split_goes_to_the_best_prefill_server_whatever_the_costs() {
        let loads = [BackendLoad::idle(), busy_decoder(4), BackendLoad::idle()];
        let ring = ring_of(3);
        let snap = Snapshot {
            backends: &loads,
            ring: &ring,
            matched: &[0, 0, 0],
            later_turns: 1.0,
        };
        let must = SplitTerms {
            must_split: true,
            ..terms(0.1, Bias::default())
        };
        // A short prompt on an idle decoder: whole by cost, split when required, on the idle
        // prefill server.
        let by_cost = decide(&snap, 0, 200, &terms(0.1, Bias::default()), &|p| p != 0);
        assert_eq!(by_cost.prefill, None, "{by_cost:?}");
        let c = decide(&snap, 0, 200, &must, &|p| p != 0);
        assert_eq!(c.prefill, Some(2), "{c:?}");
        assert!(c.split_s.unwrap() > c.whole_s, "{c:?}");
        // No prefill server can: still whole (the caller knows whether it may be).
        let none = decide(&snap, 0, 200, &must, &|_| false);
        assert_eq!(none.prefill, None);
    }

    /// The mooncake case (docs/results/disaggregation.md): a cold 24k-token prompt beside two
    /// streams, an idle prefill server, splits that showed their first tokens 200 ms later
    /// than predicted. At a unified fleet's weight (0.1) the stall (0.19 s) is less than the
    /// split's transfer and bias (0.35 s), so the prompt stalls both streams for a second;
    /// counted at par with TTFT, it goes to the prefill server.
    #[test]
    fn a_stream_stalled_second_at_par_sends_a_long_prompt_beside_two_streams_away() {
        let loads = [busy_decoder(2), BackendLoad::idle()];
        let ring = ring_of(2);
        let snap = Snapshot {
            backends: &loads,
            ring: &ring,
            matched: &[0, 0],
            later_turns: 1.0,
        };
        let late = Bias {
            whole_s: 0.0,
            split_s: 0.2,
        };
        let c = decide(&snap, 0, 24_000, &terms(0.1, late), &|p| p != 0);
        assert_eq!(c.prefill, None, "{c:?}");
        let c = decide(&snap, 0, 24_000, &terms(1.0, late), &|p| p != 0);
        assert_eq!(c.prefill, Some(1), "{c:?}");
        assert!(c.whole_s > 2.0 * c.whole_ttft_s, "{c:?}");
    }

    #[test]
    fn without_a_prefill_server_free_the_request_is_served_whole() {
        let loads = [busy_decoder(32)];
        let c = decide_on(&loads, &[0], 30_000);
        assert_eq!((c.prefill, c.split_s), (None, None));
    }

    #[test]
    fn learned_biases_keep_a_short_prefill_beside_busy_streams_whole() {
        // 1,000 tokens to compute beside 10 streams at a unified fleet's stall weight (0.1):
        // 40 ms of prefill, 20 ms of it beyond the streams' step, 20 ms of stall.
        let loads = [busy_decoder(10), BackendLoad::idle()];
        let ring = ring_of(2);
        let snap = Snapshot {
            backends: &loads,
            ring: &ring,
            matched: &[0, 0],
            later_turns: 1.0,
        };
        let c = decide(&snap, 0, 1_000, &terms(0.1, Bias::default()), &|p| p != 0);
        assert_eq!(
            c.prefill,
            Some(1),
            "free of overhead, the split saves the stall: {c:?}"
        );
        // Split requests showed their first tokens 30 ms later than predicted.
        let slow = Bias {
            whole_s: 0.0,
            split_s: 0.030,
        };
        let c = decide(&snap, 0, 1_000, &terms(0.1, slow), &|p| p != 0);
        assert_eq!(c.prefill, None, "{c:?}");
        // Whole requests 15 ms sooner than predicted: the same.
        let quick = Bias {
            whole_s: -0.015,
            split_s: 0.0,
        };
        let c = decide(&snap, 0, 1_000, &terms(0.1, quick), &|p| p != 0);
        assert_eq!(c.prefill, None, "{c:?}");
        // A long prompt still goes: the overhead is small beside its stall.
        let c = decide(&snap, 0, 20_000, &terms(0.1, slow), &|p| p != 0);
        assert_eq!(c.prefill, Some(1), "{c:?}");
        assert_eq!(c.prefill_tokens, 20_000);
        assert!(c.split_ttft_s.unwrap() < c.split_s.unwrap() + 1e-9);
    }
}
