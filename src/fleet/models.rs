//! Which backend serves which model, and the pool of backends each model is placed among.
//!
//! A backend serves the models its config lists (`backends[].models`); with none listed, the
//! ones its engine's `GET /v1/models` names (vLLM lists LoRA adapters there with their `parent`
//! base model); with neither known yet, every model, as before models were tracked. A model's
//! pool is its backends in fleet order with a ring of their own, so its load bound and
//! candidates are computed among them only; in-flight work stays per backend, since a GPU is
//! shared by every model it serves.

use serde::Deserialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::placement::Pool;

/// A configured model list holding this serves every model (llama.cpp and SGLang answer any
/// model name, so clients of such a fleet may send names the engine never lists).
pub const ANY_MODEL: &str = "*";

/// One model as an engine lists it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ModelEntry {
    pub id: String,
    /// The base model of a LoRA adapter.
    pub parent: Option<String>,
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ListedModel>,
}

#[derive(Deserialize)]
struct ListedModel {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

/// The models an OpenAI `GET /v1/models` answer lists; `None` if it is not one.
pub fn parse_model_list(body: &str) -> Option<Vec<ModelEntry>> {
    let list: ModelList = serde_json::from_str(body).ok()?;
    let mut out: Vec<ModelEntry> = list
        .data
        .into_iter()
        .filter(|m| !m.id.is_empty())
        .map(|m| ModelEntry {
            id: m.id,
            parent: m.parent.filter(|p| !p.is_empty()),
        })
        .collect();
    out.sort();
    out.dedup();
    Some(out)
}

/// Whether `list` (configured or discovered) names `model`, or serves any name.
pub fn lists(list: &[ModelEntry], model: &str) -> bool {
    list.iter().any(|m| m.id == model || m.id == ANY_MODEL)
}

/// Pools built so far, valid while the membership they were built from stands.
#[derive(Default)]
pub(super) struct PoolCache {
    inner: Mutex<(u64, HashMap<String, Arc<Pool>>)>,
}

impl PoolCache {
    /// The pool of `model` under membership `version`, built by `build` when not cached.
    pub fn get(&self, model: &str, version: u64, build: impl FnOnce() -> Pool) -> Arc<Pool> {
        let Ok(mut g) = self.inner.lock() else {
            return Arc::new(build());
        };
        if g.0 != version {
            *g = (version, HashMap::new());
        }
        if let Some(p) = g.1.get(model) {
            return p.clone();
        }
        let p = Arc::new(build());
        // Bounded: only models some backend serves are cached (unknown ones 404 before this),
        // and any membership change clears it.
        g.1.insert(model.to_string(), p.clone());
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_model_list_with_adapters_parses() {
        let body = r#"{"object":"list","data":[
            {"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model","parent":null},
            {"id":"sql-lora","object":"model","parent":"meta-llama/Llama-3.1-8B-Instruct"},
            {"id":"sql-lora","object":"model","parent":"meta-llama/Llama-3.1-8B-Instruct"}]}"#;
        let l = parse_model_list(body).unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l[1].id, "sql-lora");
        assert_eq!(
            l[1].parent.as_deref(),
            Some("meta-llama/Llama-3.1-8B-Instruct")
        );
        assert!(lists(&l, "sql-lora"));
        assert!(!lists(&l, "other"));
        let any = [ModelEntry {
            id: ANY_MODEL.into(),
            parent: None,
        }];
        assert!(lists(&any, "whatever-the-client-says"));
        assert_eq!(parse_model_list("<html>"), None);
        assert_eq!(parse_model_list(r#"{"data":[]}"#), Some(vec![]));
    }

    #[test]
    fn the_cache_follows_the_membership_version() {
        let cache = PoolCache::default();
        let pool = |m: Vec<usize>| {
            move || Pool {
                members: m,
                ring: None,
                listed: false,
                adapter: false,
            }
        };
        assert_eq!(cache.get("a", 1, pool(vec![0, 2])).members, vec![0, 2]);
        // Cached: the builder is not used again.
        assert_eq!(cache.get("a", 1, pool(vec![9])).members, vec![0, 2]);
        assert_eq!(cache.get("a", 2, pool(vec![1])).members, vec![1]);
        let p = cache.get("a", 2, pool(vec![]));
        assert_eq!((p.local(1), p.local(0)), (Some(0), None));
    }
}
