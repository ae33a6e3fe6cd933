//! Independent single-turn prompts (`{"text", "output_length"}` per line): aiperf's
//! `single_turn` custom-dataset format, so one file can drive both tools.
//!
//! Closed loop: `--conversations` workers each send the next prompt in file order as one user
//! message once their previous request has finished. Every prompt is sent at most once.

use std::collections::HashSet;
use std::path::Path;

use serde::Deserialize;

use super::read_jsonl;
use crate::replay::record::{ChatRequest, Message, Tenancy};

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Prompt {
    pub text: String,
    /// Absent (as aiperf allows): `--max-output-tokens`.
    #[serde(default)]
    pub output_length: Option<u64>,
    /// `tenant`, `priority`, `slo_ttft_ms`, each optional (aiperf ignores them).
    #[serde(flatten)]
    pub tenancy: Tenancy,
}

pub fn load(path: &Path) -> Result<Vec<Prompt>, String> {
    let prompts: Vec<Prompt> = read_jsonl(path)?;
    if let Some(i) = prompts.iter().position(|p| p.text.is_empty()) {
        return Err(format!("{}: prompt {} is empty", path.display(), i + 1));
    }
    Ok(prompts)
}

/// The requests in send order. `max_tokens` is the prompt's `output_length` (at least 1),
/// else `default_max_tokens`. Oracle (bytes): a prompt whose exact text was sent before is a
/// full hit, any other a miss; shared prefixes between different texts are not credited.
pub fn requests(prompts: Vec<Prompt>, default_max_tokens: u32) -> Vec<ChatRequest> {
    let mut seen = HashSet::new();
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let total = p.text.len() as f64;
            let hit = if seen.insert(p.text.clone()) {
                0.0
            } else {
                total
            };
            let max_tokens = p
                .output_length
                .map_or(default_max_tokens, |n| n.clamp(1, u32::MAX as u64) as u32);
            ChatRequest {
                model: None,
                messages: vec![Message::new("user", p.text)],
                max_tokens,
                session: Some(format!("prompt-{i}")),
                step: None,
                turn: None,
                oracle_hit: hit,
                oracle_total: total,
                agent: Default::default(),
                tenancy: p.tenancy,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp_file(name: &str, body: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("kvbench-{}-{name}", std::process::id()));
        std::fs::write(&p, body).unwrap();
        p
    }

    #[test]
    fn loads_aiperf_single_turn_lines() {
        let p = tmp_file(
            "prompts.jsonl",
            "{\"text\": \"alpha beta\", \"output_length\": 128}\n\n\
             {\"text\": \"gamma\"}\n\
             {\"text\": \"alpha beta\", \"output_length\": 0, \"type\": \"single_turn\"}\n",
        );
        let prompts = load(&p).unwrap();
        std::fs::remove_file(&p).ok();
        assert_eq!(prompts.len(), 3);
        assert_eq!(
            prompts[0],
            Prompt {
                text: "alpha beta".into(),
                output_length: Some(128),
                tenancy: Tenancy::default(),
            }
        );
        assert_eq!(prompts[1].output_length, None);

        let reqs = requests(prompts, 64);
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0].messages, vec![Message::new("user", "alpha beta")]);
        assert_eq!(
            reqs.iter().map(|r| r.max_tokens).collect::<Vec<_>>(),
            [128, 64, 1]
        );
        // Only the exact repeat counts for the oracle.
        assert_eq!(reqs[0].oracle_hit, 0.0);
        assert_eq!(reqs[1].oracle_hit, 0.0);
        assert_eq!(reqs[2].oracle_hit, reqs[2].oracle_total);
        assert_eq!(reqs[2].oracle_total, 10.0);
    }

    #[test]
    fn tenant_priority_and_deadline_are_optional_fields() {
        let p = tmp_file(
            "tenants.jsonl",
            "{\"text\": \"a\", \"tenant\": \"gold\", \"priority\": -1, \"slo_ttft_ms\": 800}\n\
             {\"text\": \"b\"}\n",
        );
        let reqs = requests(load(&p).unwrap(), 8);
        std::fs::remove_file(&p).ok();
        assert_eq!(
            reqs[0].tenancy,
            Tenancy {
                tenant: Some("gold".into()),
                priority: Some(-1),
                slo_ttft_ms: Some(800)
            }
        );
        assert_eq!(reqs[1].tenancy, Tenancy::default());
        // A priority that is not an integer is a bad line, not a silently default one.
        let p = tmp_file(
            "bad-priority.jsonl",
            "{\"text\": \"a\", \"priority\": \"high\"}\n",
        );
        let err = load(&p).unwrap_err();
        std::fs::remove_file(&p).ok();
        assert!(err.contains(":1: bad record"), "{err}");
    }

    #[test]
    fn rejects_bad_lines() {
        let p = tmp_file("bad.jsonl", "{\"text\": \"ok\"}\n{\"output_length\": 3}\n");
        let err = load(&p).unwrap_err();
        std::fs::remove_file(&p).ok();
        assert!(err.contains(":2: bad record"), "{err}");
        let p = tmp_file("empty-text.jsonl", "{\"text\": \"\"}\n");
        let err = load(&p).unwrap_err();
        std::fs::remove_file(&p).ok();
        assert!(err.contains("prompt 1 is empty"), "{err}");
    }
}
