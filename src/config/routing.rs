//! `kvroute.routing`: the placement policy and its knobs. The defaults here are the only ones:
//! `placement::Params` is built from this section.

use http::HeaderName;
use serde::Deserialize;

use super::error::{err, ConfigError};

/// Bytes of canonical prompt per prefix block (about 64 tokens at ~4 bytes a token).
pub const BLOCK_BYTES: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Rotate over healthy backends, ignoring keys and load (baseline).
    RoundRobin,
    /// Fewest in-flight requests per unit of weight (baseline).
    LeastLoad,
    /// Plain consistent hashing on the session key, no load bound (sticky sessions).
    SessionHash,
    /// Consistent hashing with bounded loads: the owner unless it is over its bound, then the
    /// next ring positions.
    BoundedHash,
    /// Bounded hashing with the bound in work, plus the prefix index and a cost model: the
    /// admissible candidate with the lowest estimated time to first token.
    KvAware,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::SessionHash => "session_hash",
            PolicyKind::BoundedHash => "bounded_hash",
            PolicyKind::KvAware => "kv_aware",
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    pub policy: PolicyKind,
    /// Load bound headroom: a backend takes a request while
    /// `load + 1 <= ceil((1 + epsilon) * mean_load * weight_share) + slack`.
    pub epsilon: f64,
    /// Extra requests allowed over the bound, so low concurrency does not spill.
    pub slack: u32,
    /// kv_aware: prompt tokens that weigh as one more request in the load bound.
    pub work_unit_tokens: u64,
    /// kv_aware: ring positions considered besides backends holding a long prefix match.
    pub candidates: usize,
    /// kv_aware: requests with more uncached prompt tokens than this are placed by cost over
    /// the whole fleet.
    pub heavy_prefill_tokens: u64,
    /// kv_aware: cost, per decoding stream on a backend, of each second of prefill there.
    pub decode_stall_weight: f64,
    /// kv_aware: cost, per second of prefill, of recomputing a prefix another backend holds
    /// or is computing: the copy is work other requests then queue behind.
    pub duplicate_prefill_weight: f64,
    /// kv_aware: a backend whose engine reports more KV cache in use than this takes new
    /// requests only when no other can.
    pub kv_usage_ceiling: f64,
    /// kv_aware: what loading a LoRA adapter costs a request on a backend that does not have
    /// it loaded, in milliseconds (added to its predicted TTFT), until loads there have shown
    /// the real time.
    pub lora_load_ms: u64,
    /// kv_aware: leave the session key's owner for a backend holding a longer cached prefix
    /// only when it saves at least this many prompt tokens.
    pub min_prefix_saving_tokens: u64,
    /// kv_aware, one replica: a new conversation (no history, no prefix cached anywhere, fewer
    /// prompt tokens than `work_unit_tokens`, no LoRA adapter to load) goes to the backend with
    /// the least work per unit of weight (streams weighed by the backend's learned decode step)
    /// instead of its key's owner, and a later turn's home is the backend holding its history.
    pub balance_new_conversations: bool,
    /// kv_aware: how many kvroute processes route to this fleet side by side, sharing no
    /// state (a high-availability pair is 2). Above 1, a new conversation (no history, no
    /// prefix cached anywhere) stays with its key's owner while the owner is under its load
    /// bound: the other replicas, which would not see a placement elsewhere, send its next
    /// turns to the owner.
    pub replicas: u32,
    /// kv_aware: use each backend's prefill rate as its engine's own counters show it
    /// (vLLM, llama.cpp) once they hold enough evidence; the configured rate is the prior.
    pub learn_prefill_rate: bool,
    /// Count a prompt's tokens when its canonical text is at most this many bytes, inline on
    /// the proxy's worker thread (~0.1 ms per KB). 0 (the default): none.
    pub count_tokens_max_bytes: usize,
    /// Count larger prompts, up to this many bytes, on a blocking thread while the request
    /// waits; larger ones are estimated from their size. 0: never off-thread. With both limits
    /// 0 the BPE tables are not loaded. Every estimate is corrected per model by the engines'
    /// `usage`.
    pub count_tokens_offthread_max_bytes: usize,
    /// What counts: `o200k_base` (built in) or the absolute path of a tiktoken rank file
    /// (`<base64 token> <rank>` per line).
    pub tokenizer: String,
    /// A rank file's pre-tokenizer split pattern: `o200k_base`, `cl100k_base` (Llama 3's
    /// `tokenizer.model` uses this one) or a regex. Unset: `o200k_base`.
    pub tokenizer_pattern: Option<String>,
    /// Where a request's session key comes from, first found wins; without any, the key is a
    /// hash of the conversation's opening.
    pub session_keys: Vec<KeySource>,
    /// A file whose contents (at least 32 bytes) key the MAC in the response ids kvroute
    /// stamps with the backend that stored a response. Every replica and every process after
    /// an upgrade must share it; unset, a key of this process's own (lost on restart).
    pub response_id_key_file: Option<String>,
}

