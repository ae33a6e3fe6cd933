//! Prompt token estimates: counted with tiktoken-rs (o200k_base) where that is cheap, corrected
//! per model by what the engines report in `usage.prompt_tokens` (their tokenizer is not the
//! router's), and for large prompts estimated from their size at the bytes-per-token ratio the
//! engines showed for that model.
//!
//! The BPE tables take ~120 ms and ~45 MiB to load, so they load once on a background thread;
//! until they are in, every prompt is estimated from its size. Counting runs inline on the
//! proxy's worker thread only for canonical prompts up to `inline_limit` bytes (~0.1 ms per KB),
//! so a large document never stalls other connections.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};
use tiktoken_rs::CoreBPE;

/// Bytes per token assumed for a model no engine has reported on yet.
const PRIOR_BYTES_PER_TOKEN: f64 = 4.0;
/// Weight of one engine report in the per-model ratios: a few dozen requests settle them.
const LEARNING_WEIGHT: f64 = 0.05;
/// Models tracked; past this, new models use the priors (a client cannot grow the map).
const MAX_MODELS: usize = 1024;

/// How one prompt's tokens were estimated, kept until the engine's `usage` settles it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenEstimate {
    /// The estimate placement and quotas use.
    pub tokens: u64,
    /// The tiktoken count it came from, when the prompt was counted.
    pub counted: Option<u64>,
    /// Canonical prompt bytes.
    pub bytes: usize,
}

/// Per model: engine tokens per tiktoken token, and engine tokens per prompt byte.
#[derive(Debug, Clone, Copy)]
struct Ratios {
    per_counted: f64,
    per_byte: f64,
}

impl Default for Ratios {
    fn default() -> Self {
        Ratios {
            per_counted: 1.0,
            per_byte: 1.0 / PRIOR_BYTES_PER_TOKEN,
        }
    }
}

/// Moves `old` a step toward `sample`, in log space, clamped to `[lo, hi]`.
fn settle(old: f64, sample: f64, lo: f64, hi: f64) -> f64 {
    if !(sample.is_finite() && sample > 0.0) {
        return old;
    }
    (old.ln() * (1.0 - LEARNING_WEIGHT) + sample.ln() * LEARNING_WEIGHT)
        .exp()
        .clamp(lo, hi)
}

#[derive(Default)]
pub struct TokenEstimator {
    bpe: Arc<OnceLock<CoreBPE>>,
    loading: std::sync::atomic::AtomicBool,
    /// Read on every request, written once per answered one: readers never wait on each other.
    models: RwLock<HashMap<String, Ratios>>,
}

impl TokenEstimator {
    /// Load the BPE tables on a background thread, once; prompts are estimated by size until
    /// then.
    pub fn warm(&self) {
        if self
            .loading
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        let cell = self.bpe.clone();
        let spawned = std::thread::Builder::new()
            .name("kvroute-tokenizer".into())
            .spawn(move || match tiktoken_rs::o200k_base() {
                Ok(bpe) => {
                    let _ = cell.set(bpe);
                }
                Err(e) => log::error!(
                    "o200k_base tables did not load, prompts are estimated by size: {e}"
                ),
            });
        if let Err(e) = spawned {
            log::error!("cannot start the tokenizer loader, prompts are estimated by size: {e}");
        }
    }

    /// Wait for the tables (tests and benchmarks).
    pub fn warm_now(&self) {
        if let Ok(bpe) = tiktoken_rs::o200k_base() {
            let _ = self.bpe.set(bpe);
        }
    }

