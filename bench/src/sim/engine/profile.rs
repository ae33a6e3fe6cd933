//! GPU/model profiles: the constants of the engine's step-time model
//! `t = t0 + prefill_tokens / prefill_rate + decode_seqs * t_seq + kv_tokens_read * t_kv`
//! and the size of its KV pool.
//!
//! Sources: "h100-llama8b" is the starting profile of `shared/bench.md` (an 8B model keeps
//! 128 KiB of KV per token and reads it at ~3.3 TB/s, hence ~40 ns per cached token per step).
//! The others are scaled from it by public datasheet ratios, not measured:
//! A100-80GB has ~0.5x the dense BF16 FLOPs of an H100 SXM (312 vs 989 TFLOPs, but prefill is
//! rarely at peak, so ~0.5x the prefill rate), ~0.6x its memory bandwidth (2.0 vs 3.35 TB/s,
//! so t_kv ~65 ns) and less free memory for KV once weights are loaded (~250k tokens).

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
    /// Per decoding sequence per step, seconds.
    pub t_seq: f64,
    /// Per cached token read by a decoding sequence per step, seconds.
    pub t_kv: f64,
    /// vLLM's `max_num_seqs`.
    pub max_num_seqs: usize,
    /// vLLM's `max_num_batched_tokens` (the per-step token budget).
    pub max_num_batched_tokens: u64,
}

/// One row per profile: (name, kv tokens, prefill tok/s, t0 ms, t_seq ms, t_kv ns).
/// L40S: ~0.36x H100 FLOPs (362 TFLOPs), 0.26x bandwidth (864 GB/s), 48 GB.
const TABLE: [(ProfileName, u64, f64, f64, f64, f64); 3] = [
    (ProfileName::H100Llama8b, 500_000, 25_000.0, 5.0, 0.05, 40.0),
    (ProfileName::A100Llama8b, 250_000, 12_000.0, 7.0, 0.07, 65.0),
    (ProfileName::L40sLlama8b, 150_000, 9_000.0, 8.0, 0.08, 150.0),
];

impl ProfileName {
    /// The name as the CLI spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ProfileName::H100Llama8b => "h100-llama8b",
            ProfileName::A100Llama8b => "a100-llama8b",
            ProfileName::L40sLlama8b => "l40s-llama8b",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        <Self as clap::ValueEnum>::from_str(s, false).map_err(|_| {
            let known: Vec<&str> = TABLE.iter().map(|r| r.0.as_str()).collect();
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
        let row = TABLE
            .iter()
            .find(|r| r.0 == name)
            .copied()
            .unwrap_or(TABLE[0]);
        let (name, kv_tokens, prefill_rate, t0_ms, t_seq_ms, t_kv_ns) = row;
        Self {
            name,
            kv_blocks: (kv_tokens / BLOCK_TOKENS) as usize,
            prefill_rate,
            t0: t0_ms / 1e3,
            t_seq: t_seq_ms / 1e3,
            t_kv: t_kv_ns / 1e9,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
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

    #[test]
    fn names_round_trip() {
        for row in TABLE {
            assert_eq!(ProfileName::parse(row.0.as_str()), Ok(row.0));
            assert_eq!(Profile::get(row.0).prefill_rate, row.2);
        }
        let err = ProfileName::parse("b200").unwrap_err();
        assert!(
            err.contains("h100-llama8b, a100-llama8b, l40s-llama8b"),
            "{err}"
        );
    }

    #[test]
    fn profiles_expand_in_order() {
        use ProfileName::*;
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
        use ProfileName::*;
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
