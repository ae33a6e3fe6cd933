//! Validated simulator settings shared by every server of one process. Durations are already
//! divided by the time scale, so the serving code never has to remember to do it.

use std::sync::Arc;
use std::time::Duration;

use super::engine::cores::SharedCores;
use super::engine::lora::LoraConfig;
use super::engine::profile::{Profile, ProfileName};
use super::faults::Faults;
use super::pd::PdConfig;
use super::text::tokenizer::PromptTokenizer;

/// Which engine's metric names `/metrics` speaks (and, for llama.cpp, its `/props` and
/// `/slots`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    Vllm,
    Sglang,
    Llamacpp,
}

impl Engine {
    /// The engine a profile stands for, when `--engine` does not say: llama.cpp for
    /// `cpu-smollm2`, vLLM for the GPU profiles.
    pub fn of_profile(name: ProfileName) -> Self {
        if name.is_llamacpp() {
            Engine::Llamacpp
        } else {
            Engine::Vllm
        }
    }
}

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub model: String,
    pub engine: Engine,
    /// Wall-clock wait before the first token (already time-scaled).
    pub ttft: Duration,
    /// Wall-clock gap between tokens (already time-scaled).
    pub itl: Duration,
    /// Wall-clock span after start during which the server answers 503 (already time-scaled).
    pub slow_start: Duration,
    /// Model seconds per wall-clock second; reported times are converted back to model time.
    pub time_scale: f64,
    pub faults: Faults,
    /// This server's GPU profile: its KV pool size (the engine's pool, or the fixed mode's
    /// prefix cache) and, in engine mode, its step-time model.
    pub profile: Profile,
    /// Fixed timing (`ttft`, `itl`) instead of the engine, which kvroute's integration tests
    /// rely on.
    pub fixed_timing: bool,
    /// What counts prompt tokens (`--tokenizer`), loaded once for every server.
    pub tokenizer: Arc<PromptTokenizer>,
    /// LoRA adapters this server can load (`--lora-adapters`), on top of `model`.
    pub lora: LoraConfig,
    /// Engines (data-parallel ranks) behind the server's port, each of `profile` (`--dp-size`).
    pub dp_size: usize,
    /// P/D disaggregation (`--role`, `--pd-protocol`, `--kv-transfer-*`,
    /// `--pd-abort-timeout-s`).
    pub pd: PdConfig,
    /// The CPU cores every server's engines share (`--cores`); None: each its own.
    pub cores: Option<Arc<SharedCores>>,
}

impl SimConfig {
    /// Defaults suited to tests: fast, no faults.
    #[cfg(test)]
    pub fn for_tests() -> Self {
        Self {
            model: "sim-llama-8b".to_owned(),
            engine: Engine::Vllm,
            ttft: Duration::from_millis(20),
            itl: Duration::from_millis(5),
            slow_start: Duration::ZERO,
            time_scale: 1.0,
            faults: Faults::default(),
            profile: Profile::get(ProfileName::H100Llama8b),
            fixed_timing: true,
            tokenizer: Arc::default(),
            lora: LoraConfig::default(),
            dp_size: 1,
            pd: PdConfig::default(),
            cores: None,
        }
    }

    /// Engine mode with a small pool, for end-to-end tests of the engine.
    #[cfg(test)]
    pub fn for_engine_tests(kv_tokens: u64, time_scale: f64) -> Self {
        Self {
            time_scale,
            profile: Profile::get(ProfileName::H100Llama8b).with_kv_tokens(kv_tokens),
            fixed_timing: false,
            ..Self::for_tests()
        }
    }

    /// A llama.cpp server as `--profile cpu-smollm2` runs it, in engine mode.
    #[cfg(test)]
    pub fn for_llamacpp_tests(time_scale: f64) -> Self {
        Self {
            model: "smollm2".to_owned(),
            engine: Engine::Llamacpp,
            time_scale,
            profile: Profile::get(ProfileName::CpuSmollm2),
            fixed_timing: false,
            ..Self::for_tests()
        }
    }

    /// KV pool size in 16-token blocks.
    /// The server's KV blocks: every rank's pool together.
    pub fn num_gpu_blocks(&self) -> usize {
        self.profile.kv_blocks * self.dp_size.max(1)
    }

    /// The same settings for a server with another profile (mixed fleets); a `--kv-tokens`
    /// override applies to every profile.
    pub fn with_profile(&self, name: ProfileName, kv_tokens: Option<u64>) -> Self {
        let mut profile = Profile::get(name);
        if let Some(tokens) = kv_tokens {
            profile = profile.with_kv_tokens(tokens);
        }
        Self {
            profile,
            ..self.clone()
        }
    }
}

/// Converts a model-time span in milliseconds to the wall-clock span to actually wait.
pub fn scaled(ms: f64, time_scale: f64) -> Duration {
    Duration::from_secs_f64(ms / 1000.0 / time_scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_scale_divides_waits() {
        assert_eq!(scaled(20.0, 1.0), Duration::from_millis(20));
        assert_eq!(scaled(20.0, 10.0), Duration::from_millis(2));
    }
}
