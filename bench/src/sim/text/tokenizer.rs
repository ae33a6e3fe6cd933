//! How the engine cuts a prompt into tokens: the stand-in (`ceil(bytes / 4)`, the default) or
//! a real Hugging Face tokenizer (`--tokenizer DIR|tokenizer.json`), as an engine whose
//! tokenizer is not kvroute's o200k would.
//!
//! Either way a prompt becomes a *token stream*: bytes in which a token takes 4, so that
//! `prompt::count_tokens` and `kvcache`'s 64-byte (16-token) blocks work the same on both.
//! The stand-in's stream is the canonical prompt itself. A real tokenizer's is its token ids,
//! 4 little-endian bytes each, exactly how a completions prompt sent as token ids is rendered
//! (so such a prompt is never tokenized again).
//!
//! Cost: the byte-level BPE of `bench/data/tokenizer` takes ~0.5 ms per KB (fancy-regex
//! pre-tokenizer), and a ShareGPT replay sends ~30 MB of prompt a minute, mostly the same
//! history again each turn. So prompts are tokenized turn by turn: the canonical prompt is cut
//! where a turn ends and the next begins (`<|im_end|>\n` then `<|im_start|>`), and each turn's
//! tokens are remembered by its content. A reply's tokens are those of its filler words, each
//! tokenized once, and are entered as the next turn's assistant turn. Cutting there changes no
//! token only if the tokenizer never merges across those points; `load` checks this on a
//! sample conversation and, where it fails, tokenizes every prompt whole.
//!
//! Prefix stability follows: a conversation's next turn is this turn's turns, the reply's
//! tokens, then new ones, so it hits every full block of the previous prompt and reply, as on
//! vLLM (where the chat template's special tokens give the same cut points).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::json;
use xxhash_rust::xxh3::xxh3_128;

use super::filler::{completion_text, token_text};
use super::prompt::{render_chat, GENERATION_PROMPT, TURN_END, TURN_START};

/// Token-stream bytes the memo holds before it starts over.
const MEMO_BYTES: usize = 64 << 20;
/// Filler tokens whose tokens the memo keeps (a few MB); longer replies are tokenized whole.
const FILLER_TOKENS: u64 = 1 << 16;

/// The tokenizer of every server of one `kvbench sim` process.
#[derive(Default)]
pub struct PromptTokenizer {
    bpe: Option<Bpe>,
}

struct Bpe {
    path: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    /// None when cutting at turn boundaries would change the tokens (see the module comment).
    memo: Option<Mutex<Memo>>,
}

/// Token streams by the xxh3-128 of their text (whole turns), and the filler's.
#[derive(Default)]
struct Memo {
    streams: HashMap<u128, Arc<[u8]>>,
    bytes: usize,
    /// The token stream of `completion_text(k)` for the largest k asked so far, and where each
    /// filler token's tokens end in it: the reply of `n` tokens is a prefix.
    filler: Vec<u8>,
    filler_ends: Vec<usize>,
}

impl Memo {
    fn get(&self, key: u128) -> Option<Arc<[u8]>> {
        self.streams.get(&key).cloned()
    }

    /// Bounded by starting over: the turns in flight are entered again on their next use.
    fn put(&mut self, key: u128, stream: Arc<[u8]>) {
        if self.bytes + stream.len() > MEMO_BYTES {
            self.streams.clear();
            self.bytes = 0;
        }
        self.bytes += stream.len();
        if let Some(old) = self.streams.insert(key, stream) {
            self.bytes -= old.len();
        }
    }
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl PromptTokenizer {
    /// Loads a Hugging Face tokenizer: `path` is its `tokenizer.json` or the directory
    /// holding it.
    pub fn load(path: &Path) -> Result<Self, String> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        if !file.is_file() {
            return Err(if path.is_dir() {
                format!(
                    "--tokenizer {}: no tokenizer.json in that directory",
                    path.display()
                )
            } else {
                format!(
                    "--tokenizer {}: no such file or directory (give a Hugging Face \
                     tokenizer directory or its tokenizer.json)",
                    path.display()
                )
            });
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&file).map_err(|e| {
            format!(
                "--tokenizer {}: not a Hugging Face tokenizer.json: {e}",
                file.display()
            )
        })?;
        let mut bpe = Bpe {
            path: file,
            tokenizer,
            memo: None,
        };
        if bpe.cuts_at_turns()? {
            bpe.memo = Some(Mutex::default());
        } else {
            log::warn!(
                "kvbench-sim: {} merges across chat turns; every prompt is tokenized whole",
                bpe.path.display()
            );
        }
        Ok(Self { bpe: Some(bpe) })
    }

