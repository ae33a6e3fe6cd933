//! Workloads: where requests come from and when they are due.
//!
//! Open-loop workloads (trace replay, ladder) yield a time-ordered schedule and never wait
//! for answers; the closed-loop workloads (chat, which needs each reply before its next turn,
//! and single-turn prompts) are driven by the runner's workers instead.

use std::time::Duration;

use super::record::ChatRequest;

pub mod ladder;
pub mod mooncake;
pub mod prompts;
pub mod sharegpt;

/// One open-loop request and its due time (wall clock, from the run start).
#[derive(Debug, Clone)]
pub struct Scheduled {
    pub at: Duration,
    pub req: ChatRequest,
}

pub trait OpenLoop: Send {
    /// The next request in time order, or `None` when the workload is exhausted.
    fn next_request(&mut self) -> Option<Scheduled>;
}

/// Reads a JSONL file, one `T` per non-blank line, naming the line on error.
pub fn read_jsonl<T: serde::de::DeserializeOwned>(
    path: &std::path::Path,
) -> Result<Vec<T>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v = serde_json::from_str(line)
            .map_err(|e| format!("{}:{}: bad record: {e}", path.display(), i + 1))?;
        out.push(v);
    }
    if out.is_empty() {
        return Err(format!("{} holds no records", path.display()));
    }
    Ok(out)
}
