//! Engine telemetry as Prometheus text, in the names of the engine a server pretends to be
//! (vLLM, SGLang or llama.cpp), which is what kvroute scrapes. The counters are in `stats`.
//!
//! Names keep their engine's meaning, since a router reading them cannot tell a simulator
//! from the real engine: vLLM's and SGLang's `prompt_tokens_total` count every prompt token
//! of admitted requests, llama.cpp's only those it computed (`n_prompt_tokens_processed`,
//! prefix-cache hits excluded); vLLM's prefix-cache counters count tokens, its
//! `request_prefill_kv_computed_tokens` the tokens each prefill computed, observed with its
//! `request_prefill_time_seconds` (vLLM observes both when the request finishes, the simulator
//! when its prefill does). All times are model seconds.
//!
//! llama.cpp's families are exactly those of a real `llama-server` 0.6.0
//! (`tests/fixtures/scrapes/llamacpp-0.6.0.metrics.txt`), in its order, with its HELP text
//! and types: no KV usage (that version exports none; its slots and their context are on
//! `/props`). Its throughput gauges cover only what finished since the previous scrape, which
//! resets them (`Stats::scrape`); its generation counters count a request when it ends.

use std::fmt::Write;

use crate::sim::config::Engine;
use crate::sim::engine::kv_events::kvpublish::KvEventCounters;
use crate::sim::engine::lora::{LoraConfig, LoraSlots};
use crate::sim::engine::stats::{Histogram, Snapshot};
use crate::sim::pd::PdSnapshot;

/// Prometheus text exposition (version 0.0.4) in `engine`'s metric names.
/// vLLM's LoRA gauge (`vllm:lora_requests_info`: its value the time of the sample, its labels
/// the adapters with requests running and waiting, and `max_lora`), and the simulator's own
/// count of adapter loads.
pub fn render_lora(cfg: &LoraConfig, slots: &LoraSlots) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    format!(
        "# TYPE vllm:lora_requests_info gauge\n\
         vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {now}\n\
         # TYPE kvbench_lora_loads_total counter\n\
         kvbench_lora_loads_total {}\n",
        cfg.max_loras,
        escape_label(&slots.running_list()),
        escape_label(&slots.waiting_list()),
        slots.loads()
    )
}

/// The simulator's own counts of KV event batches (`--kv-events`): numbered, handed to the PUB
/// socket, skipped by `--kv-events-drop-percent`, skipped because the PUB task was behind.
/// Every batch is one of the last three, and all stay replayable.
/// With several data-parallel ranks, their counts together.
pub fn render_kv_events(ranks: &[&KvEventCounters]) -> String {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let sum = |f: fn(&KvEventCounters) -> &AtomicU64| -> u64 {
        ranks.iter().map(|c| f(c).load(Relaxed)).sum()
    };
    let mut t = Text::default();
    t.counter("kvbench_kv_events_batches", "", sum(|c| &c.batches));
    t.counter("kvbench_kv_events_published", "", sum(|c| &c.published));
    t.counter("kvbench_kv_events_dropped", "", sum(|c| &c.dropped));
    t.counter("kvbench_kv_events_overflow", "", sum(|c| &c.overflow));
    t.out
}

/// vLLM's NixlConnector families: the reading side's transfer times (model seconds) and
/// sizes and its failed reads and notices, the holding side's expired requests.
pub fn render_pd(model: &str, s: &PdSnapshot) -> String {
    let label = format!("model_name=\"{}\"", escape_label(model));
    let mut t = Text::default();
    t.histogram("vllm:nixl_xfer_time_seconds", &label, &s.xfer_time);
    t.histogram("vllm:nixl_bytes_transferred", &label, &s.bytes);
    t.counter(
        "vllm:nixl_num_failed_transfers",
        &label,
        s.failed_transfers_total,
    );
    t.counter(
        "vllm:nixl_num_failed_notifications",
        &label,
        s.failed_notifications_total,
    );
    t.counter("vllm:nixl_num_kv_expired_reqs", &label, s.expired_total);
    t.out
}

