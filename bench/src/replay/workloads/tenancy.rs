//! `--tenants`: shares any workload's conversations (open-loop and single-turn workloads:
//! requests) among tenants, each with an optional priority and TTFT deadline, so a
//! multi-tenant load needs no special workload file.
//!
//! A spec is a comma-separated list of `NAME[/weight=W][/priority=P][/slo=MS]`, e.g.
//! `gold/priority=1/slo=800,bronze/weight=3/priority=-1`. Item i (the i-th conversation a
//! pool hands out, the i-th request of a queue or trace) goes to the tenant at i in a smooth
//! weighted round robin: every window of Σweight items holds each tenant exactly its weight,
//! interleaved, so a short run still sees the shares. What a workload file says of an item
//! wins over the spec.

use std::sync::Arc;

use super::sharegpt::Conversation;
use super::{Conversations, OpenLoop, Scheduled};
use crate::replay::record::{ChatRequest, Tenancy};

/// Largest weight of one tenant: the round robin's cycle is Σweight items long.
const MAX_WEIGHT: u32 = 1000;

#[derive(Debug, Clone, PartialEq)]
pub struct TenantMix {
    /// The spec as given, for the report and for `compare` to pass on.
    pub spec: String,
    tenants: Vec<Tenancy>,
    /// One cycle of the round robin: an index into `tenants` per item.
    cycle: Vec<usize>,
}

impl TenantMix {
    pub fn parse(spec: &str) -> Result<TenantMix, String> {
        let mut tenants: Vec<Tenancy> = Vec::new();
        let mut weights = Vec::new();
        for entry in spec.split(',').map(str::trim) {
            let bad = |why: String| format!("--tenants entry {entry:?}: {why}");
            let mut parts = entry.split('/');
            let name = parts.next().unwrap_or_default();
            // kvroute accepts 1-64 visible ASCII characters; `,` and `/` separate the spec.
            let name_ok = (1..=64).contains(&name.len())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && b != b',' && b != b'/');
            if !name_ok {
                return Err(bad("a tenant is 1-64 visible ASCII characters".into()));
            }
            if tenants.iter().any(|t| t.tenant.as_deref() == Some(name)) {
                return Err(bad(format!("{name:?} listed twice")));
            }
            let mut t = Tenancy {
                tenant: Some(name.to_owned()),
                ..Tenancy::default()
            };
            let mut weight = None;
            for option in parts {
                let (key, value) = option.split_once('=').unwrap_or((option, ""));
                let unset = match key {
                    "weight" => weight.is_none(),
                    "priority" => t.priority.is_none(),
                    "slo" => t.slo_ttft_ms.is_none(),
                    _ => {
                        return Err(bad(format!(
                            "unknown option {option:?} (known: weight=W, priority=P, slo=MS)"
                        )))
                    }
                };
                if !unset {
                    return Err(bad(format!("option {key} given twice")));
                }
                let number = || bad(format!("{option:?}: not a valid number"));
                match key {
                    "weight" => {
                        let w = value.parse().ok().filter(|w| (1..=MAX_WEIGHT).contains(w));
                        weight = Some(w.ok_or_else(number)?);
                    }
                    "priority" => t.priority = Some(value.parse().map_err(|_| number())?),
                    _ => {
                        let ms = value.parse().ok().filter(|ms: &u64| *ms > 0);
                        t.slo_ttft_ms = Some(ms.ok_or_else(number)?);
                    }
                }
            }
            tenants.push(t);
            weights.push(weight.unwrap_or(1));
        }
        Ok(TenantMix {
            spec: spec.to_owned(),
            tenants,
            cycle: smooth_round_robin(&weights),
        })
    }

    /// The tenancy of item `i`.
    pub fn get(&self, i: usize) -> &Tenancy {
        &self.tenants[self.cycle[i % self.cycle.len()]]
    }

    pub fn names(&self) -> Vec<String> {
        self.tenants
            .iter()
            .filter_map(|t| t.tenant.clone())
            .collect()
    }

    /// `reqs` with the mix filled in where they carry no tenancy of their own.
    pub fn assign(&self, reqs: &mut [ChatRequest]) {
        for (i, r) in reqs.iter_mut().enumerate() {
            r.tenancy = std::mem::take(&mut r.tenancy).or(self.get(i));
        }
    }
}

