//! `noisy_neighbor`: one tenant floods the fleet beside four steady ones, issue 39's test of
//! a shared fleet. Tenant `flood` sends 8-30k-token prompts (16 output tokens) with ten times
//! the closed-loop workers of each of `steady-0`..`steady-3`, which send ~500-token chat
//! (64 output tokens). Every prompt is unique from its first block on, so nothing is cached:
//! the flood's load is pure prefill, and no placement can make it cheaper.
//!
//! Sized by `--conversations W` as the other closed-loop workloads are: each steady tenant
//! gets W / 14 workers (at least 1), the flood ten times that. With one worker a steady tenant
//! waits for each answer before its next request, so it is never backlogged (see
//! `tenants::fairness`): the plain noisy neighbor. With W >= 28 every tenant keeps several
//! requests outstanding: all backlogged, where Jain's index is measured. Options add two
//! priority bands (`--steady-priority`), deadlines (`--steady-slo-ms`) and sheddable work
//! (`--sheddable`: that share of the flood's requests at priority -1).
//!
//! Text is filler sized in the simulator's stand-in tokens (4 bytes a token), generated when a
//! worker asks for it, the same bytes every run of one `--seed`.

use std::sync::Arc;

use super::sharegpt::{Conversation, Turn};
use super::{Conversations, Pool};
use crate::replay::record::Tenancy;
use crate::replay::rng::{filler, mix, Rng};

pub const FLOOD: &str = "flood";
pub const STEADY_TENANTS: u32 = 4;
/// The flood's workers per steady tenant's.
pub const FLOOD_FACTOR: u32 = 10;
/// The flood's prompt tokens, uniform in this range.
pub const FLOOD_TOKENS: (u64, u64) = (8_000, 30_000);
pub const FLOOD_OUTPUT: u64 = 16;
pub const STEADY_TOKENS: u64 = 500;
pub const STEADY_OUTPUT: u64 = 64;
/// The simulator's stand-in tokenizer counts ceil(bytes / 4).
const BYTES_PER_TOKEN: u64 = 4;

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NoisyShape {
    /// Closed-loop workers in all (`--conversations`).
    pub workers: u32,
    /// The steady tenants' `x-kvroute-priority` (none: the default band, 0).
    pub steady_priority: Option<i32>,
    /// The steady tenants' `x-slo-ttft-ms`.
    pub steady_slo_ms: Option<u64>,
    /// The share of the flood's requests sent at priority -1 (sheddable), in [0, 1].
    pub sheddable: f64,
    /// The steady tenants alone: no flood (the baseline).
    pub solo: bool,
    /// Every tenant sends the flood's prompts.
    pub all_flood: bool,
    pub seed: u64,
}

impl NoisyShape {
    pub fn steady_workers(&self) -> u32 {
        (self.workers / (FLOOD_FACTOR + STEADY_TENANTS)).max(1)
    }

    pub fn flood_workers(&self) -> u32 {
        if self.solo {
            return 0;
        }
        self.steady_workers() * FLOOD_FACTOR
    }

    /// The tenants, flood first.
    pub fn tenants() -> Vec<String> {
        std::iter::once(FLOOD.to_owned())
            .chain((0..STEADY_TENANTS).map(|k| format!("steady-{k}")))
            .collect()
    }

    /// One pool of workers per tenant, all running at once.
    pub fn pools(&self) -> Vec<Pool> {
        Self::tenants()
            .into_iter()
            .enumerate()
            .map(|(k, name)| {
                let flood = k == 0;
                let tenancy = Tenancy {
                    tenant: Some(name.clone()),
                    priority: self.steady_priority.filter(|_| !flood),
                    slo_ttft_ms: self.steady_slo_ms.filter(|_| !flood),
                };
                let source = TenantSource {
                    name,
                    long: flood || self.all_flood,
                    tenancy,
                    sheddable: if flood { self.sheddable } else { 0.0 },
                    seed: mix(self.seed ^ ((k as u64 + 1) << 40)),
                };
                Pool {
                    convs: Arc::new(source),
                    workers: if flood {
                        self.flood_workers()
                    } else {
                        self.steady_workers()
                    },
                }
            })
            .filter(|p| p.workers > 0)
            .collect()
    }
}

/// One tenant's endless stream of single-turn conversations.
struct TenantSource {
    name: String,
    /// Sends the flood's long prompts.
    long: bool,
    tenancy: Tenancy,
    sheddable: f64,
    seed: u64,
}