/// SGLang's disaggregation families (`python/sglang/srt/metrics/collector.py` @
/// 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538), from what the simulator has: P's rooms held
/// for a decode server are its inflight queue (prefilled, transfer pending; P prefills before
/// D connects here, so its bootstrap/prealloc queue is always empty), D's legs waiting for
/// P's KV its prealloc queue, D's legs reading its transfer queue; the last read's speed and
/// time; P's expired rooms as failed bootstraps, D's timed-out waits and failed reads as
/// failed transfers.
pub fn render_sglang_pd(model: &str, held_rooms: usize, s: &PdSnapshot) -> String {
    let label = format!("model_name=\"{}\"", escape_label(model));
    let mut t = Text::default();
    t.gauge("sglang:num_prefill_prealloc_queue_reqs", &label, 0.0);
    let inflight = held_rooms as f64;
    t.gauge("sglang:num_prefill_inflight_queue_reqs", &label, inflight);
    let prealloc = s.waiting_decodes as f64;
    t.gauge("sglang:num_decode_prealloc_queue_reqs", &label, prealloc);
    let transfer = s.transferring_decodes as f64;
    t.gauge("sglang:num_decode_transfer_queue_reqs", &label, transfer);
    t.gauge("sglang:kv_transfer_speed_gb_s", &label, s.last_speed_gb_s);
    t.gauge("sglang:kv_transfer_latency_ms", &label, s.last_latency_ms);
    t.counter("sglang:num_bootstrap_failed_reqs", &label, s.expired_total);
    let failed = s.timed_out_waits_total + s.failed_transfers_total;
    t.counter("sglang:num_transfer_failed_reqs", &label, failed);
    t.out
}

pub fn render(engine: Engine, model: &str, s: &Snapshot, num_gpu_blocks: usize) -> String {
    let label = format!("model_name=\"{}\"", escape_label(model));
    let mut t = Text::default();
    match engine {
        Engine::Vllm => {
            t.gauge("vllm:num_requests_running", &label, s.running as f64);
            t.gauge("vllm:num_requests_waiting", &label, s.waiting as f64);
            t.gauge("vllm:kv_cache_usage_perc", &label, s.kv_cache_usage);
            t.counter(
                "vllm:prefix_cache_queries",
                &label,
                s.prefix_cache_queries_total,
            );
            t.counter("vllm:prefix_cache_hits", &label, s.prefix_cache_hits_total);
            let info = format!("{label},block_size=\"16\",num_gpu_blocks=\"{num_gpu_blocks}\"");
            t.gauge("vllm:cache_config_info", &info, 1.0);
            t.counter("vllm:num_preemptions", &label, s.preemptions_total);
            t.counter("vllm:prompt_tokens", &label, s.prompt_tokens_total);
            t.counter("vllm:generation_tokens", &label, s.generation_tokens_total);
            t.histogram("vllm:time_to_first_token_seconds", &label, &s.ttft);
            t.histogram("vllm:request_prefill_time_seconds", &label, &s.prefill_time);
            t.histogram(
                "vllm:request_prefill_kv_computed_tokens",
                &label,
                &s.prefill_computed_tokens,
            );
            t.histogram("vllm:inter_token_latency_seconds", &label, &s.itl);
        }
        Engine::Sglang => {
            t.gauge("sglang:num_running_reqs", &label, s.running as f64);
            t.gauge("sglang:num_queue_reqs", &label, s.waiting as f64);
            t.gauge("sglang:token_usage", &label, s.kv_cache_usage);
            let hit_rate = if s.prefix_cache_queries_total == 0 {
                0.0
            } else {
                s.prefix_cache_hits_total as f64 / s.prefix_cache_queries_total as f64
            };
            t.gauge("sglang:cache_hit_rate", &label, hit_rate);
            t.counter("sglang:prompt_tokens", &label, s.prompt_tokens_total);
            t.counter(
                "sglang:generation_tokens",
                &label,
                s.generation_tokens_total,
            );
            t.histogram("sglang:time_to_first_token_seconds", &label, &s.ttft);
            t.histogram("sglang:inter_token_latency_seconds", &label, &s.itl);
            t.gauge("sglang:num_used_tokens", &label, s.kv_tokens_used as f64);
            t.counter("sglang:cached_tokens", &label, s.prefix_cache_hits_total);
        }
        Engine::Llamacpp => {
            // llama.cpp's server labels nothing: it serves one model.
            let per_decode = s.busy_seqs_total as f64 / s.steps_total.max(1) as f64;
            let values = [
                s.prompt_tokens_processed_total as f64,
                s.prefix_cache_hits_total as f64,
                s.prompt_seconds_total,
                s.predicted_total.tokens as f64,
                s.predicted_total.seconds,
                s.steps_total as f64,
                s.max_seq_tokens as f64,
                // No speculative decoding.
                0.0,
                0.0,
                0.0,
                s.interval.prompt.rate(),
                s.interval.predicted.rate(),
                s.running as f64,
                s.waiting as f64,
                per_decode,
            ];
            for ((name, help, kind), value) in LLAMACPP_FAMILIES.iter().zip(values) {
                let _ = writeln!(t.out, "# HELP {name} {help}");
                let _ = writeln!(t.out, "# TYPE {name} {kind}");
                t.sample(name, "", value);
            }
        }
    }
    t.out
}

