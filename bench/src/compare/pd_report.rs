//! What disaggregation did in each `compare --pd` run: kvroute's decisions (split or whole,
//! from its `/metrics`) and the simulators' own P/D counters (`/debug/state`), above all the
//! KV blocks prefill servers still hold for a decode server when the run is over: stranded,
//! which a router that loses no leg leaves at 0.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::pd::Role;
use super::policy::{Member, PolicyRun};
use crate::replay::stats::Summary;

/// How long the simulators get, once the router has stopped, to free what the last legs
/// held (a decode leg cut at the end still notifies its prefill server).
const SETTLE: Duration = Duration::from_secs(2);

/// The simulators' gauges of what is still in the middle of a hand-over: prompts a prefill
/// server holds for a decode server, and with SGLang's protocol prefill legs waiting for
/// their decode server and decode requests waiting for, or reading, their prefill's KV. All
/// 0 once a run is over, unless a leg was lost.
const IN_FLIGHT: [&str; 4] = [
    "held_requests",
    "waiting_prefill_legs",
    "waiting_decodes",
    "transferring_decodes",
];

/// One run's P/D figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PdCounts {
    /// `unified N`, or `P prefill + D decode, PROTOCOL`.
    pub fleet: String,
    /// kvroute's `kvroute_pd_decisions_total`, by outcome (`split`, `whole`); empty for a peer,
    /// which splits every request, and for a unified fleet.
    pub decisions: BTreeMap<String, u64>,
    /// kvroute's `kvroute_pd_prefill_legs_total`, by outcome (`ok`, `full`, `failed`, ...).
    pub prefill_legs: BTreeMap<String, u64>,
    /// The simulators' `/debug/state` `pd` counters summed over the fleet (`held_requests`,
    /// `held_blocks`, `released_total`, `expired_total`, `transfers_total`, ...), read after
    /// the router stopped and the fleet settled.
    pub sims: BTreeMap<String, u64>,
    /// Simulators whose state could not be read (their counters are missing from `sims`).
    pub unread: u64,
}

/// The fleet's description for `run` over `backends`.
pub fn fleet(run: &PolicyRun, backends: &[Member]) -> String {
    let count = |r: Role| backends.iter().filter(|m| m.role == r).count();
    match run.pd {
        None => format!("unified {}", backends.len()),
        Some(pd) => format!(
            "{} prefill + {} decode, {}",
            count(Role::Prefill),
            count(Role::Decode),
            pd.protocol.as_str()
        ),
    }
}

/// kvroute's P/D counters from its `/metrics` text.
pub fn from_kvroute(counts: &mut PdCounts, metrics: &str) {
    counts.decisions = by_outcome(metrics, "kvroute_pd_decisions_total");
    counts.prefill_legs = by_outcome(metrics, "kvroute_pd_prefill_legs_total");
}

/// `NAME{outcome="X"} V` samples of one counter, summed per outcome.
fn by_outcome(metrics: &str, name: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let outcome = labels
            .split(',')
            .find_map(|l| l.trim().strip_prefix("outcome=\""))
            .and_then(|v| v.strip_suffix('"'));
        if let (Some(o), Ok(v)) = (outcome, value.trim().parse::<f64>()) {
            *out.entry(o.to_string()).or_insert(0) += v as u64;
        }
    }
    out
}

