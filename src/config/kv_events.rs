//! `kvroute.kv_events` and `backends[].kv_events`: following the engines' KV-cache events, and
//! how kvroute turns a request into the tokens the engine hashes (its chat template and
//! tokenizer, from local files).

use serde::Deserialize;
use std::path::PathBuf;

use super::error::{err, ConfigError};

/// Where one engine publishes its KV events (vLLM's `--kv-events-config`, SGLang's
/// `--kv-events-config`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BackendKvEvents {
    /// The engine's PUB socket, `tcp://host:port` (vLLM's default port is 5557).
    pub endpoint: String,
    /// The engine's replay (ROUTER) socket, from which missed batches are asked for; absent:
    /// a gap cannot be repaired, and the backend's knowledge starts over from the next batch.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// The topic the engine publishes on (vLLM's default: empty).
    #[serde(default)]
    pub topic: String,
    /// Data-parallel ranks behind this backend's one HTTP endpoint (vLLM's
    /// `--data-parallel-size` with its internal load balancer). Each rank keeps its own KV
    /// cache and publishes on its own sockets, `endpoint`'s port + rank and `replay_endpoint`'s
    /// port + rank, as vLLM offsets them; kvroute follows each and pins a request to a rank with
    /// `X-Data-Parallel-Rank` (vLLM and SGLang honour it).
    #[serde(default = "one_rank")]
    pub data_parallel_size: u32,
}

/// Ranks one backend may have: past any data-parallel engine's size.
pub const MAX_DP_RANKS: u32 = 64;

fn one_rank() -> u32 {
    1
}

