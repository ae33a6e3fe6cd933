//! The BPE tables prompts are counted with: o200k_base (built into tiktoken-rs) or a tiktoken
//! rank file named by `routing.tokenizer`, as OpenAI publishes them and as some open models ship
//! their tokenizer (Llama 3's `tokenizer.model`). Building them takes ~120 ms and ~45 MiB for a
//! 200k-token vocabulary, so it never runs on a proxy worker thread.

use base64::Engine as _;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;
use tiktoken_rs::{CoreBPE, Rank};
use xxhash_rust::xxh3::Xxh3;

use crate::config::{ConfigError, RoutingConfig};

/// cl100k_base's split pattern, as tiktoken-rs builds cl100k_base (it exports only o200k's).
/// Llama 3's tokenizer splits text the same way.
const CL100K_BASE_PAT_STR: &str = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s";

/// Table id of o200k_base; a rank file's id is a hash of its bytes and pattern.
const O200K_ID: u64 = 1;

/// Which tables to count with, as the config names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tokenizer {
    O200kBase,
    RankFile { path: PathBuf, pattern: String },
}

impl Tokenizer {
    /// What `cfg` counts with; `None` when it counts no prompt at all.
    pub fn of(cfg: &RoutingConfig) -> Option<Tokenizer> {
        if !cfg.counts_tokens() {
            return None;
        }
        Some(match cfg.rank_file() {
            None => Tokenizer::O200kBase,
            Some(path) => Tokenizer::RankFile {
                path: path.to_path_buf(),
                pattern: match cfg.tokenizer_pattern.as_deref() {
                    None | Some("o200k_base") => tiktoken_rs::O200K_BASE_PAT_STR,
                    Some("cl100k_base") => CL100K_BASE_PAT_STR,
                    Some(regex) => regex,
                }
                .to_string(),
            },
        })
    }
}

impl std::fmt::Display for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::O200kBase => f.write_str("o200k_base"),
            Tokenizer::RankFile { path, .. } => write!(f, "rank file {}", path.display()),
        }
    }
}

/// A rank file's size and modification time when it was read: a reload re-reads a file whose
/// stamp changed, even under the same path.
#[derive(Debug, Clone, Copy, PartialEq)]
struct FileStamp {
    len: u64,
    modified: Option<SystemTime>,
}