    pub fn is_stand_in(&self) -> bool {
        self.bpe.is_none()
    }

    /// For logs: which tokenizer counts.
    pub fn describe(&self) -> String {
        match &self.bpe {
            None => "stand-in (ceil(bytes / 4))".to_owned(),
            Some(b) => format!(
                "{} ({} tokens{})",
                b.path.display(),
                b.tokenizer.get_vocab_size(true),
                if b.memo.is_some() {
                    ", remembered turn by turn"
                } else {
                    ""
                }
            ),
        }
    }

    /// The token stream of a canonical text prompt (see the module comment).
    pub fn stream(&self, canonical: Vec<u8>) -> Result<Vec<u8>, String> {
        let Some(b) = &self.bpe else {
            return Ok(canonical);
        };
        let text = String::from_utf8_lossy(&canonical);
        let Some(memo) = &b.memo else {
            return b.ids(&text);
        };
        let mut out = Vec::with_capacity(canonical.len());
        for turn in turns(&text) {
            out.extend_from_slice(&b.remembered(memo, turn, || b.ids(turn))?);
        }
        Ok(out)
    }

    /// The token stream of a reply's `text` as the client sends it back (a tool call), or None
    /// for the stand-in. Remembered as the next turn's assistant turn, as `reply_stream` does,
    /// so that the next prompt's tokens continue this stream exactly.
    pub fn text_stream(&self, text: &str) -> Option<Result<Vec<u8>, String>> {
        let b = self.bpe.as_ref()?;
        let tokens = match b.ids(text) {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        if let (Some(memo), true) = (&b.memo, text.ends_with(TURN_END)) {
            let turn = format!("{GENERATION_PROMPT}{text}");
            let stream = b.remembered(memo, GENERATION_PROMPT, || b.ids(GENERATION_PROMPT));
            if let Ok(mut whole) = stream.map(|s| s.to_vec()) {
                whole.extend_from_slice(&tokens);
                lock(memo).put(xxh3_128(turn.as_bytes()), whole.into());
            }
        }
        Some(Ok(tokens))
    }

    /// The token stream of a reply of `n` filler tokens followed by `end` as the client sends
    /// it back after the prompt, or None for the stand-in, whose stream is the text itself.
    pub fn reply_stream(&self, n: u64, end: &str) -> Option<Result<Arc<[u8]>, String>> {
        let b = self.bpe.as_ref()?;
        let reply = completion_text(n) + end;
        let Some(memo) = &b.memo else {
            return Some(b.ids(&reply).map(Arc::from));
        };
        let tokens = match b.filler_then(memo, n, end) {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        if end == TURN_END {
            // The next turn carries this reply as an assistant turn.
            let turn = format!("{GENERATION_PROMPT}{reply}");
            let stream = b.remembered(memo, GENERATION_PROMPT, || b.ids(GENERATION_PROMPT));
            if let Ok(mut whole) = stream.map(|s| s.to_vec()) {
                whole.extend_from_slice(&tokens);
                lock(memo).put(xxh3_128(turn.as_bytes()), whole.into());
            }
        }
        Some(Ok(tokens))
    }
}

fn lock(memo: &Mutex<Memo>) -> MutexGuard<'_, Memo> {
    memo.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The canonical prompt cut where one chat turn ends and the next begins.
fn turns(text: &str) -> impl Iterator<Item = &str> {
    let cut = format!("{TURN_END}{TURN_START}");
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.find(&cut).map_or(rest.len(), |i| i + TURN_END.len());
        let (turn, after) = rest.split_at(end);
        rest = after;
        Some(turn)
    })
}

