//! Workloads: where requests come from and when they are due.
//!
//! Open-loop workloads (trace replay, ladder) yield a time-ordered schedule and never wait
//! for answers; the closed-loop workloads (chat, which needs each reply before its next turn,
//! and single-turn prompts) are driven by the runner's workers instead.

use std::io::Read as _;
use std::sync::Arc;
use std::time::Duration;

use super::record::ChatRequest;
use sharegpt::Conversation;

pub mod ladder;
pub mod mooncake;
pub mod multi_model;
pub mod noisy_neighbor;
pub mod prompts;
pub mod shapes;
pub mod sharegpt;
pub mod tenancy;

/// Where a closed loop's workers take their conversations from, in order; `None` ends them.
/// A generated workload may build each one when asked: a flood of 30k-token prompts, all made
/// up front, would hold gigabytes.
pub trait Conversations: Send + Sync {
    fn get(&self, i: usize) -> Option<Conversation>;
}

impl Conversations for Vec<Conversation> {
    fn get(&self, i: usize) -> Option<Conversation> {
        self.as_slice().get(i).cloned()
    }
}

/// Closed-loop workers sharing one source of conversations: a tenant's, or a phase's.
pub struct Pool {
    pub convs: Arc<dyn Conversations>,
    pub workers: u32,
}

impl Pool {
    pub fn new(convs: Vec<Conversation>, workers: u32) -> Self {
        Pool {
            convs: Arc::new(convs),
            workers,
        }
    }
}

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

/// Reads a file as text, gunzipping it when it starts with the gzip magic bytes: the
/// repository ships its traces gzipped, and a user may have decompressed them in place or pass
/// either form with `--file`, so the content decides, not the name.
pub fn read_text(path: &std::path::Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        return String::from_utf8(bytes)
            .map_err(|e| format!("{}: not UTF-8 text: {e}", path.display()));
    }
    let mut text = String::new();
    // MultiGzDecoder: `cat a.gz b.gz` is a valid gzip file too.
    flate2::read::MultiGzDecoder::new(bytes.as_slice())
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot gunzip {}: {e}", path.display()))?;
    Ok(text)
}

/// Reads a JSONL file (plain or gzipped), one `T` per non-blank line, naming the line on
/// error.
pub fn read_jsonl<T: serde::de::DeserializeOwned>(
    path: &std::path::Path,
) -> Result<Vec<T>, String> {
    let text = read_text(path)?;
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

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        enc.write_all(data).unwrap();
        enc.finish().unwrap()
    }

    #[test]
    fn gzipped_trace_reads_as_its_plain_form() {
        let dir = std::env::temp_dir().join(format!("kvbench-gz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain =
            b"{\"timestamp\": 0, \"hash_ids\": [1, 2]}\n\n{\"timestamp\": 5, \"hash_ids\": [1]}\n";
        let (p, gz, named) = (
            dir.join("t.jsonl"),
            dir.join("t.jsonl.gz"),
            dir.join("g.jsonl"),
        );
        std::fs::write(&p, plain).unwrap();
        std::fs::write(&gz, gzip(plain)).unwrap();
        // A gzipped file without the suffix is still recognised by its content.
        std::fs::write(&named, gzip(plain)).unwrap();
        let a: Vec<serde_json::Value> = read_jsonl(&p).unwrap();
        let b: Vec<serde_json::Value> = read_jsonl(&gz).unwrap();
        let c: Vec<serde_json::Value> = read_jsonl(&named).unwrap();
        assert_eq!(a.len(), 2);
        assert_eq!((&a, &a), (&b, &c));
        // A truncated gzip file is an error, not a short trace.
        let g = gzip(plain);
        std::fs::write(&gz, &g[..g.len() / 2]).unwrap();
        let err = read_jsonl::<serde_json::Value>(&gz).unwrap_err();
        assert!(err.contains("cannot gunzip"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shipped_traces_read_the_same_gzipped_and_plain() {
        let gz = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("data/traces/synthetic/hot_prefix.jsonl.gz");
        let text = read_text(&gz).unwrap();
        let dir = std::env::temp_dir().join(format!("kvbench-gz2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain = dir.join("hot_prefix.jsonl");
        std::fs::write(&plain, &text).unwrap();
        let a: Vec<serde_json::Value> = read_jsonl(&gz).unwrap();
        let b: Vec<serde_json::Value> = read_jsonl(&plain).unwrap();
        // 4,764 requests, as the traces README says.
        assert_eq!((a.len(), a == b), (4764, true));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
