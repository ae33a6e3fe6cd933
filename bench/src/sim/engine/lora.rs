//! LoRA adapters on one simulated server, as vLLM's `--enable-lora` serves them: requests name
//! an adapter in `model`; an adapter not loaded is loaded first (the load time is added to the
//! request's time to first token) into one of `--max-loras` slots, evicting the least recently
//! used adapter that no running request holds. As in vLLM's scheduler, the adapters of running
//! requests never exceed `--max-loras`: when every slot is held, a request for another adapter
//! waits until one frees. `/v1/models` lists the adapters with their `parent`, and `/metrics`
//! has vLLM's `vllm:lora_requests_info` gauge (running and waiting adapters).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

#[derive(Debug, Clone, Default)]
pub struct LoraConfig {
    /// Adapter names this server can load.
    pub adapters: Vec<String>,
    pub max_loras: usize,
    /// Wall-clock time one load takes (already time-scaled).
    pub load: Duration,
}

/// What a request for an adapter gets now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// `model` is not one of the adapters (a base model).
    NotAdapter,
    /// Its slot, after this long to load it (zero when loaded).
    Slot(Duration),
    /// Every slot is held by running requests of other adapters.
    Full,
}

/// The adapters loaded now, least recently used first, and the loads so far.
#[derive(Debug, Default)]
pub struct LoraSlots {
    loaded: VecDeque<String>,
    loads: u64,
    /// Requests being served per adapter (the gauge's `running_lora_adapters`).
    running: Vec<(String, u64)>,
    /// Requests waiting for a slot per adapter (`waiting_lora_adapters`).
    waiting: Vec<(String, u64)>,
}

fn bump(list: &mut Vec<(String, u64)>, model: &str, up: bool) {
    match list.iter().position(|(a, _)| a == model) {
        Some(at) if up => list[at].1 += 1,
        Some(at) => {
            list[at].1 -= 1;
            if list[at].1 == 0 {
                list.remove(at);
            }
        }
        None if up => list.push((model.to_string(), 1)),
        None => {}
    }
}

impl LoraSlots {
    /// A request for `model` asks for its adapter.
    pub fn acquire(&mut self, cfg: &LoraConfig, model: &str) -> Acquired {
        if !cfg.adapters.iter().any(|a| a == model) {
            return Acquired::NotAdapter;
        }
        if let Some(at) = self.loaded.iter().position(|a| a == model) {
            let a = self.loaded.remove(at).unwrap_or_default();
            self.loaded.push_back(a);
            bump(&mut self.running, model, true);
            return Acquired::Slot(Duration::ZERO);
        }
        if self.loaded.len() >= cfg.max_loras.max(1) {
            let idle = self
                .loaded
                .iter()
                .position(|a| !self.running.iter().any(|(r, _)| r == a));
            match idle {
                Some(at) => {
                    self.loaded.remove(at);
                }
                None => return Acquired::Full,
            }
        }
        self.loaded.push_back(model.to_string());
        self.loads += 1;
        bump(&mut self.running, model, true);
        Acquired::Slot(cfg.load)
    }

    /// A request for adapter `model` ended.
    pub fn release(&mut self, model: &str) {
        bump(&mut self.running, model, false);
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

    /// Adapters with requests waiting for a slot, comma-separated.
    pub fn waiting_list(&self) -> String {
        let names: Vec<&str> = self.waiting.iter().map(|(a, _)| a.as_str()).collect();
        names.join(",")
    }
}

/// One server's adapter slots, and the signal that one was released.
#[derive(Default)]
pub struct Lora {
    pub slots: Mutex<LoraSlots>,
    freed: Notify,
}

/// The adapter slot of one request, released when the request ends however it ends (its
/// holder keeps it until the response body is done or dropped).
pub struct AdapterUse {
    lora: Arc<Lora>,
    model: String,
}

impl AdapterUse {
    /// Acquire `model`'s adapter (if it is one), waiting for a slot when all are held: the
    /// guard and the load time still to wait.
    pub async fn start(
        lora: &Arc<Lora>,
        cfg: &LoraConfig,
        model: &str,
    ) -> (Option<AdapterUse>, Duration) {
        let mut waiting = false;
        loop {
            // Registered before the check, so a release between the two is not missed.
            let freed = lora.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let got = {
                let Ok(mut s) = lora.slots.lock() else {
                    return (None, Duration::ZERO);
                };
                let got = s.acquire(cfg, model);
                match (got, waiting) {
                    (Acquired::Full, false) => bump(&mut s.waiting, model, true),
                    (Acquired::Full, true) | (_, false) => {}
                    (_, true) => bump(&mut s.waiting, model, false),
                }
                got
            };
            match got {
                Acquired::NotAdapter => return (None, Duration::ZERO),
                Acquired::Slot(wait) => {
                    let guard = AdapterUse {
                        lora: lora.clone(),
                        model: model.to_string(),
                    };
                    return (Some(guard), wait);
                }
                Acquired::Full => {
                    waiting = true;
                    freed.await;
                }
            }
        }
    }
}

impl Drop for AdapterUse {
    fn drop(&mut self) {
        if let Ok(mut s) = self.lora.slots.lock() {
            s.release(&self.model);
        }
        self.lora.freed.notify_waiters();
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
        let load = Acquired::Slot(Duration::from_millis(100));
        let mut s = LoraSlots::default();
        assert_eq!(s.acquire(&cfg, "base"), Acquired::NotAdapter);
        assert_eq!(s.acquire(&cfg, "a"), load);
        assert_eq!(s.acquire(&cfg, "a"), Acquired::Slot(Duration::ZERO));
        assert_eq!(s.acquire(&cfg, "b"), load);
        // Both slots are held by running requests: c must wait.
        assert_eq!(s.acquire(&cfg, "c"), Acquired::Full);
        assert_eq!(s.running_list(), "a,b");
        // b's request ends; a is used again, so b is the least recently used idle one.
        s.release("b");
        s.acquire(&cfg, "a");
        assert_eq!(s.loaded_list(), "b,a");
        assert_eq!(s.acquire(&cfg, "c"), load);
        assert_eq!(s.loaded_list(), "a,c");
        assert_eq!(s.loads(), 3);
        assert_eq!(s.running_list(), "a,c");
        for _ in 0..3 {
            s.release("a");
        }
        assert_eq!(s.running_list(), "c");
    }

    #[tokio::test]
    async fn a_request_waits_for_a_slot_and_gets_it_when_one_frees() {
        let cfg = LoraConfig {
            adapters: vec!["a".into(), "b".into()],
            max_loras: 1,
            load: Duration::from_millis(5),
        };
        let lora = Arc::new(Lora::default());
        let (held, wait) = AdapterUse::start(&lora, &cfg, "a").await;
        assert_eq!(wait, Duration::from_millis(5));
        let waiter = AdapterUse::start(&lora, &cfg, "b");
        tokio::pin!(waiter);
        // b cannot start while a's request runs, and shows as waiting.
        let early = tokio::time::timeout(Duration::from_millis(50), waiter.as_mut()).await;
        assert!(early.is_err());
        assert_eq!(lora.slots.lock().unwrap().waiting_list(), "b");
        drop(held);
        let (got, wait) = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("b gets the freed slot");
        assert!(got.is_some());
        assert_eq!(wait, Duration::from_millis(5));
        let s = lora.slots.lock().unwrap();
        assert_eq!(
            (s.waiting_list(), s.running_list(), s.loads()),
            (String::new(), "b".into(), 2)
        );
    }
}