impl Bpe {
    /// The memo's stream for `text`, made by `make` (outside the lock) when it has none.
    fn remembered(
        &self,
        memo: &Mutex<Memo>,
        text: &str,
        make: impl FnOnce() -> Result<Vec<u8>, String>,
    ) -> Result<Arc<[u8]>, String> {
        let key = xxh3_128(text.as_bytes());
        if let Some(s) = lock(memo).get(key) {
            return Ok(s);
        }
        let stream: Arc<[u8]> = make()?.into();
        lock(memo).put(key, stream.clone());
        Ok(stream)
    }

    /// The tokens of `completion_text(n)` then `end`, from the memo's filler: each filler
    /// token is a word and a number, which the BPE tokenizes alike wherever it stands (checked
    /// by `cuts_at_turns`).
    fn filler_then(&self, memo: &Mutex<Memo>, n: u64, end: &str) -> Result<Arc<[u8]>, String> {
        if n > FILLER_TOKENS {
            return self.ids(&(completion_text(n) + end)).map(Arc::from);
        }
        let end = self.remembered(memo, end, || self.ids(end))?;
        let mut m = lock(memo);
        while (m.filler_ends.len() as u64) < n {
            let i = m.filler_ends.len() as u64;
            let piece = self.ids(&token_text(i))?;
            m.filler.extend_from_slice(&piece);
            let at = m.filler.len();
            m.filler_ends.push(at);
        }
        let upto = n
            .checked_sub(1)
            .map_or(0, |last| m.filler_ends[last as usize]);
        let mut out = Vec::with_capacity(upto + end.len());
        out.extend_from_slice(&m.filler[..upto]);
        out.extend_from_slice(&end);
        Ok(out.into())
    }

    /// Token ids, 4 little-endian bytes each. No special tokens are added: the chat template
    /// already rendered the turn markers, as an engine's `apply_chat_template` does.
    fn ids(&self, text: &str) -> Result<Vec<u8>, String> {
        let encoding = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| format!("tokenizer {}: {e}", self.path.display()))?;
        Ok(encoding
            .get_ids()
            .iter()
            .flat_map(|id| id.to_le_bytes())
            .collect())
    }

    /// Whether a sample conversation tokenizes the same whole and cut turn by turn, with its
    /// reply cut off its generation prompt.
    fn cuts_at_turns(&self) -> Result<bool, String> {
        let messages = json!([
            {"role": "system", "content": "You are a helpful assistant.\n\n"},
            {"role": "user", "content": "  Indented code:\n    x = 1\n"},
            {"role": "assistant", "content": completion_text(12)},
            {"role": "user", "content": "Thanks! And then?"},
        ]);
        let text = render_chat(&messages).map_err(|_| "cannot render the sample chat")?;
        let text = String::from_utf8_lossy(&text);
        let mut cut = Vec::new();
        for turn in turns(&text) {
            match turn.strip_prefix(GENERATION_PROMPT) {
                Some(reply) if !reply.is_empty() => {
                    cut.extend(self.ids(GENERATION_PROMPT)?);
                    cut.extend(self.ids(reply)?);
                }
                _ => cut.extend(self.ids(turn)?),
            }
        }
        let filler: Vec<u8> = (0..120)
            .map(|i| self.ids(&token_text(i)))
            .chain([self.ids(TURN_END)])
            .collect::<Result<Vec<_>, _>>()?
            .concat();
        let filler_whole = self.ids(&(completion_text(120) + TURN_END))?;
        Ok(turns(&text).count() == 5 && cut == self.ids(&text)? && filler == filler_whole)
    }
}

