//! Percentiles and the per-run summary. Plain functions over records, so `compare` can
//! summarise and tabulate several runs the same way.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::record::RequestRecord;
use super::tenants::{Fairness, TenantRow};

pub use super::percentile::{percentile, percentile_sorted};

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub requests: u64,
    pub errors: u64,
    pub timeouts: u64,
    /// First send to last completion, seconds.
    pub duration_s: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub e2e_p50_ms: Option<f64>,
    pub e2e_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    /// From the raw gaps only (absent after a reload of per-request medians): the stalls a
    /// long prefill beside a stream puts on it.
    #[serde(default)]
    pub itl_p99_ms: Option<f64>,
    pub output_tok_s: f64,
    pub slo_ttft_ms: f64,
    /// Successful requests with TTFT within the SLO, per second.
    pub goodput_rps: f64,
    /// Share of all requests (errors included) that met the SLO.
    pub slo_fraction: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Engine-reported cached / prompt tokens over successful requests.
    pub cache_hit_rate: Option<f64>,
    /// Ideal hit ratio of one infinite cache for the requests sent.
    pub oracle_hit_rate: Option<f64>,
    /// Prefill (prompt - cached) tokens per backend header value.
    pub prefill_by_backend: BTreeMap<String, u64>,
    pub prefill_share_max: Option<f64>,
    pub prefill_share_mean: Option<f64>,
    /// TTFT p50 / p99 of requests with at most `SMALL_PROMPT_TOKENS` prompt tokens: whether
    /// short requests queue behind long prefills (heavy_mix).
    #[serde(default)]
    pub small_ttft_p50_ms: Option<f64>,
    #[serde(default)]
    pub small_ttft_p99_ms: Option<f64>,
    /// TTFT of successful requests at percentiles 0, 1, ..., 100: enough to redraw a CDF.
    pub ttft_quantiles_ms: Vec<f64>,
    /// TTFT of first turns and of later turns (multi-turn workloads): whether follow-ups find
    /// their history where they land, apart from the cold prefills of new conversations.
    #[serde(default)]
    pub first_ttft_p50_ms: Option<f64>,
    #[serde(default)]
    pub first_ttft_p90_ms: Option<f64>,
    #[serde(default)]
    pub followup_ttft_p50_ms: Option<f64>,
    #[serde(default)]
    pub followup_ttft_p90_ms: Option<f64>,
    /// Of the rounds of the backends' `/metrics` polled (`--metrics-url`), those in which one
    /// backend had a request waiting for a slot while another had none at all, and how many
    /// rounds were polled (see `metrics::queued_while_idle`).
    #[serde(default)]
    pub queued_while_idle: Option<(u64, u64)>,
    /// One row per tenant, when the run had more than one (see `tenants`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantRow>,
    /// Jain's index of attained service among the backlogged tenants, per 60 s window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fairness: Option<Fairness>,
}

/// Prompts this short count as "small" for `small_ttft_*`.
pub const SMALL_PROMPT_TOKENS: u64 = 256;

