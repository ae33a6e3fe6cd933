//! LoRA adapters on one simulated server, as vLLM's `--enable-lora` serves them: requests name
//! an adapter in `model`; an adapter not loaded is loaded first (the load time is added to the
//! request's time to first token), evicting the least recently used one once `--max-loras` are
//! loaded. `/v1/models` lists the adapters with their `parent`, and `/metrics` has vLLM's
//! `vllm:lora_requests_info` gauge.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Debug, Clone, Default)]
pub struct LoraConfig {
    /// Adapter names this server can load.
    pub adapters: Vec<String>,
    pub max_loras: usize,
    /// Wall-clock time one load takes (already time-scaled).
    pub load: Duration,
}

/// The adapters loaded now, least recently used first, and the loads so far.
#[derive(Debug, Default)]
pub struct LoraSlots {
    loaded: VecDeque<String>,
    loads: u64,
    /// Requests being served per adapter (the gauge's `running_lora_adapters`).
    running: Vec<(String, u64)>,
}

impl LoraSlots {
    /// A request for `model` starts: how long it waits for its adapter (zero when loaded),
    /// `None` when `model` is not one of `cfg`'s adapters.
    pub fn acquire(&mut self, cfg: &LoraConfig, model: &str) -> Option<Duration> {
        if !cfg.adapters.iter().any(|a| a == model) {
            return None;
        }
        match self.running.iter_mut().find(|(a, _)| a == model) {
            Some((_, n)) => *n += 1,
            None => self.running.push((model.to_string(), 1)),
        }
        if let Some(at) = self.loaded.iter().position(|a| a == model) {
            let a = self.loaded.remove(at).unwrap_or_default();
            self.loaded.push_back(a);
            return Some(Duration::ZERO);
        }
        if self.loaded.len() >= cfg.max_loras.max(1) {
            self.loaded.pop_front();
        }
        self.loaded.push_back(model.to_string());
        self.loads += 1;
        Some(cfg.load)
    }

    /// A request for adapter `model` ended.
    pub fn release(&mut self, model: &str) {
        if let Some(at) = self.running.iter().position(|(a, _)| a == model) {
            self.running[at].1 -= 1;
            if self.running[at].1 == 0 {
                self.running.remove(at);
            }
        }
    }

    pub fn loads(&self) -> u64 {
        self.loads
    }

    /// Loaded adapters, comma-separated, least recently used first.
    #[cfg(test)]
    pub fn loaded_list(&self) -> String {
        self.loaded.iter().cloned().collect::<Vec<_>>().join(",")
    }

    /// Adapters with requests being served, comma-separated.
    pub fn running_list(&self) -> String {
        let names: Vec<&str> = self.running.iter().map(|(a, _)| a.as_str()).collect();
        names.join(",")
    }
}

/// The adapter slot of one request, released when the request ends however it ends.
pub struct AdapterUse<'a> {
    slots: &'a Mutex<LoraSlots>,
    model: String,
}

impl<'a> AdapterUse<'a> {
    /// Acquire `model`'s adapter (if it is one): the guard and the load wait.
    pub fn start(
        slots: &'a Mutex<LoraSlots>,
        cfg: &LoraConfig,
        model: &str,
    ) -> (Option<AdapterUse<'a>>, Duration) {
        let Ok(mut s) = slots.lock() else {
            return (None, Duration::ZERO);
        };
        match s.acquire(cfg, model) {
            None => (None, Duration::ZERO),
            Some(wait) => (
                Some(AdapterUse {
                    slots,
                    model: model.to_string(),
                }),
                wait,
            ),
        }
    }
}

impl Drop for AdapterUse<'_> {
    fn drop(&mut self) {
        if let Ok(mut s) = self.slots.lock() {
            s.release(&self.model);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_load_once_and_the_least_recently_used_is_evicted() {
        let cfg = LoraConfig {
            adapters: vec!["a".into(), "b".into(), "c".into()],
            max_loras: 2,
            load: Duration::from_millis(100),
        };
        let mut s = LoraSlots::default();
        assert_eq!(s.acquire(&cfg, "base"), None);
        assert_eq!(s.acquire(&cfg, "a"), Some(Duration::from_millis(100)));
        assert_eq!(s.acquire(&cfg, "a"), Some(Duration::ZERO));
        assert_eq!(s.acquire(&cfg, "b"), Some(Duration::from_millis(100)));
        // a was used before b: c evicts a.
        s.acquire(&cfg, "a");
        assert_eq!(s.loaded_list(), "b,a");
        assert_eq!(s.acquire(&cfg, "c"), Some(Duration::from_millis(100)));
        assert_eq!(s.loaded_list(), "a,c");
        assert_eq!(s.loads(), 3);
        assert_eq!(s.running_list(), "a,b,c");
        for _ in 0..3 {
            s.release("a");
        }
        assert_eq!(s.running_list(), "b,c");
    }
}