    /// `text` is the canonical prompt, `bytes` its length; it is counted when it is at most
    /// `inline_limit` bytes and the tables are in.
    pub fn estimate(
        &self,
        model: &str,
        text: Option<&[u8]>,
        bytes: usize,
        inline_limit: usize,
    ) -> TokenEstimate {
        let ratios = self.ratios(model);
        let counted = match (text, self.bpe.get()) {
            (Some(t), Some(bpe)) if t.len() <= inline_limit => {
                Some(bpe.count_ordinary(&String::from_utf8_lossy(t)) as u64)
            }
            _ => None,
        };
        let tokens = match counted {
            Some(c) => (c as f64 * ratios.per_counted).round() as u64,
            None => (bytes as f64 * ratios.per_byte).ceil() as u64,
        };
        TokenEstimate {
            tokens: tokens.max(u64::from(bytes > 0)),
            counted,
            bytes,
        }
    }

    /// The engine reported `engine_tokens` for a prompt estimated as `est`.
    pub fn learn(&self, model: &str, est: &TokenEstimate, engine_tokens: u64) {
        if engine_tokens == 0 || est.bytes == 0 {
            return;
        }
        let Ok(mut models) = self.models.write() else {
            return;
        };
        if !models.contains_key(model) && models.len() >= MAX_MODELS {
            return;
        }
        let r = models.entry(model.to_owned()).or_default();
        let engine = engine_tokens as f64;
        if let Some(c) = est.counted.filter(|&c| c > 0) {
            r.per_counted = settle(r.per_counted, engine / c as f64, 0.25, 4.0);
        }
        r.per_byte = settle(r.per_byte, engine / est.bytes as f64, 0.02, 2.0);
    }

    fn ratios(&self, model: &str) -> Ratios {
        self.models
            .read()
            .ok()
            .and_then(|m| m.get(model).copied())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: usize = 4096;

    #[test]
    fn counts_small_prompts_and_sizes_large_ones() {
        let t = TokenEstimator::default();
        // Before the tables load: by size.
        let e = t.estimate("m", Some(b"hello world"), 11, LIMIT);
        assert_eq!((e.tokens, e.counted), (3, None));
        t.warm_now();
        let e = t.estimate("m", Some(b"hello world"), 11, LIMIT);
        assert_eq!((e.tokens, e.counted), (2, Some(2)));
        // Over the inline limit: by size even with the tables in.
        let big = vec![b'a'; 8192];
        let e = t.estimate("m", Some(&big), big.len(), LIMIT);
        assert_eq!((e.tokens, e.counted), (2048, None));
    }

    #[test]
    fn engine_reports_correct_both_paths_per_model() {
        let t = TokenEstimator::default();
        t.warm_now();
        let text = "the quick brown fox jumps over the lazy dog ".repeat(20);
        let small = t.estimate("m", Some(text.as_bytes()), text.len(), LIMIT);
        let counted = small.counted.unwrap();
        // This engine's tokenizer gives 30% more tokens than o200k and 3 bytes a token.
        let big = t.estimate("m", None, 30_000, LIMIT);
        for _ in 0..200 {
            t.learn("m", &small, (counted as f64 * 1.3).round() as u64);
            t.learn("m", &big, 10_000);
        }
        let again = t.estimate("m", Some(text.as_bytes()), text.len(), LIMIT);
        let want = counted as f64 * 1.3;
        assert!(
            (again.tokens as f64 / want - 1.0).abs() < 0.03,
            "{again:?} vs {want}"
        );
        let big = t.estimate("m", None, 30_000, LIMIT);
        // Both kinds of report move the per-byte ratio; it ends between them, near 1/3.
        assert!((big.tokens as f64 / 10_000.0 - 1.0).abs() < 0.35, "{big:?}");
        // Another model is untouched.
        assert_eq!(t.estimate("other", None, 400, LIMIT).tokens, 100);
    }

    #[test]
    fn nonsense_reports_change_nothing() {
        let t = TokenEstimator::default();
        t.warm_now();
        let e = t.estimate("m", Some(b"abcd"), 4, 0);
        assert_eq!(e.counted, None, "counting is off");
        t.learn("m", &e, 0);
        t.learn("m", &TokenEstimate { bytes: 0, ..e }, 10);
        assert_eq!(t.estimate("m", None, 400, LIMIT).tokens, 100);
    }
}