impl Conversations for TenantSource {
    fn get(&self, i: usize) -> Option<Conversation> {
        let mut rng = Rng::new(mix(self.seed ^ i as u64));
        let (tokens, output) = if self.long {
            let (lo, hi) = FLOOD_TOKENS;
            (lo + rng.below(hi - lo + 1), FLOOD_OUTPUT)
        } else {
            (STEADY_TOKENS, STEADY_OUTPUT)
        };
        // The tag leads, so the first cache block already differs from every other prompt's.
        let tag = format!("{} request {i}: ", self.name);
        let bytes = (tokens * BYTES_PER_TOKEN) as usize;
        let text = tag.clone() + &filler(rng.next_u64(), bytes.saturating_sub(tag.len()));
        let mut tenancy = self.tenancy.clone();
        // Exactly the share over every prefix of the stream (to one request), spread evenly.
        let (s, n) = (self.sheddable, i as f64);
        if ((n + 1.0) * s).floor() > (n * s).floor() {
            tenancy.priority = Some(-1);
        }
        Some(Conversation {
            session_id: format!("{}-{i}", self.name),
            turns: vec![Turn {
                text,
                output_length: output,
                ..Turn::default()
            }],
            model: None,
            system: None,
            agent: Default::default(),
            tenancy,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::workloads::sharegpt::Chat;

    fn shape(workers: u32) -> NoisyShape {
        NoisyShape {
            workers,
            steady_priority: None,
            steady_slo_ms: None,
            sheddable: 0.0,
            solo: false,
            all_flood: false,
            seed: 1,
        }
    }

    #[test]
    fn the_flood_has_ten_times_each_steady_tenants_workers() {
        let pools = shape(14).pools();
        let workers: Vec<u32> = pools.iter().map(|p| p.workers).collect();
        assert_eq!(workers, [10, 1, 1, 1, 1]);
        // All backlogged: several workers each, the flood still ten times as many.
        let workers: Vec<u32> = shape(56).pools().iter().map(|p| p.workers).collect();
        assert_eq!(workers, [40, 4, 4, 4, 4]);
        // Fewer workers than tenants still gives every tenant one.
        assert_eq!(shape(3).pools()[1].workers, 1);
        // Solo: the same steady tenants, no flood.
        let solo = NoisyShape {
            solo: true,
            ..shape(14)
        };
        let workers: Vec<u32> = solo.pools().iter().map(|p| p.workers).collect();
        assert_eq!(workers, [1, 1, 1, 1]);
        // All flood: every tenant's prompts are the flood's, the worker counts unchanged.
        let all = NoisyShape {
            all_flood: true,
            ..shape(56)
        };
        let pools = all.pools();
        assert_eq!(pools[1].workers, 4);
        let steady = pools[1].convs.get(3).unwrap();
        assert!(steady.turns[0].text.len() as u64 / BYTES_PER_TOKEN >= 8_000);
        assert_eq!(steady.turns[0].output_length, FLOOD_OUTPUT);
        let tenants: Vec<Option<String>> = pools
            .iter()
            .map(|p| p.convs.get(0).unwrap().tenancy.tenant)
            .collect();
        assert_eq!(
            tenants,
            ["flood", "steady-0", "steady-1", "steady-2", "steady-3"].map(|t| Some(t.into()))
        );
    }

    #[test]
    fn flood_prompts_are_long_unique_and_short_answered_steady_ones_short() {
        let pools = shape(14).pools();
        let flood: Vec<Conversation> = (0..200).map(|i| pools[0].convs.get(i).unwrap()).collect();
        let tokens: Vec<u64> = flood
            .iter()
            .map(|c| c.turns[0].text.len() as u64 / BYTES_PER_TOKEN)
            .collect();
        assert!(
            tokens.iter().all(|t| (8_000..=30_000).contains(t)),
            "{tokens:?}"
        );
        // Spread over the range, not bunched at one size.
        assert!(tokens.iter().any(|&t| t < 12_000) && tokens.iter().any(|&t| t > 26_000));
        assert!(flood
            .iter()
            .all(|c| c.turns.len() == 1 && c.turns[0].output_length == 16));
        // No two prompts share their first 64 bytes (one cache block of 16 tokens).
        let mut heads: Vec<&str> = flood.iter().map(|c| &c.turns[0].text[..64]).collect();
        heads.sort_unstable();
        heads.dedup();
        assert_eq!(heads.len(), 200);
        let steady = pools[1].convs.get(7).unwrap();
        assert_eq!(steady.turns[0].text.len() as u64, 500 * BYTES_PER_TOKEN);
        assert_eq!(steady.turns[0].output_length, 64);
        assert_ne!(
            steady.turns[0].text[..64],
            pools[2].convs.get(7).unwrap().turns[0].text[..64]
        );
        // The same seed sends the same bytes.
        assert_eq!(
            shape(14).pools()[0].convs.get(5).unwrap().turns[0].text,
            flood[5].turns[0].text
        );
    }

    #[test]
    fn bands_deadlines_and_sheddable_work_go_on_the_requests() {
        let s = NoisyShape {
            steady_priority: Some(1),
            steady_slo_ms: Some(800),
            sheddable: 0.25,
            ..shape(14)
        };
        let pools = s.pools();
        // A steady request carries the band and the deadline as headers.
        let mut chat = Chat::new(pools[3].convs.get(0).unwrap(), 512);
        let req = chat.next_request().unwrap();
        assert_eq!(req.max_tokens, 64);
        assert_eq!(
            req.tenancy.headers(1.0),
            [
                ("x-tenant-id", "steady-2".to_owned()),
                ("x-kvroute-priority", "1".to_owned()),
                ("x-slo-ttft-ms", "800".to_owned())
            ]
        );
        // The flood has no deadline, a quarter of its requests sheddable, the rest band 0.
        let flood: Vec<Tenancy> = (0..100)
            .map(|i| pools[0].convs.get(i).unwrap().tenancy)
            .collect();
        assert!(flood.iter().all(|t| t.slo_ttft_ms.is_none()));
        let shed = flood.iter().filter(|t| t.priority == Some(-1)).count();
        assert_eq!(shed, 25);
        assert!(flood[..4].iter().filter(|t| t.priority == Some(-1)).count() == 1);
        assert!(flood.iter().all(|t| matches!(t.priority, None | Some(-1))));
        let plain = shape(14).pools()[0].convs.get(3).unwrap().tenancy;
        assert_eq!(plain.headers(2.0), [("x-tenant-id", "flood".to_owned())]);
    }
}
