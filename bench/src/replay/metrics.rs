//! Polls the backends' Prometheus endpoints during a run to record load over time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub const POLL_EVERY: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LoadSample {
    /// Milliseconds since the run start.
    pub t_ms: f64,
    pub backend: String,
    pub running: f64,
    pub waiting: f64,
    pub kv_cache_usage: Option<f64>,
}

/// The three gauges from one scrape. Several label sets of a gauge (e.g. per model) are summed;
/// cache usage takes the largest.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Gauges {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    pub kv_cache_usage: Option<f64>,
}

pub fn parse_gauges(text: &str) -> Gauges {
    let mut g = Gauges::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = split_sample(line) else {
            continue;
        };
        match name {
            "vllm:num_requests_running"
            | "sglang:num_running_reqs"
            | "llamacpp:requests_processing" => *g.running.get_or_insert(0.0) += value,
            "vllm:num_requests_waiting"
            | "sglang:num_queue_reqs"
            | "llamacpp:requests_deferred" => *g.waiting.get_or_insert(0.0) += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                g.kv_cache_usage = Some(g.kv_cache_usage.map_or(value, |v: f64| v.max(value)));
            }
            _ => {}
        }
    }
    g
}

/// Of the polling rounds (samples grouped by `POLL_EVERY` windows of the run) that saw two
/// backends or more, those in which a backend had a request waiting while another had none
/// running or waiting; and how many rounds saw two or more. A router that keeps the fleet
/// busy evenly has none: a request queued behind a full engine while another engine idled is
/// the time to first token a placement threw away.
pub fn queued_while_idle(samples: &[LoadSample]) -> (u64, u64) {
    let mut rounds: std::collections::BTreeMap<u64, Vec<&LoadSample>> = Default::default();
    for s in samples {
        let round = (s.t_ms / POLL_EVERY.as_secs_f64() / 1e3) as u64;
        rounds.entry(round).or_default().push(s);
    }
    let (mut hit, mut seen) = (0, 0);
    for round in rounds.values() {
        let mut backends: Vec<&&LoadSample> = round.iter().collect();
        backends.sort_by(|a, b| a.backend.cmp(&b.backend));
        backends.dedup_by(|a, b| a.backend == b.backend);
        if backends.len() < 2 {
            continue;
        }
        seen += 1;
        let queued = backends.iter().any(|s| s.waiting > 0.0);
        let idle = backends.iter().any(|s| s.running + s.waiting == 0.0);
        if queued && idle {
            hit += 1;
        }
    }
    (hit, seen)
}

/// `name{labels} value [timestamp]` -> (name, value). Label values may hold spaces, so the
/// value is looked for after the closing brace.
fn split_sample(line: &str) -> Option<(&str, f64)> {
    let (name, rest) = match line.find('{') {
        Some(open) => {
            let close = line.rfind('}')?;
            (&line[..open], &line[close + 1..])
        }
        None => line.split_once(char::is_whitespace)?,
    };
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((name.trim(), value))
}

/// Scrapes `url` every POLL_EVERY until `stop` is set. Failed scrapes are skipped: a backend
/// killed mid-run should show as a gap, not end the run.
pub async fn poll(
    client: reqwest::Client,
    url: String,
    start: Instant,
    stop: Arc<AtomicBool>,
    out: Arc<Mutex<Vec<LoadSample>>>,
) {
    let mut tick = tokio::time::interval(POLL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let t_ms = start.elapsed().as_secs_f64() * 1e3;
        let resp = client
            .get(&url)
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        let Ok(resp) = resp else { continue };
        let Ok(text) = resp.text().await else {
            continue;
        };
        let g = parse_gauges(&text);
        if g.running.is_none() && g.waiting.is_none() && g.kv_cache_usage.is_none() {
            continue;
        }
        if let Ok(mut v) = out.lock() {
            v.push(LoadSample {
                t_ms,
                backend: url.clone(),
                running: g.running.unwrap_or(0.0),
                waiting: g.waiting.unwrap_or(0.0),
                kv_cache_usage: g.kv_cache_usage,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_while_idle_counts_rounds_with_a_waiting_request_beside_an_idle_backend() {
        let s = |t_ms: f64, backend: &str, running: f64, waiting: f64| LoadSample {
            t_ms,
            backend: backend.into(),
            running,
            waiting,
            kv_cache_usage: None,
        };
        let samples = [
            // Round 0: a queues while b idles.
            s(10.0, "a", 2.0, 1.0),
            s(40.0, "b", 0.0, 0.0),
            // Round 1: a queues, b is busy too.
            s(510.0, "a", 2.0, 1.0),
            s(520.0, "b", 1.0, 0.0),
            // Round 2: nobody queues though b idles.
            s(1010.0, "a", 2.0, 0.0),
            s(1020.0, "b", 0.0, 0.0),
            // Round 3: one backend only answered: not counted.
            s(1510.0, "a", 2.0, 3.0),
        ];
        assert_eq!(queued_while_idle(&samples), (1, 3));
        let llama = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n";
        let g = parse_gauges(llama);
        assert_eq!((g.running, g.waiting), (Some(2.0), Some(1.0)));
    }

    #[test]
    fn parses_vllm_gauges() {
        let text = "# HELP vllm:num_requests_running Number of requests.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{model_name=\"sim llama\"} 3\n\
            vllm:num_requests_running{model_name=\"other\"} 1.0\n\
            vllm:num_requests_waiting{model_name=\"m\"} 2 1700000000000\n\
            vllm:kv_cache_usage_perc 0.25\n\
            vllm:num_requests_running_total 99\n";
        let g = parse_gauges(text);
        assert_eq!(g.running, Some(4.0));
        assert_eq!(g.waiting, Some(2.0));
        assert_eq!(g.kv_cache_usage, Some(0.25));
        assert_eq!(parse_gauges("garbage\n{}"), Gauges::default());
    }
}