impl FileStamp {
    fn of(path: &Path) -> std::io::Result<FileStamp> {
        let meta = std::fs::metadata(path)?;
        Ok(FileStamp {
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }
}

pub struct Tables {
    pub(super) bpe: CoreBPE,
    /// Names the vocabulary and split pattern: a per-model correction learned against other
    /// tables does not apply to counts from these.
    pub(super) id: u64,
    stamp: Option<FileStamp>,
}

impl Tables {
    /// Build the tables `t` names (blocking: run it off the proxy's worker threads). A rank file
    /// that cannot be read or parsed is a config error naming the file and line.
    pub fn load(t: &Tokenizer) -> Result<Tables, ConfigError> {
        match t {
            Tokenizer::O200kBase => tiktoken_rs::o200k_base()
                .map(|bpe| Tables {
                    bpe,
                    id: O200K_ID,
                    stamp: None,
                })
                .map_err(|e| tokenizer_error(format!("o200k_base did not load: {e}"))),
            Tokenizer::RankFile { path, pattern } => load_rank_file(path, pattern),
        }
    }

    /// Whether a rank file's tables still match the file on disk (built-in tables always do).
    pub fn unchanged_on_disk(&self, t: &Tokenizer) -> bool {
        match (t, self.stamp) {
            (Tokenizer::RankFile { path, .. }, Some(stamp)) => {
                FileStamp::of(path).is_ok_and(|now| now == stamp)
            }
            _ => true,
        }
    }
}

fn tokenizer_error(reason: String) -> ConfigError {
    ConfigError {
        key: "kvroute.routing.tokenizer".into(),
        reason,
    }
}

fn load_rank_file(path: &Path, pattern: &str) -> Result<Tables, ConfigError> {
    let fail = |msg: String| tokenizer_error(format!("{}: {msg}", path.display()));
    let stamp = FileStamp::of(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return Err(fail("not a regular file".into()));
    }
    let text = std::fs::read_to_string(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    let ranks = parse_ranks(&text).map_err(fail)?;
    let bpe =
        CoreBPE::new(ranks.into_iter().collect(), Default::default(), pattern).map_err(|e| {
            ConfigError {
                key: "kvroute.routing.tokenizer_pattern".into(),
                reason: format!("not a valid split pattern: {e}"),
            }
        })?;
    let mut h = Xxh3::new();
    h.update(text.as_bytes());
    h.update(&[0]);
    h.update(pattern.as_bytes());
    Ok(Tables {
        bpe,
        id: h.digest().max(O200K_ID + 1),
        stamp: Some(stamp),
    })
}

/// The tokens and ranks of a tiktoken rank file: one `<base64 token> <rank>` per line, blank
/// lines ignored. CoreBPE panics on a repeated rank and on a byte with no rank of its own, so
/// both are refused here, with the line that shows it.
fn parse_ranks(text: &str) -> Result<Vec<(Vec<u8>, Rank)>, String> {
    let mut tokens: HashMap<Vec<u8>, (Rank, usize)> = HashMap::new();
    let mut ranks: HashMap<Rank, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let mut fields = line.split_whitespace();
        let (token, rank) = match (fields.next(), fields.next(), fields.next()) {
            (None, _, _) => continue,
            (Some(t), Some(r), None) => (t, r),
            _ => return Err(format!("line {n}: expected `<base64 token> <rank>`")),
        };
        let token = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|e| format!("line {n}: token is not base64: {e}"))?;
        if token.is_empty() {
            return Err(format!("line {n}: empty token"));
        }
        let rank: Rank = match rank.parse() {
            Ok(r) if r < Rank::MAX => r,
            _ => {
                return Err(format!(
                    "line {n}: rank `{rank}` is not an integer below {}",
                    Rank::MAX
                ))
            }
        };
        if let Some(first) = ranks.insert(rank, n) {
            return Err(format!(
                "line {n}: rank {rank} is already taken on line {first}"
            ));
        }
        if let Some((_, first)) = tokens.insert(token, (rank, n)) {
            return Err(format!("line {n}: token already ranked on line {first}"));
        }
    }
    // Every piece falls back to single bytes, so each byte needs a rank.
    if let Some(b) = (0..=255u8).find(|b| !tokens.contains_key(&[*b][..])) {
        return Err(format!(
            "no rank for the single byte 0x{b:02x} ({} tokens read); a BPE rank file ranks all 256 bytes",
            tokens.len()
        ));
    }
    Ok(tokens.into_iter().map(|(t, (r, _))| (t, r)).collect())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A rank file of the 256 single bytes and `merges`, ranked in that order.
    pub fn rank_file(merges: &[&str]) -> String {
        let b64 = |t: &[u8]| base64::engine::general_purpose::STANDARD.encode(t);
        let mut out = String::new();
        let tokens = (0..=255u8)
            .map(|b| vec![b])
            .chain(merges.iter().map(|m| m.as_bytes().to_vec()));
        for (rank, t) in tokens.enumerate() {
            out.push_str(&format!("{} {rank}\n", b64(&t)));
        }
        out
    }

    #[test]
    fn parses_a_rank_file_and_names_the_bad_line() {
        let good = rank_file(&["he", "ll", "hell", "hello"]);
        assert_eq!(parse_ranks(&good).unwrap().len(), 260);
        let line = |n: usize, to: &str| {
            let mut lines: Vec<&str> = good.lines().collect();
            lines[n - 1] = to;
            lines.join("\n")
        };
        let cases = [
            (line(3, "AQ== 2 extra"), "line 3: expected"),
            (line(3, "!!!! 2"), "line 3: token is not base64"),
            (line(3, "AQ== -1"), "line 3: rank `-1`"),
            (line(3, "AQ== 4294967295"), "line 3: rank `4294967295`"),
            (
                line(258, "aGU= 7"),
                "line 258: rank 7 is already taken on line 8",
            ),
            (
                line(258, "AA== 300"),
                "line 258: token already ranked on line 1",
            ),
            (line(66, ""), "no rank for the single byte 0x41"),
            (
                String::new(),
                "no rank for the single byte 0x00 (0 tokens read)",
            ),
        ];
        for (text, want) in cases {
            let e = parse_ranks(&text).unwrap_err();
            assert!(e.contains(want), "{e}, want {want}");
        }
        // Blank lines and CRLF line ends, as in files saved on Windows, are fine.
        let crlf = good.replace('\n', "\r\n") + "\r\n\r\n";
        assert_eq!(parse_ranks(&crlf).unwrap().len(), 260);
    }

    #[test]
    fn a_rank_file_loads_and_counts() {
        let dir = std::env::temp_dir().join(format!("kvroute-tables-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.tiktoken");
        std::fs::write(
            &path,
            rank_file(&["he", "ll", "hell", "hello", " w", " wor", "or"]),
        )
        .unwrap();
        let t = Tokenizer::RankFile {
            path: path.clone(),
            pattern: tiktoken_rs::O200K_BASE_PAT_STR.into(),
        };
        let tables = Tables::load(&t).unwrap();
        // "hello" merges to one token; " world" to " wor" + "l" + "d".
        assert_eq!(tables.bpe.count_ordinary("hello world"), 4);
        assert!(tables.id > O200K_ID);
        assert!(tables.unchanged_on_disk(&t));
        // Another pattern makes other tables.
        let cl100k = Tokenizer::RankFile {
            path: path.clone(),
            pattern: CL100K_BASE_PAT_STR.into(),
        };
        assert_ne!(Tables::load(&cl100k).unwrap().id, tables.id);
        let bad_regex = Tokenizer::RankFile {
            path: path.clone(),
            pattern: "(unclosed".into(),
        };
        let e = Tables::load(&bad_regex).err().unwrap();
        assert_eq!(e.key, "kvroute.routing.tokenizer_pattern");

        std::fs::write(&path, rank_file(&["he", "ll", "hell"])).unwrap();
        assert!(!tables.unchanged_on_disk(&t), "the file changed size");
        std::fs::write(&path, "AA== 0\nAA== 1\n").unwrap();
        let e = Tables::load(&t).err().unwrap();
        assert_eq!(e.key, "kvroute.routing.tokenizer");
        assert!(
            e.reason
                .starts_with(&format!("{}: line 2:", path.display())),
            "{e}"
        );
        std::fs::remove_file(&path).unwrap();
        let e = Tables::load(&t).err().unwrap();
        assert!(e.reason.contains("cannot read"), "{e}");
        let e = Tables::load(&Tokenizer::RankFile {
            path: dir.clone(),
            pattern: "x".into(),
        })
        .err()
        .unwrap();
        assert!(e.reason.contains("not a regular file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_config_names_the_tables() {
        let mut cfg = RoutingConfig::default();
        // Counting is off by default: no tables.
        assert_eq!(Tokenizer::of(&cfg), None);
        cfg.count_tokens_max_bytes = 8192;
        assert_eq!(Tokenizer::of(&cfg), Some(Tokenizer::O200kBase));
        cfg.tokenizer = "/x/llama3.tiktoken".into();
        cfg.tokenizer_pattern = Some("cl100k_base".into());
        assert_eq!(
            Tokenizer::of(&cfg),
            Some(Tokenizer::RankFile {
                path: "/x/llama3.tiktoken".into(),
                pattern: CL100K_BASE_PAT_STR.into()
            })
        );
        cfg.count_tokens_max_bytes = 0;
        cfg.count_tokens_offthread_max_bytes = 0;
        assert_eq!(Tokenizer::of(&cfg), None, "nothing is counted: no tables");
    }
}