/// The simulators' P/D counters summed over `backends`, once nothing is in flight (at most
/// `SETTLE` after the router stopped).
pub async fn read_sims(counts: &mut PdCounts, backends: &[Member]) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_default();
    let addrs: Vec<SocketAddr> = backends.iter().map(|m| m.addr).collect();
    let deadline = Instant::now() + SETTLE;
    loop {
        let (sums, unread) = sum_states(&client, &addrs).await;
        let settled = IN_FLIGHT
            .iter()
            .all(|k| sums.get(*k).copied().unwrap_or(0) == 0);
        counts.sims = sums;
        counts.unread = unread;
        if settled || Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn sum_states(
    client: &reqwest::Client,
    addrs: &[SocketAddr],
) -> (BTreeMap<String, u64>, u64) {
    let mut sums = BTreeMap::new();
    let mut unread = 0;
    for addr in addrs {
        let url = format!("http://{addr}/debug/state");
        let state = match client.get(&url).send().await {
            Ok(r) if r.status().is_success() => r.json::<serde_json::Value>().await.ok(),
            _ => None,
        };
        let Some(pd) = state
            .as_ref()
            .and_then(|s| s.get("pd"))
            .and_then(|p| p.as_object())
        else {
            unread += 1;
            continue;
        };
        // Every count the simulator reports, whatever its protocol names them.
        for (key, value) in pd {
            if let Some(v) = value.as_u64() {
                *sums.entry(key.clone()).or_insert(0) += v;
            }
        }
    }
    (sums, unread)
}

/// The P/D table of one workload: per run its fleet, what was split, the latencies
/// disaggregation trades (TTFT against the streams' inter-token tail), and what the
/// simulators moved, lost and still hold.
pub fn table(runs: &[(String, Summary)], pd: &[(String, PdCounts)]) -> String {
    let mut md = String::from(
        "\nPrefill/decode disaggregation: kvroute's decisions (`kvroute_pd_decisions_total`; a \
         peer's P/D mode splits every request), its prefill legs by outcome, and the \
         simulators' counters summed over the fleet after the router stopped (`/debug/state`): \
         KV reads by decode servers (failed: the prompt recomputed), holds released by a read \
         or expired unread, SGLang's waits timed out, and at the end the requests and blocks \
         prefill servers still hold and, with SGLang's protocol, the prefill legs and decode \
         requests still waiting (stranded; 0 is the target):\n\n\
         | policy | fleet | split / whole | prefill legs | TTFT p50 / p99 ms | ITL p50 / p99 ms \
         | KV reads (failed) | released / expired / timed out | at end: held requests / blocks \
         | at end: waiting legs / decodes |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (label, c) in pd {
        let summary = runs.iter().find(|(l, _)| l == label).map(|(_, s)| s);
        let sim = |k: &str| c.sims.get(k).map_or("n/a".to_string(), u64::to_string);
        let split = match (c.fleet.starts_with("unified"), c.decisions.is_empty()) {
            (true, _) => "-".to_string(),
            (false, true) => "all (peer)".to_string(),
            (false, false) => format!(
                "{} / {}",
                c.decisions.get("split").copied().unwrap_or(0),
                c.decisions.get("whole").copied().unwrap_or(0)
            ),
        };
        // kvroute registers every outcome at 0; the ones that happened are the news.
        let legs: Vec<String> = c
            .prefill_legs
            .iter()
            .filter(|(_, &v)| v > 0)
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let legs = if legs.is_empty() {
            "-".to_string()
        } else {
            legs.join(", ")
        };
        let pair = |a: Option<f64>, b: Option<f64>, digits: usize| {
            let f = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.digits$}"));
            format!("{} / {}", f(a), f(b))
        };
        let (ttft, itl) = match summary {
            Some(s) => (
                pair(s.ttft_p50_ms, s.ttft_p99_ms, 0),
                pair(s.itl_p50_ms, s.itl_p99_ms, 1),
            ),
            None => ("n/a".to_string(), "n/a".to_string()),
        };
        let mut held = format!("{} / {}", sim("held_requests"), sim("held_blocks"));
        if c.unread > 0 {
            let _ = write!(held, " ({} servers unread)", c.unread);
        }
        // D reading its KV is still waiting for its prefill too.
        let decodes = ["waiting_decodes", "transferring_decodes"]
            .iter()
            .filter_map(|k| c.sims.get(*k))
            .copied()
            .reduce(|a, b| a + b)
            .map_or("n/a".to_string(), |n| n.to_string());
        let _ = writeln!(
            md,
            "| {} | {} | {split} | {legs} | {ttft} | {itl} | {} ({}) | {} / {} / {} | {held} | {} / \
             {decodes} |",
            label.replace('|', "/"),
            c.fleet,
            sim("transfers_total"),
            sim("failed_transfers_total"),
            sim("released_total"),
            sim("expired_total"),
            sim("timed_out_waits_total"),
            sim("waiting_prefill_legs"),
        );
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_and_legs_are_summed_per_outcome() {
        let text = "# HELP kvroute_pd_decisions_total x\n\
                    kvroute_pd_decisions_total{outcome=\"split\"} 12\n\
                    kvroute_pd_decisions_total{outcome=\"whole\"} 3\n\
                    kvroute_pd_decisions_total_other{outcome=\"split\"} 99\n\
                    kvroute_pd_prefill_legs_total{outcome=\"ok\"} 11\n\
                    kvroute_pd_prefill_legs_total{outcome=\"failed\"} 1\n";
        let mut c = PdCounts::default();
        from_kvroute(&mut c, text);
        assert_eq!(c.decisions["split"], 12);
        assert_eq!(c.decisions["whole"], 3);
        assert_eq!((c.prefill_legs["ok"], c.prefill_legs["failed"]), (11, 1));
    }

    #[test]
    fn the_table_shows_splits_latencies_and_what_is_stranded() {
        let mut kv = PdCounts {
            fleet: "1 prefill + 2 decode, vllm_nixl".into(),
            ..PdCounts::default()
        };
        kv.decisions.insert("split".into(), 5);
        kv.prefill_legs.insert("ok".into(), 5);
        kv.prefill_legs.insert("failed".into(), 0);
        kv.sims.insert("held_requests".into(), 0);
        kv.sims.insert("held_blocks".into(), 0);
        let peer = PdCounts {
            fleet: "1 prefill + 2 decode, vllm_nixl".into(),
            unread: 1,
            ..PdCounts::default()
        };
        let unified = PdCounts {
            fleet: "unified 3".into(),
            ..PdCounts::default()
        };
        let s = Summary {
            ttft_p50_ms: Some(10.0),
            ttft_p99_ms: Some(90.4),
            itl_p50_ms: Some(5.0),
            itl_p99_ms: Some(20.26),
            ..Summary::default()
        };
        let runs = vec![("kv_aware/pd=always".to_string(), s)];
        let md = table(
            &runs,
            &[
                ("kv_aware/pd=always".into(), kv),
                ("vllm-router/pd".into(), peer),
                ("kv_aware".into(), unified),
            ],
        );
        assert!(md.contains(
            "| kv_aware/pd=always | 1 prefill + 2 decode, vllm_nixl | 5 / 0 | ok 5 | 10 / 90 | 5.0 / 20.3 \
             | n/a (n/a) | n/a / n/a / n/a | 0 / 0 | n/a / n/a |"
        ), "{md}");
        assert!(md.contains("| vllm-router/pd | 1 prefill + 2 decode, vllm_nixl | all (peer) |"));
        assert!(md.contains("n/a / n/a (1 servers unread) |"), "{md}");
        let mut sgl = PdCounts {
            fleet: "1 prefill + 2 decode, sglang_bootstrap".into(),
            ..PdCounts::default()
        };
        for (k, v) in [
            ("waiting_prefill_legs", 1),
            ("waiting_decodes", 2),
            ("transferring_decodes", 1),
            ("timed_out_waits_total", 4),
        ] {
            sgl.sims.insert(k.into(), v);
        }
        assert!(md.contains("| kv_aware | unified 3 | - |"), "{md}");
        let md = table(&runs, &[("sglang-router/pd".into(), sgl)]);
        assert!(md.contains("| n/a / n/a / 4 | n/a / n/a | 1 / 3 |"), "{md}");
    }
}
