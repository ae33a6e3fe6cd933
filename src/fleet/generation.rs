//! A generation: the config in force and the fleet built from it, published together by one
//! atomic swap. A request pins the generation it started with, so it never sees a config from
//! one reload and a fleet from another.

use arc_swap::ArcSwap;
use std::sync::Arc;

use super::roster::Fleet;
use crate::config::Config;
use crate::request::engine_tokens::EngineTokenizers;
use crate::request::response_id::ResponseIds;

pub struct Generation {
    pub config: Config,
    /// Shared with the scrape loop's tasks, which outlive a generation's swap.
    pub fleet: Arc<Fleet>,
    /// The engines' chat templates and tokenizers (`kvroute.kv_events`), loaded with the
    /// config.
    pub engine_tokens: Option<Arc<EngineTokenizers>>,
    /// Stamps and opens the ids of stored responses (`routing.response_id_key_file`).
    pub response_ids: ResponseIds,
}

impl Generation {
    pub fn new(
        config: Config,
        fleet: Fleet,
        engine_tokens: Option<Arc<EngineTokenizers>>,
        response_ids: ResponseIds,
    ) -> Generation {
        Generation {
            config,
            fleet: Arc::new(fleet),
            engine_tokens,
            response_ids,
        }
    }
}

/// The generation in force.
pub struct Current(ArcSwap<Generation>);

impl Current {
    pub fn new(first: Generation) -> Current {
        Current(ArcSwap::from_pointee(first))
    }

    /// The generation in force now; hold it for as long as one consistent view is needed.
    pub fn load(&self) -> Arc<Generation> {
        self.0.load_full()
    }

    /// Replace the generation in force. Holders of the old one keep it until they drop it.
    pub fn publish(&self, next: Generation) {
        self.0.store(Arc::new(next));
    }
}