/// Where a test finds the tokenizer the repository ships (bench/data/tokenizer/).
#[cfg(test)]
pub fn shipped_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tokenizer/bpe8k-sharegpt")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::engine::kvcache::block_hashes;
    use crate::sim::text::prompt::count_tokens;
    use serde_json::json;

    fn shipped() -> PromptTokenizer {
        PromptTokenizer::load(&shipped_path()).expect("bench/data/tokenizer/bpe8k-sharegpt")
    }

    fn ids(stream: &[u8]) -> Vec<u32> {
        stream
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn counts_differ_from_the_stand_in_and_prefixes_keep_their_blocks() {
        let tok = shipped();
        assert!(!tok.is_stand_in());
        let turn1 = json!([
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Summarise the history of the printing press in three \
              short paragraphs, then list five inventions it made possible."},
        ]);
        let canonical = render_chat(&turn1).unwrap();
        let stand_in = count_tokens(canonical.len());
        let stream = tok.stream(canonical.clone()).unwrap();
        assert_eq!(stream.len() % 4, 0);
        let counted = count_tokens(stream.len());
        assert_eq!(counted, ids(&stream).len() as u64);
        assert_ne!(counted, stand_in, "the BPE must not count bytes / 4");
        // English chat: a few characters a token, more than the 4 of the stand-in.
        let per_token = canonical.len() as f64 / counted as f64;
        assert!((2.0..6.0).contains(&per_token), "{per_token} bytes/token");
        // The same prompt gives the same stream, and so the same blocks.
        assert_eq!(tok.stream(canonical.clone()).unwrap(), stream);
        // The next turn (the reply sent back, a new question) starts with this turn's stream,
        // and the reply tokenized on its own continues it exactly: what the engine names the
        // reply's blocks when it finishes is what the next turn sends.
        let reply = " tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7 tok8 tok9";
        let mut turn2 = turn1.as_array().unwrap().clone();
        turn2.push(json!({"role": "assistant", "content": reply}));
        turn2.push(json!({"role": "user", "content": "Now the same for the telegraph."}));
        let next = tok.stream(render_chat(&json!(turn2)).unwrap()).unwrap();
        assert!(next.starts_with(&stream));
        let suffix = tok.reply_stream(10, TURN_END).unwrap().unwrap();
        assert!(next[stream.len()..].starts_with(&suffix));
        // Remembered turn by turn, or tokenized whole: the same tokens.
        let text = render_chat(&json!(turn2)).unwrap();
        let bpe = tok.bpe.as_ref().unwrap();
        assert_eq!(bpe.ids(&String::from_utf8_lossy(&text)).unwrap(), next);
        let (a, b) = (block_hashes(&stream), block_hashes(&next));
        assert!(!a.is_empty());
        assert_eq!(&b[..a.len()], &a[..]);
        // A tool call sent back continues it the same way, through the template's rendering.
        let call = super::super::tool_call::ToolCall::new("run", "call_");
        let rendered = call.rendered(reply);
        let calls: serde_json::Value = serde_json::from_str(&rendered).unwrap();
        let mut turn2 = turn1.as_array().unwrap().clone();
        turn2.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
        turn2.push(json!({"role": "tool", "tool_call_id": call.call_id, "content": "ok"}));
        let next = tok.stream(render_chat(&json!(turn2)).unwrap()).unwrap();
        assert!(next.starts_with(&stream));
        let suffix = tok
            .text_stream(&format!("{rendered}{TURN_END}"))
            .unwrap()
            .unwrap();
        assert!(next[stream.len()..].starts_with(&suffix));
    }

    #[test]
    fn the_stand_in_is_the_canonical_bytes() {
        let tok = PromptTokenizer::default();
        assert!(tok.is_stand_in());
        assert_eq!(tok.stream(b"hello".to_vec()).unwrap(), b"hello");
        assert!(tok.reply_stream(3, "").is_none());
    }

    #[test]
    fn bad_paths_say_what_is_wrong() {
        let err = PromptTokenizer::load(Path::new("/nonexistent/tok")).unwrap_err();
        assert!(err.contains("no such file or directory"), "{err}");
        let err = PromptTokenizer::load(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap_err();
        assert!(err.contains("no tokenizer.json in that directory"), "{err}");
        let not_json = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let err = PromptTokenizer::load(&not_json).unwrap_err();
        assert!(err.contains("not a Hugging Face tokenizer.json"), "{err}");
        // The directory and its tokenizer.json load alike.
        let file = shipped_path().join("tokenizer.json");
        assert!(PromptTokenizer::load(&file).is_ok());
    }

    /// The prompts of the first `convs` ShareGPT conversations as a replay sends them (full
    /// history, the filler replies sent back), each with its reply's length.
    fn sharegpt_prompts(convs: usize) -> Vec<(Vec<u8>, u64)> {
        use crate::replay::workloads::sharegpt::{self, Chat};
        let file = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("data/traces/sharegpt/sharegpt_v3_first2000_aiperf_multiturn.jsonl.gz");
        let mut prompts = Vec::new();
        for conv in sharegpt::load(&file).unwrap().into_iter().take(convs) {
            let mut chat = Chat::new(conv, 1024);
            while let Some(req) = chat.next_request() {
                let n = u64::from(req.max_tokens);
                prompts.push((render_chat(&json!(req.messages)).unwrap(), n));
                chat.record_reply(completion_text(n));
            }
        }
        prompts
    }

    #[test]
    fn turn_by_turn_memo_gives_the_whole_prompts_tokens() {
        let tok = shipped();
        let bpe = tok.bpe.as_ref().unwrap();
        assert!(
            bpe.memo.is_some(),
            "cutting at turns must be exact for this BPE"
        );
        for (p, n) in sharegpt_prompts(12) {
            let whole = bpe.ids(&String::from_utf8_lossy(&p)).unwrap();
            assert_eq!(tok.stream(p).unwrap(), whole);
            // As the engine does: the reply's tokens, which the next turn then reuses.
            tok.reply_stream(n, TURN_END).unwrap().unwrap();
        }
    }

    /// `cargo test --release -p kvbench tokenizer_cost -- --ignored --nocapture`: the cost of
    /// counting, per KB of ShareGPT prompt, whole and remembered turn by turn (with the
    /// replies entered as the engine does).
    #[test]
    #[ignore]
    fn tokenizer_cost() {
        let prompts = sharegpt_prompts(300);
        let bytes: usize = prompts.iter().map(|(p, _)| p.len()).sum();
        let kb = bytes as f64 / 1024.0;
        let whole = shipped();
        let whole_bpe = whole.bpe.as_ref().unwrap();
        let started = std::time::Instant::now();
        let mut tokens = 0;
        for (p, _) in &prompts {
            tokens += whole_bpe.ids(&String::from_utf8_lossy(p)).unwrap().len() / 4;
        }
        let s_whole = started.elapsed().as_secs_f64();
        let remembered = shipped();
        let started = std::time::Instant::now();
        for (p, n) in &prompts {
            assert!(remembered.stream(p.clone()).unwrap().len() >= 4);
            remembered.reply_stream(*n, TURN_END).unwrap().unwrap();
        }
        let s_memo = started.elapsed().as_secs_f64();
        // Bytes per token of the two kinds of text in those prompts.
        let filler = completion_text(1000);
        let filler_tokens = whole_bpe.ids(&filler).unwrap().len() / 4;
        let users: String = sharegpt_prompts(300)
            .iter()
            .filter(|(p, _)| p.len() < 4096)
            .map(|(p, _)| String::from_utf8_lossy(p).into_owned())
            .filter(|p| !p.contains(" tok0"))
            .collect();
        let user_tokens = whole_bpe.ids(&users).unwrap().len() / 4;
        println!(
            "first turns: {:.2} bytes/token; filler replies: {:.2} bytes/token",
            users.len() as f64 / user_tokens as f64,
            filler.len() as f64 / filler_tokens as f64
        );
        println!(
            "{} prompts, {:.1} MB, {tokens} tokens ({:.2} bytes/token): whole {:.3} s \
             ({:.0} us/KB), turn by turn {:.3} s ({:.0} us/KB)",
            prompts.len(),
            bytes as f64 / 1e6,
            bytes as f64 / tokens as f64,
            s_whole,
            s_whole * 1e6 / kb,
            s_memo,
            s_memo * 1e6 / kb,
        );
    }
}