/// One place a session key may be read from: `header:NAME`, or `body:FIELD` with FIELD one of
/// `prompt_cache_key`, `metadata.user_id`, `user`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum KeySource {
    Header(HeaderName),
    Body(BodyKey),
}

/// A request body field that names a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKey {
    /// OpenAI's `prompt_cache_key` (chat, completions, Responses): set for exactly this
    /// purpose (Codex sends its conversation id there).
    PromptCacheKey,
    /// Anthropic's `metadata.user_id` (Claude Code's holds its session id).
    MetadataUserId,
    /// OpenAI's `user`: one end user, who may run several conversations.
    User,
}

/// The default `routing.session_keys`: kvroute's own header, then the ones agents send
/// (`x-session-affinity` is the Responses-era convention several gateways read; Claude Code
/// sends `x-claude-code-session-id`, Codex `session_id`), then body fields from the most to the
/// least specific.
pub const DEFAULT_SESSION_KEYS: [KeySource; 8] = [
    KeySource::Header(HeaderName::from_static("x-session-id")),
    KeySource::Header(HeaderName::from_static("x-session-affinity")),
    KeySource::Header(HeaderName::from_static("x-claude-code-session-id")),
    KeySource::Header(HeaderName::from_static("session_id")),
    KeySource::Header(HeaderName::from_static("session-id")),
    KeySource::Body(BodyKey::PromptCacheKey),
    KeySource::Body(BodyKey::MetadataUserId),
    KeySource::Body(BodyKey::User),
];

impl TryFrom<String> for KeySource {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        if let Some(name) = s.strip_prefix("header:") {
            return HeaderName::from_bytes(name.trim().as_bytes())
                .map(KeySource::Header)
                .map_err(|_| format!("`{s}`: `{name}` is not a valid header name"));
        }
        match s.strip_prefix("body:") {
            Some("prompt_cache_key") => Ok(KeySource::Body(BodyKey::PromptCacheKey)),
            Some("metadata.user_id") => Ok(KeySource::Body(BodyKey::MetadataUserId)),
            Some("user") => Ok(KeySource::Body(BodyKey::User)),
            _ => Err(format!(
                "`{s}` is not a session key source: use header:NAME, body:prompt_cache_key, \
                 body:metadata.user_id or body:user"
            )),
        }
    }
}

/// The built-in tokenizer's name in `routing.tokenizer`.
const O200K_BASE: &str = "o200k_base";

/// Largest `count_tokens_offthread_max_bytes`: one count of it takes a core for about 1.5 s.
const MAX_OFFTHREAD_BYTES: usize = 16 << 20;

impl RoutingConfig {
    /// Estimated tokens per prefix block (about 4 bytes a token).
    pub fn block_tokens(&self) -> u64 {
        (BLOCK_BYTES / 4) as u64
    }

    /// Whether any prompt is counted (and so whether the BPE tables are needed).
    pub fn counts_tokens(&self) -> bool {
        self.count_tokens_max_bytes > 0 || self.count_tokens_offthread_max_bytes > 0
    }

    /// The tiktoken rank file to count with; `None`: the built-in o200k_base.
    pub fn rank_file(&self) -> Option<&std::path::Path> {
        (self.tokenizer != O200K_BASE).then(|| std::path::Path::new(&self.tokenizer))
    }
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            policy: PolicyKind::KvAware,
            // A spill off the backend holding a request's prefix recomputes the prefix
            // elsewhere, while one more decode stream costs an engine step a fraction of a
            // millisecond: kv_aware's bound is there to stop pile-ups (a hot key's 4x), and
            // twice the fair share does that. Against 0.5 and 0.75, five workloads, two runs
            // each (docs/results/defaults.md): TTFT p90 on ladder 33-35 ms against
            // 146-154, hot_prefix 66-103 against 179-181, the others' TTFT tied, some
            // end-to-end p99s up to 1.2x.
            epsilon: 1.0,
            slack: 1,
            work_unit_tokens: 4096,
            candidates: 3,
            heavy_prefill_tokens: 8192,
            // A long prefill stalls every stream decoding beside it (its chunks share their
            // steps): at 0.02 that was priced near nothing, and documents' streams decoded
            // behind other documents' prefills. Five workloads, two or three runs each
            // (docs/results/defaults.md): e2e p99 0.82-0.86x on heavy_mix, mooncake and
            // the ladder, TTFT and hit rate unchanged; 0.3 did no better and cost mooncake hits.
            decode_stall_weight: 0.1,
            duplicate_prefill_weight: 1.0,
            kv_usage_ceiling: 0.9,
            lora_load_ms: 200,
            min_prefix_saving_tokens: 1024,
            balance_new_conversations: false,
            replicas: 1,
            learn_prefill_rate: true,
            // Off: a count costs ~0.1 ms per KB of prompt, several times kvroute's whole
            // per-request work, and placement measured the same with sized estimates (bytes
            // times the tokens per byte the engines report), docs/results/proxy-cost.md.
            count_tokens_max_bytes: 0,
            count_tokens_offthread_max_bytes: 0,
            tokenizer: O200K_BASE.to_string(),
            tokenizer_pattern: None,
            session_keys: DEFAULT_SESSION_KEYS.to_vec(),
            response_id_key_file: None,
        }
    }
}

