//! Engine telemetry as Prometheus text, in the names of the engine a server pretends to be
//! (vLLM, SGLang or llama.cpp), which is what kvroute scrapes. The counters are in `stats`.

use std::fmt::Write;

use super::config::Engine;
use super::stats::{Histogram, Snapshot, TTFT_BUCKETS};

/// Prometheus text exposition (version 0.0.4) in `engine`'s metric names.
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
        }
        Engine::Llamacpp => {
            // llama.cpp's server labels nothing: it serves one model.
            t.gauge("llamacpp:requests_processing", "", s.running as f64);
            t.gauge("llamacpp:requests_deferred", "", s.waiting as f64);
            t.gauge("llamacpp:kv_cache_usage_ratio", "", s.kv_cache_usage);
            t.counter("llamacpp:prompt_tokens", "", s.prompt_tokens_total);
            t.counter("llamacpp:tokens_predicted", "", s.generation_tokens_total);
        }
    }
    t.out
}

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
        let _ = writeln!(self.out, "# TYPE {family} counter");
        self.sample(&format!("{family}_total"), labels, value as f64);
    }

    fn histogram(&mut self, name: &str, labels: &str, h: &Histogram) {
        let _ = writeln!(self.out, "# TYPE {name} histogram");
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (i, &le) in TTFT_BUCKETS.iter().enumerate() {
            cumulative += h.counts[i];
            self.sample(
                &bucket,
                &format!("{labels},le=\"{le:?}\""),
                cumulative as f64,
            );
        }
        self.sample(&bucket, &format!("{labels},le=\"+Inf\""), h.count as f64);
        self.sample(&format!("{name}_sum"), labels, h.sum);
        self.sample(&format!("{name}_count"), labels, h.count as f64);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::sim::stats::Stats;

    fn busy_stats() -> Arc<Stats> {
        let stats = Arc::new(Stats::default());
        stats.admitted(100, 64);
        stats.generated(16);
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
        let s = busy_stats().snapshot(100);
        let sg = render(Engine::Sglang, "m", &s, 100);
        for name in [
            "sglang:num_running_reqs{",
            "sglang:num_queue_reqs{",
            "sglang:token_usage{",
            "sglang:cache_hit_rate{model_name=\"m\"} 0.64",
        ] {
            assert!(sg.contains(name), "{name}\n{sg}");
        }
        let ll = render(Engine::Llamacpp, "m", &s, 100);
        for name in [
            "llamacpp:requests_processing 0",
            "llamacpp:requests_deferred 0",
            "llamacpp:kv_cache_usage_ratio 0",
        ] {
            assert!(ll.contains(name), "{name}\n{ll}");
        }
        assert!(!ll.contains("vllm:"));
    }
}
