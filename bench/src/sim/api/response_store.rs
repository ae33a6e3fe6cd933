//! Finished Responses answers kept in memory (`store`, OpenAI's default), for
//! `previous_response_id` and the `GET`/`DELETE /v1/responses/{id}` routes. Bounded: past
//! `capacity` the oldest goes first, so a long benchmark cannot grow the process without
//! limit. Each keeps its conversation as a shared `Thread`, so a follow-up turn costs only its
//! own items.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::Value;

use crate::sim::text::responses::Thread;

pub const STORE_CAPACITY: usize = 10_000;

#[derive(Debug, Clone)]
pub struct Stored {
    /// The response object as its answer gave it.
    pub response: Value,
    pub thread: Arc<Thread>,
}

#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<String, Stored>,
    /// Insertion order; may still name deleted ids, skipped when evicting.
    order: VecDeque<String>,
}

impl ResponseStore {
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::default(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn put(&self, id: String, stored: Stored) {
        let mut inner = self.lock();
        if inner.by_id.insert(id.clone(), stored).is_none() {
            inner.order.push_back(id);
        }
        while inner.by_id.len() > self.capacity {
            match inner.order.pop_front() {
                Some(old) => {
                    inner.by_id.remove(&old);
                }
                None => break,
            }
        }
        // Deleted ids would otherwise pile up in `order` under put-and-delete traffic.
        if inner.order.len() > 2 * self.capacity {
            let Inner { by_id, order } = &mut *inner;
            order.retain(|id| by_id.contains_key(id));
        }
    }

    pub fn get(&self, id: &str) -> Option<Stored> {
        self.lock().by_id.get(id).cloned()
    }

    pub fn thread(&self, id: &str) -> Option<Arc<Thread>> {
        self.lock().by_id.get(id).map(|s| s.thread.clone())
    }

    pub fn remove(&self, id: &str) -> bool {
        self.lock().by_id.remove(id).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(n: u64) -> Stored {
        Stored {
            response: json!({"n": n}),
            thread: Arc::new(Thread {
                prior: None,
                input: vec![],
                output: vec![],
            }),
        }
    }

    #[test]
    fn bounded_oldest_first_and_deletable() {
        let store = ResponseStore::new(2);
        store.put("a".into(), stored(1));
        store.put("b".into(), stored(2));
        assert!(store.remove("a"));
        assert!(!store.remove("a"));
        store.put("c".into(), stored(3));
        store.put("d".into(), stored(4));
        assert!(store.get("b").is_none());
        assert_eq!(store.get("c").unwrap().response["n"], 3);
        assert!(store.thread("d").is_some());
        for i in 0..10 {
            store.put(format!("x{i}"), stored(i));
            store.remove(&format!("x{i}"));
        }
        assert!(store.lock().order.len() <= 4);
    }
}
