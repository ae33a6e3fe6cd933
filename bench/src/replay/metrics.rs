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
            "vllm:num_requests_running" => *g.running.get_or_insert(0.0) += value,
            "vllm:num_requests_waiting" => *g.waiting.get_or_insert(0.0) += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                g.kv_cache_usage = Some(g.kv_cache_usage.map_or(value, |v: f64| v.max(value)));
            }
            _ => {}
        }
    }
    g
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