impl RoutingConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.count_tokens_max_bytes > 1 << 20 {
            return Err(err(
                "kvroute.routing.count_tokens_max_bytes",
                "must be at most 1048576 (counting runs on the proxy's worker threads)",
            ));
        }
        let offthread = self.count_tokens_offthread_max_bytes;
        if offthread > MAX_OFFTHREAD_BYTES {
            return Err(err(
                "kvroute.routing.count_tokens_offthread_max_bytes",
                format!("must be at most {MAX_OFFTHREAD_BYTES} (a count takes ~0.1 s per MiB)"),
            ));
        }
        if offthread != 0 && offthread < self.count_tokens_max_bytes {
            return Err(err(
                "kvroute.routing.count_tokens_offthread_max_bytes",
                "must be 0 (off) or at least count_tokens_max_bytes (it takes the prompts too \
                 long to count inline)",
            ));
        }
        if self.tokenizer != O200K_BASE && !std::path::Path::new(&self.tokenizer).is_absolute() {
            return Err(err(
                "kvroute.routing.tokenizer",
                format!(
                    "`{}` is neither {O200K_BASE} nor an absolute path to a tiktoken rank file",
                    self.tokenizer
                ),
            ));
        }
        if self.tokenizer != O200K_BASE && !self.counts_tokens() {
            return Err(err(
                "kvroute.routing.tokenizer",
                "names a rank file, but nothing is counted (counting is off by default): set \
                 count_tokens_max_bytes and/or count_tokens_offthread_max_bytes",
            ));
        }
        match &self.tokenizer_pattern {
            Some(_) if self.tokenizer == O200K_BASE => {
                return Err(err(
                    "kvroute.routing.tokenizer_pattern",
                    "applies to a rank file only (o200k_base has its own)",
                ))
            }
            Some(p) if p.is_empty() => {
                return Err(err(
                    "kvroute.routing.tokenizer_pattern",
                    "must not be empty",
                ))
            }
            _ => {}
        }
        if !(self.epsilon.is_finite() && self.epsilon >= 0.0 && self.epsilon <= 100.0) {
            return Err(err("kvroute.routing.epsilon", "must be between 0 and 100"));
        }
        if let Some(dup) = self
            .session_keys
            .iter()
            .enumerate()
            .find(|(i, k)| self.session_keys[..*i].contains(k))
        {
            return Err(err(
                "kvroute.routing.session_keys",
                format!("lists {:?} twice", dup.1),
            ));
        }
        if !(1..=64).contains(&self.replicas) {
            return Err(err("kvroute.routing.replicas", "must be between 1 and 64"));
        }
        Ok(())
    }

    /// The kv_aware knobs, checked once the backend count is known (see `Config::validate`).
    pub(super) fn validate_kv_aware(&self) -> Result<(), ConfigError> {
        if self.work_unit_tokens == 0 {
            return Err(err("kvroute.routing.work_unit_tokens", "must be positive"));
        }
        if self.candidates == 0 {
            return Err(err("kvroute.routing.candidates", "must be at least 1"));
        }
        if !(self.decode_stall_weight.is_finite() && self.decode_stall_weight >= 0.0) {
            return Err(err("kvroute.routing.decode_stall_weight", "must be >= 0"));
        }
        if !(self.duplicate_prefill_weight.is_finite()
            && (0.0..=100.0).contains(&self.duplicate_prefill_weight))
        {
            return Err(err(
                "kvroute.routing.duplicate_prefill_weight",
                "must be between 0 and 100",
            ));
        }
        if !(self.kv_usage_ceiling > 0.0 && self.kv_usage_ceiling <= 1.0) {
            return Err(err("kvroute.routing.kv_usage_ceiling", "must be in (0, 1]"));
        }
        if self.lora_load_ms > 600_000 {
            return Err(err(
                "kvroute.routing.lora_load_ms",
                "must be at most 600000 (ten minutes)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn routing(keys: &str) -> Result<Config, crate::config::ConfigError> {
        Config::from_yaml(&format!(
            "kvroute:\n  listen: \"127.0.0.1:1\"\n  backends:\n    - addr: \"127.0.0.1:2\"\n  \
             routing:\n{keys}"
        ))
    }

    #[test]
    fn token_counting_defaults() {
        let r = routing("    policy: kv_aware\n").unwrap().routing;
        assert_eq!(r.count_tokens_max_bytes, 0);
        assert_eq!(r.count_tokens_offthread_max_bytes, 0);
        assert_eq!(
            (r.tokenizer.as_str(), r.tokenizer_pattern.as_deref()),
            ("o200k_base", None)
        );
        assert!(!r.counts_tokens());
        let on =
            "    count_tokens_max_bytes: 8192\n    count_tokens_offthread_max_bytes: 1048576\n";
        assert!(routing(on).unwrap().routing.counts_tokens());
        // Everything off-thread, nothing inline, is a valid choice.
        let r = routing("    count_tokens_offthread_max_bytes: 65536\n")
            .unwrap()
            .routing;
        assert!(r.counts_tokens());
        let file =
            "    tokenizer: /etc/kvroute/llama3.tiktoken\n    tokenizer_pattern: cl100k_base\n    count_tokens_max_bytes: 8192\n";
        let r = routing(file).unwrap().routing;
        assert_eq!(r.tokenizer, "/etc/kvroute/llama3.tiktoken");
        assert_eq!(r.tokenizer_pattern.as_deref(), Some("cl100k_base"));
    }

    #[test]
    fn session_key_sources() {
        use super::{BodyKey, KeySource, DEFAULT_SESSION_KEYS};
        let r = routing("    policy: kv_aware\n").unwrap().routing;
        assert_eq!(r.session_keys, DEFAULT_SESSION_KEYS.to_vec());
        let r = routing("    session_keys: [\"header:X-Agent-Run\", \"body:user\"]\n")
            .unwrap()
            .routing;
        assert_eq!(
            r.session_keys,
            vec![
                KeySource::Header(http::HeaderName::from_static("x-agent-run")),
                KeySource::Body(BodyKey::User)
            ]
        );
        assert!(routing("    session_keys: []\n")
            .unwrap()
            .routing
            .session_keys
            .is_empty());
        for (keys, reason) in [
            ("[\"body:messages\"]", "not a session key source"),
            ("[\"cookie:sid\"]", "not a session key source"),
            ("[\"header:bad name\"]", "not a valid header name"),
        ] {
            let e = routing(&format!("    session_keys: {keys}\n")).unwrap_err();
            assert!(e.to_string().contains(reason), "{keys}: {e}");
        }
        let e = routing("    session_keys: [\"body:user\", \"body:user\"]\n").unwrap_err();
        assert_eq!(e.key, "kvroute.routing.session_keys", "{e}");
    }

    #[test]
    fn token_counting_keys_are_checked() {
        let cases = [
            (
                "    count_tokens_offthread_max_bytes: 16777217\n",
                "kvroute.routing.count_tokens_offthread_max_bytes",
                "at most 16777216",
            ),
            (
                "    count_tokens_max_bytes: 8192\n    count_tokens_offthread_max_bytes: 4096\n",
                "kvroute.routing.count_tokens_offthread_max_bytes",
                "at least count_tokens_max_bytes",
            ),
            (
                "    tokenizer: llama3.tiktoken\n",
                "kvroute.routing.tokenizer",
                "absolute path",
            ),
            (
                "    tokenizer: cl100k_base\n",
                "kvroute.routing.tokenizer",
                "neither o200k_base",
            ),
            (
                "    tokenizer: /t.tiktoken\n",
                "kvroute.routing.tokenizer",
                "nothing is counted",
            ),
            (
                "    tokenizer_pattern: cl100k_base\n",
                "kvroute.routing.tokenizer_pattern",
                "rank file only",
            ),
            (
                "    tokenizer: /t.tiktoken\n    tokenizer_pattern: \"\"\n    count_tokens_max_bytes: 8192\n",
                "kvroute.routing.tokenizer_pattern",
                "empty",
            ),
        ];
        for (keys, key, reason) in cases {
            let e = routing(keys).unwrap_err();
            assert_eq!(e.key, key, "{keys}: {e}");
            assert!(e.reason.contains(reason), "{keys}: {e}");
        }
    }
}
