//! llm-d's shared-prefix ladder: G groups share a long system prompt, each with U users asking
//! fresh questions; Poisson arrivals step through increasing rates to past saturation.

use std::collections::HashSet;
use std::time::Duration;

use super::mooncake::BYTES_PER_TOKEN;
use super::{OpenLoop, Scheduled};
use crate::replay::record::{ChatRequest, Message};
use crate::replay::rng::{filler, mix, Rng};

#[derive(Debug, Clone, serde::Serialize)]
pub struct LadderConfig {
    pub groups: u32,
    pub users: u32,
    pub system_tokens: u64,
    pub question_tokens: u64,
    pub output_tokens: u32,
    /// Requests per second of wall time, one step each.
    pub rates: Vec<f64>,
    pub step_s: f64,
    pub seed: u64,
}

impl LadderConfig {
    pub fn total_s(&self) -> f64 {
        self.step_s * self.rates.len() as f64
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    /// Seconds from the run start.
    pub at_s: f64,
    pub step: usize,
    pub group: u32,
    pub user: u32,
}

/// All arrivals of the ladder, in time order; a function of the config (and seed) alone.
pub fn arrivals(cfg: &LadderConfig) -> Vec<Arrival> {
    let mut rng = Rng::new(mix(cfg.seed ^ 0x6c61_6464_6572));
    let mut out = Vec::new();
    for (step, &rate) in cfg.rates.iter().enumerate() {
        let begin = step as f64 * cfg.step_s;
        let end = begin + cfg.step_s;
        let mut t = begin + rng.exp(rate);
        while t < end {
            let group = rng.below(cfg.groups as u64) as u32;
            let user = rng.below(cfg.users as u64) as u32;
            out.push(Arrival {
                at_s: t,
                step,
                group,
                user,
            });
            t += rng.exp(rate);
        }
    }
    out
}

/// Group g's system prompt; independent of the seed so runs with different seeds share
/// prefixes the same way.
pub fn system_prompt(group: u32, tokens: u64) -> String {
    let head = format!("You are assistant number {group}. ");
    let body = filler(
        mix(0x5359_5354 ^ group as u64),
        (tokens * BYTES_PER_TOKEN) as usize,
    );
    let mut s = head + &body;
    s.truncate((tokens * BYTES_PER_TOKEN) as usize);
    s
}

pub struct LadderSchedule {
    cfg: LadderConfig,
    arrivals: Vec<Arrival>,
    next: usize,
    prompts: Vec<String>,
    seen_groups: HashSet<u32>,
}

impl LadderSchedule {
    pub fn new(cfg: LadderConfig) -> Self {
        let arrivals = arrivals(&cfg);
        let prompts = (0..cfg.groups)
            .map(|g| system_prompt(g, cfg.system_tokens))
            .collect();
        Self {
            cfg,
            arrivals,
            next: 0,
            prompts,
            seen_groups: HashSet::new(),
        }
    }
}

impl OpenLoop for LadderSchedule {
    fn next_request(&mut self) -> Option<Scheduled> {
        let a = *self.arrivals.get(self.next)?;
        let n = self.next as u64;
        self.next += 1;
        let question = format!(
            "User {} of group {} asks: {}",
            a.user,
            a.group,
            filler(
                mix(self.cfg.seed.wrapping_add(n) ^ 0x5155_4553),
                (self.cfg.question_tokens * BYTES_PER_TOKEN) as usize
            )
        );
        // Oracle in tokens: the system prompt hits once its group has been seen.
        let sys = self.cfg.system_tokens as f64;
        let hit = if self.seen_groups.insert(a.group) {
            0.0
        } else {
            sys
        };
        Some(Scheduled {
            at: Duration::from_secs_f64(a.at_s),
            req: ChatRequest {
                model: None,
                messages: vec![
                    Message::new("system", self.prompts[a.group as usize].clone()),
                    Message::new("user", question),
                ],
                max_tokens: self.cfg.output_tokens.max(1),
                session: Some(format!("group-{}-user-{}", a.group, a.user)),
                step: Some(a.step),
                turn: None,
                oracle_hit: hit,
                oracle_total: sys + self.cfg.question_tokens as f64,
                agent: Default::default(),
                tenancy: Default::default(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(seed: u64) -> LadderConfig {
        LadderConfig {
            groups: 4,
            users: 3,
            system_tokens: 100,
            question_tokens: 10,
            output_tokens: 5,
            rates: vec![5.0, 50.0],
            step_s: 10.0,
            seed,
        }
    }

    #[test]
    fn arrivals_are_deterministic_per_seed() {
        let a = arrivals(&cfg(1));
        assert_eq!(a, arrivals(&cfg(1)));
        assert_ne!(a, arrivals(&cfg(2)));
        assert!(a.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        let step0 = a.iter().filter(|x| x.step == 0).count() as f64;
        let step1 = a.iter().filter(|x| x.step == 1).count() as f64;
        // Expected 50 and 500; Poisson noise stays well inside these bounds.
        assert!((25.0..90.0).contains(&step0), "{step0}");
        assert!((400.0..600.0).contains(&step1), "{step1}");
        assert!(a.iter().all(|x| x.group < 4 && x.user < 3));
        assert!(a
            .iter()
            .filter(|x| x.step == 1)
            .all(|x| x.at_s >= 10.0 && x.at_s < 20.0));
    }

    #[test]
    fn requests_share_group_prompts_and_oracle_counts_first_miss() {
        let mut s = LadderSchedule::new(cfg(7));
        let all: Vec<Scheduled> = std::iter::from_fn(|| s.next_request()).collect();
        assert_eq!(system_prompt(2, 100).len(), 400);
        let misses = all.iter().filter(|x| x.req.oracle_hit == 0.0).count();
        assert_eq!(misses, 4);
        for x in &all {
            let sys = &x.req.messages[0].content;
            assert!(s.prompts.contains(sys));
        }
        assert_ne!(
            all[0].req.messages[1].content,
            all[1].req.messages[1].content
        );
    }
}