/// nginx's smooth weighted round robin over one cycle: each step every tenant gains its
/// weight and the richest is picked and pays the total, so picks interleave (`a a b` for
/// weights 2 and 1 is `a b a`) and each tenant is picked exactly its weight per cycle.
fn smooth_round_robin(weights: &[u32]) -> Vec<usize> {
    let total: i64 = weights.iter().map(|&w| i64::from(w)).sum();
    let mut current = vec![0i64; weights.len()];
    (0..total)
        .map(|_| {
            for (c, &w) in current.iter_mut().zip(weights) {
                *c += i64::from(w);
            }
            let mut best = 0;
            for (i, c) in current.iter().enumerate() {
                if *c > current[best] {
                    best = i;
                }
            }
            current[best] -= total;
            best
        })
        .collect()
}

/// A pool's conversations with the mix filled in.
pub struct MixedConversations {
    pub inner: Arc<dyn Conversations>,
    pub mix: TenantMix,
}

impl Conversations for MixedConversations {
    fn get(&self, i: usize) -> Option<Conversation> {
        let mut c = self.inner.get(i)?;
        c.tenancy = std::mem::take(&mut c.tenancy).or(self.mix.get(i));
        Some(c)
    }
}

/// An open-loop schedule with the mix filled in, request by request.
pub struct MixedSchedule {
    pub inner: Box<dyn OpenLoop>,
    pub mix: TenantMix,
    pub next: usize,
}

impl OpenLoop for MixedSchedule {
    fn next_request(&mut self) -> Option<Scheduled> {
        let mut s = self.inner.next_request()?;
        s.req.tenancy = std::mem::take(&mut s.req.tenancy).or(self.mix.get(self.next));
        self.next += 1;
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::workloads::sharegpt::Turn;

    #[test]
    fn shares_follow_the_weights_interleaved() {
        let mix = TenantMix::parse("gold/priority=1/slo=800, bronze/weight=3/priority=-1").unwrap();
        assert_eq!(mix.names(), ["gold", "bronze"]);
        let who: Vec<&str> = (0..8)
            .map(|i| mix.get(i).tenant.as_deref().unwrap())
            .collect();
        // Each cycle of 4 holds gold once and bronze three times, gold not bunched.
        assert_eq!(
            who,
            ["bronze", "gold", "bronze", "bronze", "bronze", "gold", "bronze", "bronze"]
        );
        let gold = mix.get(1);
        assert_eq!((gold.priority, gold.slo_ttft_ms), (Some(1), Some(800)));
        assert_eq!(
            (mix.get(0).priority, mix.get(0).slo_ttft_ms),
            (Some(-1), None)
        );
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        for (spec, says) in [
            ("", "1-64 visible"),
            ("a,a", "listed twice"),
            ("a/weight=0", "not a valid number"),
            ("a/weight=1001", "not a valid number"),
            ("a/priority=high", "not a valid number"),
            ("a/slo=0", "not a valid number"),
            ("a/slo=1/slo=2", "given twice"),
            ("a/share=2", "unknown option"),
            ("a b", "1-64 visible"),
        ] {
            let err = TenantMix::parse(spec).unwrap_err();
            assert!(err.contains(says), "{spec:?}: {err}");
        }
    }

    #[test]
    fn a_workloads_own_tenancy_wins_over_the_mix() {
        let mix = TenantMix::parse("a/priority=2,b").unwrap();
        let conv = |tenant: Option<&str>| Conversation {
            session_id: "s".into(),
            turns: vec![Turn {
                text: "hi".into(),
                output_length: 1,
                ..Turn::default()
            }],
            model: None,
            system: None,
            agent: Default::default(),
            tenancy: Tenancy {
                tenant: tenant.map(str::to_owned),
                ..Tenancy::default()
            },
        };
        let pool = MixedConversations {
            inner: Arc::new(vec![conv(None), conv(None), conv(Some("own"))]),
            mix,
        };
        let got: Vec<Tenancy> = (0..3).map(|i| pool.get(i).unwrap().tenancy).collect();
        assert_eq!(got[0].tenant.as_deref(), Some("a"));
        assert_eq!(got[1].tenant.as_deref(), Some("b"));
        // Its own tenant stays; the unset priority comes from the mix's item 2 (tenant a).
        assert_eq!(
            (got[2].tenant.as_deref(), got[2].priority),
            (Some("own"), Some(2))
        );
        assert!(pool.get(3).is_none());
    }
}