/// llama-server 0.6.0's `/metrics`, family by family: name, HELP text, type. Counters are
/// named with `_total` in their HELP and TYPE lines too, and `n_tokens_max` (a maximum) is
/// typed a counter, as llama.cpp writes them.
const LLAMACPP_FAMILIES: [(&str, &str, &str); 15] = [
    (
        "llamacpp:prompt_tokens_total",
        "Number of prompt tokens processed, excluding cached tokens",
        "counter",
    ),
    (
        "llamacpp:prompt_tokens_cached_total",
        "Number of prompt tokens reused from the cache",
        "counter",
    ),
    (
        "llamacpp:prompt_seconds_total",
        "Total time spent processing prompts",
        "counter",
    ),
    (
        "llamacpp:tokens_predicted_total",
        "Number of generation tokens processed",
        "counter",
    ),
    (
        "llamacpp:tokens_predicted_seconds_total",
        "Total time spent generating tokens",
        "counter",
    ),
    (
        "llamacpp:n_decode_total",
        "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
        "counter",
    ),
    (
        "llamacpp:n_tokens_max",
        "Largest observed sequence length (prompt + generation)",
        "counter",
    ),
    (
        "llamacpp:spec_decode_num_draft_tokens_total",
        "Speculative: Total draft tokens generated",
        "counter",
    ),
    (
        "llamacpp:spec_decode_num_accepted_tokens_total",
        "Speculative: Total draft tokens accepted by the target model",
        "counter",
    ),
    (
        "llamacpp:spec_decode_num_drafts_total",
        "Speculative: Total speculative decoding verification steps",
        "counter",
    ),
    (
        "llamacpp:prompt_tokens_seconds",
        "Average prompt throughput in tokens/s",
        "gauge",
    ),
    (
        "llamacpp:predicted_tokens_seconds",
        "Average generation throughput in tokens/s",
        "gauge",
    ),
    (
        "llamacpp:requests_processing",
        "Number of requests processing",
        "gauge",
    ),
    (
        "llamacpp:requests_deferred",
        "Number of requests deferred",
        "gauge",
    ),
    (
        "llamacpp:n_busy_slots_per_decode",
        "Average number of busy slots per llama_decode() call",
        "gauge",
    ),
];

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[derive(Default)]
struct Text {
    out: String,
}

