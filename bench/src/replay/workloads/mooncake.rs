//! Mooncake-format trace replay (`timestamp`, `input_length`, `output_length`, `hash_ids`).
//!
//! Each hash id stands for a 512-token block whose text is derived from the id alone, so equal
//! id prefixes become byte-identical prompt prefixes and the engines' prefix caches see the
//! same sharing the trace recorded.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use super::{read_jsonl, OpenLoop, Scheduled};
use crate::replay::record::{ChatRequest, Message, Tenancy};
use crate::replay::rng::filler;

pub const BLOCK_TOKENS: u64 = 512;
/// The simulator's stand-in tokenizer counts ceil(bytes / 4).
pub const BYTES_PER_TOKEN: u64 = 4;
/// Keeps block text apart from other filler derived from small integers (ladder prompts).
const BLOCK_SALT: u64 = 0x6d6f_6f6e_6361_6b65;

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct TraceRecord {
    /// Milliseconds since the trace start.
    pub timestamp: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(flatten)]
    pub tenancy: Tenancy,
}

pub fn load(path: &Path) -> Result<Vec<TraceRecord>, String> {
    let mut recs: Vec<TraceRecord> = read_jsonl(path)?;
    // Open-loop replay needs time order; a stable sort keeps the file order of ties.
    recs.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    Ok(recs)
}

/// The full text of block `id`: BLOCK_TOKENS tokens' worth of bytes.
pub fn block_text(id: u64) -> String {
    filler(id ^ BLOCK_SALT, (BLOCK_TOKENS * BYTES_PER_TOKEN) as usize)
}

/// The prompt of one record: its blocks in order, the last cut to `input_length`.
pub fn prompt(rec: &TraceRecord) -> String {
    let block_bytes = (BLOCK_TOKENS * BYTES_PER_TOKEN) as usize;
    let want = (rec.input_length * BYTES_PER_TOKEN) as usize;
    let mut out = String::with_capacity(want);
    for &id in &rec.hash_ids {
        let room = want.saturating_sub(out.len());
        if room == 0 {
            break;
        }
        let mut block = block_text(id);
        block.truncate(room.min(block_bytes));
        out.push_str(&block);
    }
    if out.is_empty() {
        // Engines reject empty prompts; a zero-length record still deserves a request.
        out.push_str("hello");
    }
    out
}

pub struct MooncakeSchedule {
    records: Vec<TraceRecord>,
    next: usize,
    time_scale: f64,
    seen: HashSet<u64>,
}

impl MooncakeSchedule {
    pub fn new(records: Vec<TraceRecord>, time_scale: f64) -> Self {
        Self {
            records,
            next: 0,
            time_scale,
            seen: HashSet::new(),
        }
    }
}

impl OpenLoop for MooncakeSchedule {
    fn next_request(&mut self) -> Option<Scheduled> {
        let rec = self.records.get(self.next)?;
        self.next += 1;
        // Oracle in blocks: an id already sent is a hit for one infinite cache. Summed over
        // the requests actually sent this is 1 - distinct/total.
        let total = rec.hash_ids.len() as f64;
        let hit = rec
            .hash_ids
            .iter()
            .filter(|id| !self.seen.insert(**id))
            .count() as f64;
        let start_ms = self.records[0].timestamp;
        let at_s = ((rec.timestamp - start_ms) / 1e3 / self.time_scale).max(0.0);
        Some(Scheduled {
            at: Duration::from_secs_f64(at_s),
            req: ChatRequest {
                model: None,
                messages: vec![Message::new("user", prompt(rec))],
                max_tokens: rec.output_length.clamp(1, u32::MAX as u64) as u32,
                session: rec.session_id.clone(),
                step: None,
                turn: None,
                oracle_hit: hit,
                oracle_total: total,
                agent: Default::default(),
                tenancy: rec.tenancy.clone(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: f64, input: u64, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: ts,
            input_length: input,
            output_length: 8,
            hash_ids: ids.to_vec(),
            session_id: None,
            tenancy: Tenancy::default(),
        }
    }

    #[test]
    fn block_text_is_deterministic_and_sized() {
        assert_eq!(block_text(42), block_text(42));
        assert_ne!(block_text(42), block_text(43));
        assert_eq!(block_text(42).len(), 2048);
        let r = rec(0.0, 700, &[1, 2]);
        let p = prompt(&r);
        assert_eq!(p.len(), 700 * 4);
        assert_eq!(p.len().div_ceil(4), 700);
        assert!(p.starts_with(&block_text(1)));
        assert!(block_text(2).starts_with(&p[2048..]));
    }

    #[test]
    fn equal_id_prefixes_give_equal_prompt_prefixes() {
        let a = prompt(&rec(0.0, 1500, &[1, 2, 3]));
        let b = prompt(&rec(0.0, 1500, &[1, 2, 9]));
        assert_eq!(a[..4096], b[..4096]);
        assert_ne!(a[4096..], b[4096..]);
    }

    #[test]
    fn oracle_on_a_tiny_file() {
        let dir = std::env::temp_dir().join(format!("kvbench-mc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        std::fs::write(
            &path,
            concat!(
                "{\"timestamp\": 1000, \"input_length\": 1024, \"output_length\": 4, \"hash_ids\": [1, 2]}\n",
                "{\"timestamp\": 0, \"input_length\": 1536, \"output_length\": 4, \"hash_ids\": [1, 2, 3]}\n",
                "\n",
                "{\"timestamp\": 2000, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [4, 5], \"session_id\": \"s\", \"tenant\": \"t\", \"slo_ttft_ms\": 500}\n",
            ),
        )
        .unwrap();
        let recs = load(&path).unwrap();
        assert_eq!(recs[0].timestamp, 0.0);
        let mut s = MooncakeSchedule::new(recs, 2.0);
        let all: Vec<Scheduled> = std::iter::from_fn(|| s.next_request()).collect();
        assert_eq!(all.len(), 3);
        assert_eq!(all[1].at, Duration::from_millis(500));
        assert_eq!(all[2].req.session.as_deref(), Some("s"));
        let t = &all[2].req.tenancy;
        assert_eq!(
            (t.tenant.as_deref(), t.priority, t.slo_ttft_ms),
            (Some("t"), None, Some(500))
        );
        assert_eq!(all[0].req.tenancy, Tenancy::default());
        let hit: f64 = all.iter().map(|x| x.req.oracle_hit).sum();
        let total: f64 = all.iter().map(|x| x.req.oracle_total).sum();
        // 7 blocks, 5 distinct ids.
        assert_eq!((hit, total), (2.0, 7.0));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bad_line_is_named() {
        let dir = std::env::temp_dir().join(format!("kvbench-mc-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.jsonl");
        std::fs::write(&path, "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\nnot json\n").unwrap();
        let err = load(&path).unwrap_err();
        assert!(err.contains("bad.jsonl:2"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
