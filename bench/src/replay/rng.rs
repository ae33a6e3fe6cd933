//! A tiny seeded PRNG and deterministic filler text.
//!
//! Hand-rolled rather than a `rand` dependency: the generated prompts must stay byte-identical
//! across crate upgrades, or results from different days stop being comparable.

/// SplitMix64: small, fast, and good enough for arrival times and filler words.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, n); n must be > 0.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Exponential with the given rate (mean 1/rate): Poisson inter-arrival gaps.
    pub fn exp(&mut self, rate: f64) -> f64 {
        -(1.0 - self.next_f64()).ln() / rate
    }
}

/// The SplitMix64 finaliser, also used to derive independent seeds from ids.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D8_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Plain ASCII words, so cutting text at any byte offset stays valid UTF-8 and needs no JSON
/// escaping.
const WORDS: &[&str] = &[
    "cache", "token", "block", "prefix", "router", "server", "model", "prompt", "answer",
    "latency", "queue", "batch", "decode", "prefill", "memory", "tensor", "layer", "head",
    "vector", "matrix", "stream", "request", "session", "policy", "affinity", "replica", "gpu",
    "kernel", "warp", "thread", "index", "hash", "table", "page", "entry", "value", "alpha",
    "beta", "gamma", "delta", "river", "mountain", "forest", "ocean", "desert", "city", "garden",
    "bridge", "window", "engine", "signal", "planet", "orbit", "comet", "paper", "letter",
    "number", "market", "travel", "winter", "summer", "music", "story", "lantern",
];

/// Exactly `len` bytes of filler words derived from `seed` alone.
pub fn filler(seed: u64, len: usize) -> String {
    let mut rng = Rng::new(mix(seed));
    let mut out = String::with_capacity(len + 16);
    while out.len() < len {
        out.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
        out.push(' ');
    }
    out.truncate(len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence() {
        let a: Vec<u64> = (0..5)
            .map({
                let mut r = Rng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let mut r = Rng::new(7);
        let b: Vec<u64> = (0..5).map(|_| r.next_u64()).collect();
        assert_eq!(a, b);
    }

    #[test]
    fn filler_has_exact_length_and_is_deterministic() {
        for len in [0, 1, 7, 2048, 5000] {
            assert_eq!(filler(3, len).len(), len);
        }
        assert_eq!(filler(3, 300), filler(3, 300));
        assert_ne!(filler(3, 300), filler(4, 300));
        // A shorter cut is a prefix of a longer one: the last block of a prompt is a cut block.
        assert!(filler(9, 2048).starts_with(&filler(9, 100)));
    }

    #[test]
    fn floats_in_unit_interval() {
        let mut r = Rng::new(1);
        for _ in 0..1000 {
            let x = r.next_f64();
            assert!((0.0..1.0).contains(&x));
            assert!(r.exp(2.0) >= 0.0);
        }
    }
}
