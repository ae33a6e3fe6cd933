//! What each server received, in arrival order, for tests to check where the proxy sent a
//! request and that it forwarded the body intact. Bounded: the oldest entries go first.

use std::collections::VecDeque;

use serde::Serialize;

pub const LOG_CAPACITY: usize = 100_000;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Entry {
    pub seq: u64,
    pub path: &'static str,
    pub session: Option<String>,
    pub model: Option<String>,
    pub body_len: usize,
    pub body_xxh3: String,
    pub stream: bool,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// Unset while the request is held (hang fault) or its answer is not yet decided.
    pub status: Option<u16>,
    /// The `X-Data-Parallel-Rank` header a router pinned the request with, as sent.
    pub dp_rank: Option<String>,
    /// The body's `priority` field (vLLM's and SGLang's scheduling priority), as sent.
    pub priority: Option<i64>,
}

impl Entry {
    pub fn arrival(
        path: &'static str,
        session: Option<String>,
        body_len: usize,
        body_xxh3: String,
    ) -> Self {
        Self {
            seq: 0,
            path,
            session,
            model: None,
            body_len,
            body_xxh3,
            stream: false,
            prompt_tokens: None,
            cached_tokens: None,
            dp_rank: None,
            priority: None,
            status: None,
        }
    }
}

pub struct RequestLog {
    entries: VecDeque<Entry>,
    next_seq: u64,
    capacity: usize,
}

impl RequestLog {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            next_seq: 0,
            capacity: capacity.max(1),
        }
    }

    /// Appends the entry and returns its sequence number (0, 1, 2, ... per server).
    pub fn push(&mut self, mut entry: Entry) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        entry.seq = seq;
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back(entry);
        seq
    }

    /// Updates an entry still in the log; entries already dropped are ignored.
    pub fn update(&mut self, seq: u64, f: impl FnOnce(&mut Entry)) {
        let Some(first) = self.entries.front().map(|e| e.seq) else {
            return;
        };
        let Some(i) = seq.checked_sub(first) else {
            return;
        };
        if let Some(e) = usize::try_from(i)
            .ok()
            .and_then(|i| self.entries.get_mut(i))
        {
            f(e);
        }
    }

    pub fn entries(&self) -> Vec<Entry> {
        self.entries.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry::arrival("/v1/completions", None, 3, "abc".into())
    }

    #[test]
    fn bounded_and_updatable_by_seq() {
        let mut log = RequestLog::new(2);
        assert_eq!(log.push(entry()), 0);
        assert_eq!(log.push(entry()), 1);
        assert_eq!(log.push(entry()), 2);
        log.update(0, |e| e.status = Some(500)); // already dropped
        log.update(2, |e| e.status = Some(200));
        let seqs: Vec<u64> = log.entries().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2]);
        assert_eq!(log.entries()[1].status, Some(200));
        assert_eq!(log.entries()[0].status, None);
    }
}