impl BackendKvEvents {
    /// Where rank `rank` publishes: the ports offset by the rank (vLLM's
    /// `offset_endpoint_port`). An `ipc://` endpoint is only ever rank 0's.
    pub fn for_rank(&self, rank: u32) -> BackendKvEvents {
        let offset = |e: &str| match e.rsplit_once(':') {
            Some((head, port)) if e.starts_with("tcp://") => port
                .parse::<u32>()
                .map_or_else(|_| e.to_string(), |p| format!("{head}:{}", p + rank)),
            _ => e.to_string(),
        };
        BackendKvEvents {
            endpoint: offset(&self.endpoint),
            replay_endpoint: self.replay_endpoint.as_deref().map(offset),
            topic: self.topic.clone(),
            data_parallel_size: 1,
        }
    }

    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        validate_endpoint(&format!("{key}.endpoint"), &self.endpoint)?;
        if let Some(r) = &self.replay_endpoint {
            validate_endpoint(&format!("{key}.replay_endpoint"), r)?;
        }
        let n = self.data_parallel_size;
        if !(1..=MAX_DP_RANKS).contains(&n) {
            return Err(err(
                format!("{key}.data_parallel_size"),
                format!("must be between 1 and {MAX_DP_RANKS}"),
            ));
        }
        if n > 1 {
            for (k, e) in std::iter::once(("endpoint", &self.endpoint))
                .chain(self.replay_endpoint.iter().map(|r| ("replay_endpoint", r)))
            {
                let last = e
                    .strip_prefix("tcp://")
                    .and_then(|r| r.rsplit_once(':'))
                    .and_then(|(_, p)| p.parse::<u32>().ok())
                    .map(|p| p + n - 1);
                if last.is_none_or(|p| p > u32::from(u16::MAX)) {
                    return Err(err(
                        format!("{key}.{k}"),
                        format!(
                            "{e:?}: with data_parallel_size {n}, rank r publishes at this \
                             port + r, so this must be tcp://host:port with port + {} \
                             at most 65535",
                            n - 1
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// How requests are tokenized to match the engines' blocks. Required for any backend's
/// `kv_events` to be used: without it, every backend stays on the approximate index.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    /// The served model's Hugging Face `tokenizer.json` (absolute path; never downloaded).
    pub tokenizer: PathBuf,
    /// Its `tokenizer_config.json`, whose `chat_template` renders chat requests as the engine
    /// does (absolute path).
    pub tokenizer_config: PathBuf,
    /// Tokens per KV block on the engines (vLLM's `--block-size`, 16 by default).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// How long a request may wait for its prompt to be tokenized before it is placed on the
    /// approximate index instead (the tokenization still finishes, for the next turn).
    #[serde(default = "default_budget_ms")]
    pub tokenize_budget_ms: u64,
    /// Prompts larger than this are not tokenized (placed on the approximate index).
    #[serde(default = "default_max_bytes")]
    pub tokenize_max_bytes: usize,
    /// The models (and LoRA adapters, by the name requests use) this tokenizer is for; empty:
    /// every model not named in `tokenizers`. Requests for a model no tokenizer covers are
    /// placed on the approximate index: their tokens would never match their engines' blocks.
    #[serde(default)]
    pub models: Vec<String>,
    /// More tokenizers, one per model family, for a fleet serving several models. A model
    /// named here uses its entry, whatever `models` says.
    #[serde(default)]
    pub tokenizers: Vec<ModelTokenizer>,
}

/// One model family's tokenizer files, for `kv_events.tokenizers`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelTokenizer {
    /// The models (and adapters) it is for; at least one.
    pub models: Vec<String>,
    pub tokenizer: PathBuf,
    pub tokenizer_config: PathBuf,
    /// These models' engines' block size, when it differs from `kv_events.block_size`.
    #[serde(default)]
    pub block_size: Option<usize>,
}

/// One tokenizer's files and block size: `kv_events`' own, or one of its `tokenizers`.
#[derive(Debug, Clone, Copy)]
pub struct TokenizerFiles<'a> {
    pub tokenizer: &'a std::path::Path,
    pub tokenizer_config: &'a std::path::Path,
    pub block_size: usize,
}

impl KvEventsConfig {
    /// These tokenizer files, every other setting at its default.
    pub fn new(tokenizer: PathBuf, tokenizer_config: PathBuf) -> KvEventsConfig {
        KvEventsConfig {
            tokenizer,
            tokenizer_config,
            block_size: default_block_size(),
            tokenize_budget_ms: default_budget_ms(),
            tokenize_max_bytes: default_max_bytes(),
            models: Vec::new(),
            tokenizers: Vec::new(),
        }
    }

    /// Every tokenizer: `kv_events`' own first, then `tokenizers` in order. Indexes into this
    /// list are what [`KvEventsConfig::tokenizer_for`] returns.
    pub fn all_files(&self) -> Vec<TokenizerFiles<'_>> {
        let own = TokenizerFiles {
            tokenizer: &self.tokenizer,
            tokenizer_config: &self.tokenizer_config,
            block_size: self.block_size,
        };
        std::iter::once(own)
            .chain(self.tokenizers.iter().map(|t| TokenizerFiles {
                tokenizer: &t.tokenizer,
                tokenizer_config: &t.tokenizer_config,
                block_size: t.block_size.unwrap_or(self.block_size),
            }))
            .collect()
    }

    /// Which tokenizer requests for `model` are tokenized with (an index into
    /// [`KvEventsConfig::all_files`]), if any.
    pub fn tokenizer_for(&self, model: &str) -> Option<usize> {
        if let Some(i) = self
            .tokenizers
            .iter()
            .position(|t| t.models.iter().any(|m| m == model))
        {
            return Some(i + 1);
        }
        (self.models.is_empty() || self.models.iter().any(|m| m == model)).then_some(0)
    }

    /// Whether requests for `model` are tokenized at all.
    #[cfg(test)]
    fn covers(&self, model: &str) -> bool {
        self.tokenizer_for(model).is_some()
    }
}

fn default_block_size() -> usize {
    16
}

fn default_budget_ms() -> u64 {
    50
}

fn default_max_bytes() -> usize {
    1 << 20
}

impl KvEventsConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (key, p) in [
            ("tokenizer", &self.tokenizer),
            ("tokenizer_config", &self.tokenizer_config),
        ] {
            if !p.is_absolute() {
                return Err(err(
                    format!("kvroute.kv_events.{key}"),
                    "must be an absolute path",
                ));
            }
        }
        if !(1..=4096).contains(&self.block_size) {
            return Err(err(
                "kvroute.kv_events.block_size",
                "must be between 1 and 4096",
            ));
        }
        if self.tokenize_budget_ms > 10_000 {
            return Err(err(
                "kvroute.kv_events.tokenize_budget_ms",
                "must be at most 10000",
            ));
        }
        if self.models.iter().any(|m| m.trim().is_empty()) {
            return Err(err(
                "kvroute.kv_events.models",
                "model names must not be empty",
            ));
        }
        let mut named: Vec<&str> = self.models.iter().map(String::as_str).collect();
        for (i, t) in self.tokenizers.iter().enumerate() {
            let key = |k: &str| format!("kvroute.kv_events.tokenizers[{i}].{k}");
            for (k, p) in [
                ("tokenizer", &t.tokenizer),
                ("tokenizer_config", &t.tokenizer_config),
            ] {
                if !p.is_absolute() {
                    return Err(err(key(k), "must be an absolute path"));
                }
            }
            if t.models.is_empty() || t.models.iter().any(|m| m.trim().is_empty()) {
                return Err(err(
                    key("models"),
                    "must name at least one model, and no name may be empty",
                ));
            }
            if t.block_size.is_some_and(|b| !(1..=4096).contains(&b)) {
                return Err(err(key("block_size"), "must be between 1 and 4096"));
            }
            // One model, one tokenizer: which of two would match its engines is a guess.
            if let Some(m) = t.models.iter().find(|m| named.contains(&m.as_str())) {
                return Err(err(
                    key("models"),
                    format!("{m:?} already has a tokenizer in kv_events"),
                ));
            }
            named.extend(t.models.iter().map(String::as_str));
        }
        if self.tokenize_max_bytes > 64 << 20 {
            return Err(err(
                "kvroute.kv_events.tokenize_max_bytes",
                "must be at most 64 MiB",
            ));
        }
        Ok(())
    }
}

/// A ZMQ endpoint kvroute can connect to: `tcp://host:port` or `ipc://path`.
pub(super) fn validate_endpoint(key: &str, endpoint: &str) -> Result<(), ConfigError> {
    let ok = match endpoint.split_once("://") {
        Some(("tcp", rest)) => rest.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && host != "*" && port.parse::<u16>().is_ok_and(|p| p > 0)
        }),
        Some(("ipc", rest)) => !rest.is_empty(),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(err(
            key,
            format!(
                "{endpoint:?} is not a ZMQ endpoint to connect to (tcp://host:port or ipc://path)"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_parallel_ranks_publish_at_offset_ports() {
        let k: BackendKvEvents = serde_yaml::from_str(
            "endpoint: tcp://10.0.0.5:5557\nreplay_endpoint: tcp://10.0.0.5:5600\ndata_parallel_size: 4\n",
        )
        .expect("parses");
        assert!(k.validate("k").is_ok());
        let r3 = k.for_rank(3);
        assert_eq!(r3.endpoint, "tcp://10.0.0.5:5560");
        assert_eq!(r3.replay_endpoint.as_deref(), Some("tcp://10.0.0.5:5603"));
        assert_eq!(
            (r3.data_parallel_size, k.for_rank(0).endpoint.as_str()),
            (1, "tcp://10.0.0.5:5557")
        );
        let one: BackendKvEvents = serde_yaml::from_str("endpoint: tcp://h:1\n").expect("parses");
        assert_eq!(one.data_parallel_size, 1);
        for (bad, key) in [
            (
                "endpoint: tcp://h:65534\ndata_parallel_size: 3\n",
                "k.endpoint",
            ),
            (
                "endpoint: ipc:///tmp/ev\ndata_parallel_size: 2\n",
                "k.endpoint",
            ),
            (
                "endpoint: tcp://h:1\nreplay_endpoint: tcp://h:65535\ndata_parallel_size: 2\n",
                "k.replay_endpoint",
            ),
            (
                "endpoint: tcp://h:1\ndata_parallel_size: 0\n",
                "k.data_parallel_size",
            ),
            (
                "endpoint: tcp://h:1\ndata_parallel_size: 65\n",
                "k.data_parallel_size",
            ),
        ] {
            let k: BackendKvEvents = serde_yaml::from_str(bad).expect("parses");
            assert_eq!(k.validate("k").expect_err(bad).key, key, "{bad}");
        }
    }

    #[test]
    fn models_it_covers() {
        let cfg: KvEventsConfig = serde_yaml::from_str(
            "tokenizer: /t/tokenizer.json\ntokenizer_config: /t/tokenizer_config.json\nmodels: [llama-8b, llama-8b-sql-lora]\n",
        )
        .expect("parses");
        assert!(cfg.covers("llama-8b") && cfg.covers("llama-8b-sql-lora"));
        assert!(!cfg.covers("qwen-7b"));
        let all = KvEventsConfig {
            models: Vec::new(),
            ..cfg.clone()
        };
        assert!(all.covers("qwen-7b"));
        let empty = KvEventsConfig {
            models: vec![" ".into()],
            ..cfg
        };
        assert_eq!(
            empty.validate().expect_err("empty name").key,
            "kvroute.kv_events.models"
        );
    }

    #[test]
    fn a_tokenizer_per_model_family() {
        let cfg: KvEventsConfig = serde_yaml::from_str(
            "tokenizer: /t/tokenizer.json\ntokenizer_config: /t/tokenizer_config.json\n\
             tokenizers:\n\
             - models: [qwen-7b, qwen-7b-lora]\n  tokenizer: /q/tokenizer.json\n  \
             tokenizer_config: /q/tokenizer_config.json\n  block_size: 32\n",
        )
        .expect("parses");
        cfg.validate().expect("valid");
        // Named in an entry: that entry, though the own tokenizer covers every model.
        assert_eq!(cfg.tokenizer_for("qwen-7b-lora"), Some(1));
        assert_eq!(cfg.tokenizer_for("llama-8b"), Some(0));
        let files = cfg.all_files();
        assert_eq!(files.len(), 2);
        assert_eq!(
            files[1].tokenizer,
            std::path::Path::new("/q/tokenizer.json")
        );
        assert_eq!((files[0].block_size, files[1].block_size), (16, 32));
        let listed = KvEventsConfig {
            models: vec!["llama-8b".into()],
            ..cfg.clone()
        };
        assert_eq!(listed.tokenizer_for("mistral-7b"), None);
        assert!(!listed.covers("mistral-7b") && listed.covers("qwen-7b"));

        let twice = KvEventsConfig {
            models: vec!["qwen-7b".into()],
            ..cfg.clone()
        };
        let e = twice.validate().expect_err("a model with two tokenizers");
        assert_eq!(e.key, "kvroute.kv_events.tokenizers[0].models");
        assert!(e.reason.contains("qwen-7b"), "{}", e.reason);
        let mut bad = cfg.clone();
        bad.tokenizers[0].models.clear();
        assert_eq!(
            bad.validate().expect_err("no models").key,
            "kvroute.kv_events.tokenizers[0].models"
        );
        let mut bad = cfg.clone();
        bad.tokenizers[0].tokenizer = "q/tokenizer.json".into();
        assert_eq!(
            bad.validate().expect_err("relative").key,
            "kvroute.kv_events.tokenizers[0].tokenizer"
        );
        let mut bad = cfg;
        bad.tokenizers[0].block_size = Some(0);
        assert_eq!(
            bad.validate().expect_err("block size").key,
            "kvroute.kv_events.tokenizers[0].block_size"
        );
    }

    #[test]
    fn endpoints() {
        for ok in [
            "tcp://127.0.0.1:5557",
            "tcp://engine-1.local:5557",
            "ipc:///run/vllm.sock",
        ] {
            assert!(validate_endpoint("k", ok).is_ok(), "{ok}");
        }
        for bad in [
            "127.0.0.1:5557",
            "tcp://*:5557",
            "tcp://h:0",
            "tcp://h:x",
            "udp://h:1",
            "ipc://",
        ] {
            let e =
                validate_endpoint("kvroute.backends[0].kv_events.endpoint", bad).expect_err(bad);
            assert_eq!(e.key, "kvroute.backends[0].kv_events.endpoint");
        }
    }
}