pub fn summarize(records: &[RequestRecord], slo_ttft_ms: f64) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
    // Token-weighted ITL when the raw gaps are at hand; per-request medians after a reload.
    let mut itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
    let itl_p99_ms = percentile(&itl, 99.0);
    if itl.is_empty() {
        itl = ok.iter().filter_map(|r| r.itl_p50_ms).collect();
    }
    let start = records
        .iter()
        .map(|r| r.send_ms)
        .fold(f64::INFINITY, f64::min);
    let end = records
        .iter()
        .map(RequestRecord::end_ms)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration_s = if records.is_empty() {
        0.0
    } else {
        ((end - start) / 1e3).max(1e-9)
    };
    let per_s = |x: f64| {
        if records.is_empty() {
            0.0
        } else {
            x / duration_s
        }
    };

    let turn_ttft = |first: bool| -> Vec<f64> {
        ok.iter()
            .filter(|r| r.turn.is_some_and(|t| (t == 0) == first))
            .filter_map(|r| r.ttft_ms)
            .collect()
    };
    let (first_ttft, followup_ttft) = (turn_ttft(true), turn_ttft(false));
    let small_ttft: Vec<f64> = ok
        .iter()
        .filter(|r| r.prompt_tokens.is_some_and(|p| p <= SMALL_PROMPT_TOKENS))
        .filter_map(|r| r.ttft_ms)
        .collect();
    let prompt_tokens: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let cached_tokens: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let completion_tokens: u64 = ok.iter().filter_map(|r| r.completion_tokens).sum();
    let met = ok
        .iter()
        .filter(|r| r.ttft_ms.is_some_and(|t| t <= slo_ttft_ms))
        .count() as f64;

    let mut prefill_by_backend = BTreeMap::new();
    for r in &ok {
        if let (Some(b), Some(p)) = (&r.backend, r.prompt_tokens) {
            *prefill_by_backend.entry(b.clone()).or_insert(0) +=
                p.saturating_sub(r.cached_tokens.unwrap_or(0));
        }
    }
    let (share_max, share_mean) = prefill_shares(&prefill_by_backend);
    let oracle_total: f64 = records.iter().map(|r| r.oracle_total).sum();
    let oracle_hit: f64 = records.iter().map(|r| r.oracle_hit).sum();

    Summary {
        requests: records.len() as u64,
        errors: (records.len() - ok.len()) as u64,
        timeouts: records
            .iter()
            .filter(|r| r.error.as_deref() == Some("timeout"))
            .count() as u64,
        duration_s,
        ttft_p50_ms: percentile_sorted(&ttft, 50.0),
        ttft_p90_ms: percentile_sorted(&ttft, 90.0),
        ttft_p99_ms: percentile_sorted(&ttft, 99.0),
        e2e_p50_ms: percentile(&e2e, 50.0),
        e2e_p99_ms: percentile(&e2e, 99.0),
        itl_p50_ms: percentile(&itl, 50.0),
        itl_p99_ms,
        output_tok_s: per_s(completion_tokens as f64),
        slo_ttft_ms,
        goodput_rps: per_s(met),
        slo_fraction: if records.is_empty() {
            0.0
        } else {
            met / records.len() as f64
        },
        prompt_tokens,
        cached_tokens,
        completion_tokens,
        cache_hit_rate: (prompt_tokens > 0).then(|| cached_tokens as f64 / prompt_tokens as f64),
        oracle_hit_rate: (oracle_total > 0.0).then(|| oracle_hit / oracle_total),
        prefill_by_backend,
        prefill_share_max: share_max,
        prefill_share_mean: share_mean,
        small_ttft_p50_ms: percentile(&small_ttft, 50.0),
        small_ttft_p99_ms: percentile(&small_ttft, 99.0),
        ttft_quantiles_ms: if ttft.is_empty() {
            Vec::new()
        } else {
            (0..=100)
                .filter_map(|p| percentile_sorted(&ttft, p as f64))
                .collect()
        },
        first_ttft_p50_ms: percentile(&first_ttft, 50.0),
        first_ttft_p90_ms: percentile(&first_ttft, 90.0),
        followup_ttft_p50_ms: percentile(&followup_ttft, 50.0),
        followup_ttft_p90_ms: percentile(&followup_ttft, 90.0),
        queued_while_idle: None,
        tenants: Vec::new(),
        fairness: None,
    }
}

/// Largest and mean share of prefill tokens among the backends that answered. max/mean is
/// the imbalance figure (1.0 = even); backends that got nothing are invisible here.
fn prefill_shares(by_backend: &BTreeMap<String, u64>) -> (Option<f64>, Option<f64>) {
    let total: u64 = by_backend.values().sum();
    if by_backend.is_empty() || total == 0 {
        return (None, None);
    }
    let max = by_backend.values().copied().max().unwrap_or(0);
    (
        Some(max as f64 / total as f64),
        Some(1.0 / by_backend.len() as f64),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(send: f64, ttft: f64, backend: &str, prompt: u64, cached: u64) -> RequestRecord {
        RequestRecord {
            send_ms: send,
            ttft_ms: Some(ttft),
            e2e_ms: ttft + 100.0,
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            completion_tokens: Some(10),
            backend: Some(backend.into()),
            oracle_hit: cached as f64,
            oracle_total: prompt as f64,
            ..Default::default()
        }
    }

    #[test]
    fn summary_figures() {
        let mut recs = vec![
            rec(0.0, 100.0, "0", 100, 50),
            rec(500.0, 3000.0, "1", 100, 0),
            rec(900.0, 100.0, "0", 100, 50),
        ];
        recs.push(RequestRecord {
            send_ms: 1000.0,
            e2e_ms: 900.0,
            error: Some("timeout".into()),
            ..Default::default()
        });
        let s = summarize(&recs, 2000.0);
        assert_eq!((s.requests, s.errors, s.timeouts), (4, 1, 1));
        assert!((s.duration_s - 3.6).abs() < 1e-9); // 0 .. 500+3100
        assert_eq!(s.cache_hit_rate, Some(100.0 / 300.0));
        assert_eq!(s.slo_fraction, 0.5);
        assert!((s.goodput_rps - 2.0 / 3.6).abs() < 1e-9);
        assert_eq!(s.prefill_by_backend["0"], 100);
        assert_eq!(s.prefill_by_backend["1"], 100);
        assert_eq!(s.prefill_share_max, Some(0.5));
        assert_eq!(s.prefill_share_mean, Some(0.5));
        assert_eq!(s.ttft_quantiles_ms.len(), 101);
        assert_eq!(s.ttft_p50_ms, Some(100.0));
    }

    #[test]
    fn empty_summary_has_no_nans() {
        let s = summarize(&[], 2000.0);
        assert_eq!(s.requests, 0);
        assert_eq!(s.output_tok_s, 0.0);
        assert!(s.ttft_p50_ms.is_none() && s.cache_hit_rate.is_none());
    }
}