impl Text {
    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        if labels.is_empty() {
            let _ = writeln!(self.out, "{name} {value}");
        } else {
            let _ = writeln!(self.out, "{name}{{{labels}}} {value}");
        }
    }

    fn gauge(&mut self, name: &str, labels: &str, value: f64) {
        let _ = writeln!(self.out, "# TYPE {name} gauge");
        self.sample(name, labels, value);
    }

    /// Counter families are named without `_total`; the sample carries it (as vLLM emits).
    fn counter(&mut self, family: &str, labels: &str, value: u64) {
        self.counter_f64(family, labels, value as f64);
    }

    fn counter_f64(&mut self, family: &str, labels: &str, value: f64) {
        let _ = writeln!(self.out, "# TYPE {family} counter");
        self.sample(&format!("{family}_total"), labels, value);
    }

    fn histogram(&mut self, name: &str, labels: &str, h: &Histogram) {
        let _ = writeln!(self.out, "# TYPE {name} histogram");
        let bucket = format!("{name}_bucket");
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, &le) in h.bounds.iter().enumerate() {
            cumulative += h.counts[i];
            self.sample(
                &bucket,
                &format!("{labels}{sep}le=\"{le:?}\""),
                cumulative as f64,
            );
        }
        self.sample(
            &bucket,
            &format!("{labels}{sep}le=\"+Inf\""),
            h.count as f64,
        );
        self.sample(&format!("{name}_sum"), labels, h.sum);
        self.sample(&format!("{name}_count"), labels, h.count as f64);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::sim::engine::stats::Stats;

    /// One request: 100 prompt tokens, 64 of them cached, so 36 computed in 0.4 model s;
    /// then 16 tokens, the last 0.3 model s after the first.
    fn busy_stats() -> Arc<Stats> {
        let stats = Arc::new(Stats::default());
        stats.admitted(100, 64);
        stats.prefilled(36, 0.4);
        stats.generated(16);
        stats.predicted(16, 0.3);
        stats.observe_ttft(0.03);
        stats
    }

    #[test]
    fn vllm_text_has_the_scraped_names() {
        let stats = busy_stats();
        let _running = stats.start_running(3125);
        let text = render(Engine::Vllm, "m", &stats.snapshot(31_250), 31_250);
        for line in [
            "vllm:num_requests_running{model_name=\"m\"} 1",
            "vllm:num_requests_waiting{model_name=\"m\"} 0",
            "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.1",
            "vllm:prefix_cache_queries_total{model_name=\"m\"} 100",
            "vllm:prefix_cache_hits_total{model_name=\"m\"} 64",
            "vllm:cache_config_info{model_name=\"m\",block_size=\"16\",num_gpu_blocks=\"31250\"} 1",
            "vllm:num_preemptions_total{model_name=\"m\"} 0",
            "vllm:prompt_tokens_total{model_name=\"m\"} 100",
            "vllm:generation_tokens_total{model_name=\"m\"} 16",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.02\"} 0",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.04\"} 1",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 1",
            "vllm:time_to_first_token_seconds_count{model_name=\"m\"} 1",
            "# TYPE vllm:request_prefill_time_seconds histogram",
            "vllm:request_prefill_time_seconds_bucket{model_name=\"m\",le=\"0.3\"} 0",
            "vllm:request_prefill_time_seconds_bucket{model_name=\"m\",le=\"0.5\"} 1",
            "vllm:request_prefill_time_seconds_bucket{model_name=\"m\",le=\"7680.0\"} 1",
            "vllm:request_prefill_time_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 1",
            "vllm:request_prefill_time_seconds_sum{model_name=\"m\"} 0.4",
            "vllm:request_prefill_time_seconds_count{model_name=\"m\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
    }

    #[test]
    fn gauges_follow_guards() {
        let stats = busy_stats();
        {
            let _w = stats.start_waiting();
            assert_eq!(stats.snapshot(10).waiting, 1);
        }
        let s = stats.snapshot(10);
        assert_eq!((s.running, s.waiting, s.kv_cache_usage), (0, 0, 0.0));
    }

    #[test]
    fn other_engines_use_their_names() {
        let stats = busy_stats();
        // 5 blocks held by a running request: 80 KV tokens in use.
        let _running = stats.start_running(5);
        let s = stats.snapshot(100);
        assert_eq!(s.kv_tokens_used, 80);
        let sg = render(Engine::Sglang, "m", &s, 100);
        for line in [
            "sglang:num_running_reqs{model_name=\"m\"} 1",
            "sglang:num_queue_reqs{model_name=\"m\"} 0",
            "sglang:token_usage{model_name=\"m\"} 0.05",
            "sglang:cache_hit_rate{model_name=\"m\"} 0.64",
            "sglang:prompt_tokens_total{model_name=\"m\"} 100",
            "# TYPE sglang:num_used_tokens gauge",
            "sglang:num_used_tokens{model_name=\"m\"} 80",
            "# TYPE sglang:cached_tokens counter",
            "sglang:cached_tokens_total{model_name=\"m\"} 64",
        ] {
            assert!(sg.lines().any(|l| l == line), "missing {line}\n{sg}");
        }
        let ll = render(Engine::Llamacpp, "m", &s, 100);
        for line in [
            "llamacpp:requests_processing 1",
            "llamacpp:requests_deferred 0",
            // Computed prompt tokens only: the 64 cached ones are not processed.
            "# TYPE llamacpp:prompt_tokens_total counter",
            "llamacpp:prompt_tokens_total 36",
            "llamacpp:prompt_tokens_cached_total 64",
            "# TYPE llamacpp:prompt_seconds_total counter",
            "llamacpp:prompt_seconds_total 0.4",
            "# TYPE llamacpp:prompt_tokens_seconds gauge",
            "llamacpp:prompt_tokens_seconds 90",
            // Counted when the request ends: 16 tokens, 0.3 s after the first.
            "llamacpp:tokens_predicted_total 16",
            "llamacpp:tokens_predicted_seconds_total 0.3",
        ] {
            assert!(ll.lines().any(|l| l == line), "missing {line}\n{ll}");
        }
        assert!(!ll.contains("vllm:"));
        assert!(
            !ll.contains("kv_cache"),
            "llama-server 0.6.0 exports no KV usage\n{ll}"
        );
        // Before any prefill, the throughput gauge is 0, not NaN.
        let idle = render(Engine::Llamacpp, "m", &Stats::default().snapshot(100), 100);
        assert!(
            idle.lines()
                .any(|l| l == "llamacpp:prompt_tokens_seconds 0"),
            "{idle}"
        );
    }

    /// A real llama-server 0.6.0's `/metrics`, recorded (see its README).
    const LLAMACPP_FIXTURE: &str =
        include_str!("../../../../tests/fixtures/scrapes/llamacpp-0.6.0.metrics.txt");

    /// The families of an exposition: its HELP and TYPE lines, and its samples' names.
    fn shape(text: &str) -> (Vec<&str>, Vec<&str>) {
        let comments = text.lines().filter(|l| l.starts_with('#')).collect();
        let names = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.split([' ', '{']).next().unwrap_or(""))
            .collect();
        (comments, names)
    }

    #[test]
    fn llamacpp_text_has_exactly_the_recorded_families() {
        let (want_comments, want_names) = shape(LLAMACPP_FIXTURE);
        assert_eq!(want_names.len(), 15, "{LLAMACPP_FIXTURE}");
        for s in [busy_stats().scrape(100), Stats::default().snapshot(100)] {
            let text = render(Engine::Llamacpp, "m", &s, 100);
            let (comments, names) = shape(&text);
            // The same HELP and TYPE lines, in the same order; one sample per family.
            assert_eq!(comments, want_comments, "{text}");
            assert_eq!(names, want_names, "{text}");
            for line in text.lines().filter(|l| !l.starts_with('#')) {
                let value = line.rsplit(' ').next().unwrap();
                assert!(value.parse::<f64>().unwrap().is_finite(), "{line}");
            }
        }
    }

    /// The throughput gauges cover what finished since the previous scrape; the counters go on.
    #[test]
    fn llamacpp_throughput_gauges_reset_on_each_scrape() {
        let stats = busy_stats();
        let first = render(Engine::Llamacpp, "m", &stats.scrape(100), 100);
        assert!(first
            .lines()
            .any(|l| l == "llamacpp:predicted_tokens_seconds 53.333333333333336"));
        // `/debug/state` reads without resetting.
        assert_eq!(stats.snapshot(100).interval.prompt.tokens, 0);
        let second = render(Engine::Llamacpp, "m", &stats.scrape(100), 100);
        for line in [
            "llamacpp:prompt_tokens_seconds 0",
            "llamacpp:predicted_tokens_seconds 0",
            "llamacpp:prompt_tokens_total 36",
            "llamacpp:tokens_predicted_total 16",
        ] {
            assert!(
                second.lines().any(|l| l == line),
                "missing {line}\n{second}"
            );
        }
        stats.prefilled(100, 0.5);
        let third = render(Engine::Llamacpp, "m", &stats.scrape(100), 100);
        assert!(third
            .lines()
            .any(|l| l == "llamacpp:prompt_tokens_seconds 200"));
        assert!(third
            .lines()
            .any(|l| l == "llamacpp:prompt_tokens_total 136"));
    }
}
