//! A request's prompt as the engine tokenizes it: the model's chat template (Jinja, from its
//! `tokenizer_config.json`) rendered as Hugging Face's `apply_chat_template` does, then its
//! `tokenizer.json`. Both come from local files; nothing is downloaded. The token blocks,
//! chain-hashed as the exact index names blocks, are what engine KV events are matched on.
//!
//! Cost: a byte-level BPE takes 0.15-0.35 ms per KB, so prompts are tokenized off the proxy's
//! threads, and piecewise: Hugging Face tokenizers cut the text at added (special) tokens
//! before anything else, so each piece between them tokenizes alone to the same ids. Pieces are
//! remembered by content, and a conversation's next turn only tokenizes what is new.

use minijinja::value::Serde;
use minijinja::{Environment, Value as JValue};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::agent_chat;
use super::endpoint::Endpoint;
use crate::config::{ConfigError, KvEventsConfig, TokenizerFiles};

/// Token ids the piece memo holds before it starts over (about 64 MiB).
const MEMO_TOKENS: usize = 16 << 20;
/// Pieces shorter than this are tokenized again rather than remembered.
const MEMO_MIN_BYTES: usize = 64;
/// Template rendering steps allowed: a template that loops without end is stopped.
const TEMPLATE_FUEL: u64 = 2_000_000;

/// kvroute's chain hashes of the full blocks of `tokens`, continuing from `parent` (the root
/// seed for a prompt's first block).
pub fn chain(parent: u64, tokens: &[u32], block_size: usize) -> Vec<u64> {
    keyed_chain(parent, tokens, block_size, &[])
}

/// [`chain`], with block `i`'s extra key `keys[i]` (0 or absent: none) folded in after its
/// tokens. The engine hashes more than tokens into a block's name (vLLM's `extra_keys`: a LoRA
/// adapter, multimodal inputs, a request's `cache_salt`), so equal tokens under other keys are
/// other blocks, and so is everything chained after them.
pub fn keyed_chain(parent: u64, tokens: &[u32], block_size: usize, keys: &[u64]) -> Vec<u64> {
    let mut prev = parent;
    let mut buf = Vec::with_capacity(block_size * 4);
    tokens
        .chunks_exact(block_size.max(1))
        .enumerate()
        .map(|(i, block)| {
            buf.clear();
            block
                .iter()
                .for_each(|t| buf.extend_from_slice(&t.to_le_bytes()));
            prev = xxhash_rust::xxh3::xxh3_64_with_seed(&buf, prev);
            if let Some(&k) = keys.get(i).filter(|&&k| k != 0) {
                prev = xxhash_rust::xxh3::xxh3_64_with_seed(&k.to_le_bytes(), prev);
            }
            prev
        })
        .collect()
}

/// The seed of a prompt's first block: a LoRA adapter's blocks are not the base model's.
pub fn root(lora: Option<&str>) -> u64 {
    lora.map_or(0, |l| xxhash_rust::xxh3::xxh3_64(l.as_bytes()) | 1)
}

/// Seeds keep a salt's key apart from an opaque key of the same bytes.
const SALT_SEED: u64 = 0x7361_6c74;
const OPAQUE_SEED: u64 = 0x6f70_6171;

/// The extra key of a prompt's first block under a request's `cache_salt` (vLLM salts only the
/// first block; the chain carries it to the rest). Never 0.
pub fn salt_key(salt: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(salt.as_bytes(), SALT_SEED) | 1
}

/// An extra key kvroute cannot reproduce from a request (multimodal inputs, prompt
/// embeddings), named by its bytes: blocks under it match no request's blocks. Never 0.
pub fn opaque_key(encoded: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(encoded, OPAQUE_SEED) | 1
}

pub struct EngineTokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// The tokenizer's added tokens (where it cuts the text first), and their ids by pattern.
    added: Option<aho_corasick::AhoCorasick>,
    added_ids: Vec<u32>,
    pub block_size: usize,
    memo: Mutex<Memo>,
    /// Bytes of text encoded from scratch (not found in the memo): what the tests read to
    /// tell a memo hit from a miss.
    #[cfg(test)]
    cold_bytes: std::sync::atomic::AtomicU64,
    /// Prompts tokenized at once, shared by all tokenizers.
    slots: Arc<Slots>,
}

/// Tokenizing slots, shared by all tokenizers: half the cores, so tokenizing never takes the
/// CPU the proxy's threads need. A request finding them all taken may wait behind at most one
/// other waiter per slot (about one tokenization): arrivals in a burst are smoothed, while a
/// sustained overload sends requests to the approximate index at once rather than each
/// waiting out its budget.
pub struct Slots {
    sem: Arc<tokio::sync::Semaphore>,
    waiting: std::sync::atomic::AtomicUsize,
    size: usize,
}

impl Slots {
    fn new(size: usize) -> Slots {
        Slots {
            sem: Arc::new(tokio::sync::Semaphore::new(size)),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            size,
        }
    }

    /// A slot if one is free now: for work nobody waits for, which must not queue ahead of a
    /// request's own.
    fn idle(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.sem.clone().try_acquire_owned().ok()
    }

    /// A slot, now or after the short wait described above; `None` when the queue is full.
    pub async fn acquire(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        use std::sync::atomic::Ordering::AcqRel;
        if let Ok(p) = self.sem.clone().try_acquire_owned() {
            return Some(p);
        }
        /// Counts a waiter until it has its slot or gives up (its future dropped).
        struct Waiter<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Waiter<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, AcqRel);
            }
        }
        let waiter = Waiter(&self.waiting);
        if self.waiting.fetch_add(1, AcqRel) >= self.size {
            return None;
        }
        let permit = self.sem.clone().acquire_owned().await.ok();
        drop(waiter);
        permit
    }
}

#[derive(Default)]
struct Memo {
    pieces: HashMap<u128, Arc<[u32]>>,
    tokens: usize,
}

fn cfg_err(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        key: format!("kvroute.kv_events.{key}"),
        reason: reason.into(),
    }
}

/// Prompts tokenized at once, over all of kvroute's tokenizers: half the cores.
fn tokenizing_slots() -> Arc<Slots> {
    Arc::new(Slots::new(
        std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
    ))
}

/// Every tokenizer `kvroute.kv_events` names, chosen per request by its model.
pub struct EngineTokenizers {
    /// In [`KvEventsConfig::all_files`]' order.
    all: Vec<Arc<EngineTokenizer>>,
}

impl EngineTokenizers {
    /// Load them all (blocking), sharing one set of tokenizing slots.
    pub fn load(cfg: &KvEventsConfig) -> Result<EngineTokenizers, ConfigError> {
        let slots = tokenizing_slots();
        let all = cfg
            .all_files()
            .into_iter()
            .enumerate()
            .map(|(i, files)| {
                EngineTokenizer::load_files(files, slots.clone())
                    .map(Arc::new)
                    .map_err(|mut e| {
                        if i > 0 {
                            e.key = e.key.replacen(
                                "kvroute.kv_events.",
                                &format!("kvroute.kv_events.tokenizers[{}].", i - 1),
                                1,
                            );
                        }
                        e
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(EngineTokenizers { all })
    }

    /// The tokenizer for requests for `model` (`cfg` is the config these were loaded from).
    pub fn for_model(&self, cfg: &KvEventsConfig, model: &str) -> Option<&Arc<EngineTokenizer>> {
        cfg.tokenizer_for(model).and_then(|i| self.all.get(i))
    }
}

impl EngineTokenizer {
    /// Load `cfg`'s own tokenizer (blocking: a large tokenizer.json takes a few hundred ms).
    pub fn load(cfg: &KvEventsConfig) -> Result<EngineTokenizer, ConfigError> {
        let own = cfg.all_files()[0];
        EngineTokenizer::load_files(own, tokenizing_slots())
    }

    fn load_files(
        files: TokenizerFiles<'_>,
        slots: Arc<Slots>,
    ) -> Result<EngineTokenizer, ConfigError> {
        let tokenizer = tokenizers::Tokenizer::from_file(files.tokenizer)
            .map_err(|e| cfg_err("tokenizer", format!("{}: {e}", files.tokenizer.display())))?;
        let (template, bos, eos) = read_template(files.tokenizer_config)?;
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| cfg_err("tokenizer_config", e.to_string()))?,
        );
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", template).map_err(|e| {
            cfg_err(
                "tokenizer_config",
                format!("{}: chat_template: {e}", files.tokenizer_config.display()),
            )
        })?;
        let (contents, added_ids): (Vec<String>, Vec<u32>) = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| !t.content.is_empty())
            .map(|(id, t)| (t.content, id))
            .unzip();
        let added = match contents.is_empty() {
            true => None,
            false => Some(
                aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(&contents)
                    .map_err(|e| cfg_err("tokenizer", format!("added tokens: {e}")))?,
            ),
        };
        Ok(EngineTokenizer {
            tokenizer,
            env,
            bos,
            eos,
            added,
            added_ids,
            block_size: files.block_size.max(1),
            memo: Mutex::default(),
            #[cfg(test)]
            cold_bytes: Default::default(),
            slots,
        })
    }

    /// A tokenizing slot (see [`Slots`]).
    pub async fn slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.slots.acquire().await
    }

    /// A tokenizing slot if one is free now (see [`Slots`]), for background work.
    pub fn idle_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.slots.idle()
    }

    /// The chat template's text for `messages` (and `tools`), ending with the generation
    /// prompt, as the engine renders a chat request.
    pub fn render_chat(&self, messages: &Value, tools: Option<&Value>) -> Result<String, String> {
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        t.render(minijinja::context! {
            messages => JValue::from(Serde(messages)),
            tools => tools.map(|t| JValue::from(Serde(t))),
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| format!("chat template: {e}"))
    }

    /// The prompt's token ids as the engine sees them, from a request body of `endpoint`: a
    /// chat's messages, or an agent API's as the engine converts them, through the chat
    /// template; a completion's prompt as is.
    pub fn prompt_tokens(&self, body: &[u8], endpoint: Endpoint) -> Result<Vec<u32>, String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        match endpoint {
            Endpoint::Chat => {
                let messages = v
                    .get("messages")
                    .filter(|m| m.is_array())
                    .ok_or("no messages list")?;
                let text = self.render_chat(messages, v.get("tools"))?;
                return self.tokenize(&text);
            }
            Endpoint::Responses | Endpoint::Messages => {
                let (messages, tools) = agent_chat::to_chat(endpoint, v)?;
                let text = self.render_chat(&messages, Some(&tools).filter(|t| !t.is_null()))?;
                return self.tokenize(&text);
            }
            Endpoint::Completions => {}
        }
        match v.get("prompt") {
            Some(Value::String(s)) => self.tokenize(s),
            Some(Value::Array(items)) if items.iter().all(Value::is_u64) => items
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| "a token id is not a u32".to_string()),
            _ => Err("only a string or token-id prompt is matched exactly".into()),
        }
    }

    /// Tokenize a chat conversation as its next turn will carry it, the request's messages and
    /// then the engine's `reply`, only to fill the memo: that turn's client then waits for its
    /// new message to be tokenized, not for the reply too (in chat, usually the longer part).
    /// Run after the answer, off the request's path.
    pub fn remember_reply(
        &self,
        body: &[u8],
        endpoint: Endpoint,
        reply: &str,
    ) -> Result<(), String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let (mut messages, tools) = match endpoint {
            Endpoint::Responses | Endpoint::Messages => agent_chat::to_chat(endpoint, v)?,
            _ => (
                v.get("messages").cloned().unwrap_or(Value::Null),
                v.get("tools").cloned().unwrap_or(Value::Null),
            ),
        };
        let list = messages.as_array_mut().ok_or("no messages list")?;
        list.push(serde_json::json!({"role": "assistant", "content": reply}));
        let text = self.render_chat(&messages, Some(&tools).filter(|t| !t.is_null()))?;
        self.tokenize(&text).map(drop)
    }

    /// Token ids of `text`, with no special tokens added (a chat template writes its own).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, String> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        if let Some(added) = &self.added {
            for m in added.find_iter(text) {
                self.piece(&text[at..m.start()], &mut out)?;
                if let Some(&id) = self.added_ids.get(m.pattern().as_usize()) {
                    out.push(id);
                }
                at = m.end();
            }
        }
        self.piece(&text[at..], &mut out)?;
        Ok(out)
    }

    /// kvroute's chain hashes of the prompt's full blocks (for adapter `lora`, and under the
    /// request's `cache_salt`, if any).
    pub fn blocks(&self, tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
        let keys = salt.map(salt_key);
        keyed_chain(root(lora), tokens, self.block_size, keys.as_slice())
    }

    fn piece(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        if text.is_empty() {
            return Ok(());
        }
        if text.len() < MEMO_MIN_BYTES {
            out.extend_from_slice(&self.encode(text)?);
            return Ok(());
        }
        let key = xxhash_rust::xxh3::xxh3_128(text.as_bytes());
        let known = self
            .memo
            .lock()
            .ok()
            .and_then(|m| m.pieces.get(&key).cloned());
        let ids = match known {
            Some(ids) => ids,
            None => {
                let ids: Arc<[u32]> = self.encode(text)?.into();
                if let Ok(mut m) = self.memo.lock() {
                    if m.tokens + ids.len() > MEMO_TOKENS {
                        *m = Memo::default();
                    }
                    m.tokens += ids.len();
                    m.pieces.insert(key, ids.clone());
                }
                ids
            }
        };
        out.extend_from_slice(&ids);
        Ok(())
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        #[cfg(test)]
        self.cold_bytes
            .fetch_add(text.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.tokenizer
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("tokenizer: {e}"))
    }
}

/// `chat_template`, `bos_token` and `eos_token` of a `tokenizer_config.json`. A token may be
/// a string or an object with `content`; a template may be one string or a list of named
/// templates (the one named "default" is the chat template).
fn read_template(path: &Path) -> Result<(String, String, String), ConfigError> {
    let key = "tokenizer_config";
    let text = std::fs::read_to_string(path)
        .map_err(|e| cfg_err(key, format!("{}: {e}", path.display())))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| cfg_err(key, format!("{}: not JSON: {e}", path.display())))?;
    let template = match v.get("chat_template") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Value::as_str))
            .map(str::to_owned)
            .ok_or_else(|| cfg_err(key, "chat_template list has no \"default\" template"))?,
        _ => {
            return Err(cfg_err(
                key,
                format!("{}: no chat_template", path.display()),
            ))
        }
    };
    let token = |name: &str| match v.get(name) {
        Some(Value::String(s)) => s.clone(),
        Some(o) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        None => String::new(),
    };
    Ok((template, token("bos_token"), token("eos_token")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[tokio::test]
    async fn a_request_waits_for_a_slot_behind_at_most_one_other() {
        let slots = Arc::new(Slots::new(1));
        let first = slots.acquire().await.expect("a free slot");
        // The second waits; a third finds the queue full at once.
        let s = slots.clone();
        let second = tokio::spawn(async move { s.acquire().await.is_some() });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(slots.acquire().await.is_none(), "one waiter per slot");
        drop(first);
        assert!(
            second.await.expect("joined"),
            "the waiter gets the freed slot"
        );
        // A waiter that gives up (its future dropped) leaves no place taken.
        let held = slots.acquire().await.expect("free again");
        let gave_up =
            tokio::time::timeout(std::time::Duration::from_millis(10), slots.acquire()).await;
        assert!(gave_up.is_err());
        assert_eq!(slots.waiting.load(std::sync::atomic::Ordering::Acquire), 0);
        drop(held);
    }
    use std::path::PathBuf;

    pub(crate) fn shipped() -> KvEventsConfig {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench/data/tokenizer/chatml-bpe8k");
        KvEventsConfig::new(
            dir.join("tokenizer.json"),
            dir.join("tokenizer_config.json"),
        )
    }

    #[test]
    fn renders_chatml_and_cuts_at_added_tokens_as_the_tokenizer_does() {
        let t = EngineTokenizer::load(&shipped()).expect("the shipped tokenizer loads");
        let messages = json!([
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "  Indented code:\n    x = 1\n and more text to pass the memo threshold"},
            {"role": "assistant", "content": "Sure. Here it is."},
            {"role": "user", "content": "Thanks!"},
        ]);
        let text = t.render_chat(&messages, None).expect("renders");
        assert!(text.starts_with("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"));
        assert!(text.ends_with("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"));
        let whole = t.encode(&text).expect("encodes");
        // Twice: the second time from the memo.
        for _ in 0..2 {
            assert_eq!(t.tokenize(&text).expect("tokenizes"), whole);
        }
        assert!(
            whole.contains(&8000) && whole.contains(&8001),
            "markers are single tokens"
        );
        // A conversation's next turn extends the previous prompt's blocks.
        let first = t
            .prompt_tokens(
                serde_json::to_vec(&json!({"messages": messages.as_array().unwrap()[..2]}))
                    .unwrap()
                    .as_slice(),
                Endpoint::Chat,
            )
            .expect("tokens");
        let blocks_first = t.blocks(&first, None, None);
        let blocks_all = t.blocks(&whole, None, None);
        let shared = first.iter().zip(&whole).take_while(|(a, b)| a == b).count();
        assert_eq!(blocks_first[..shared / 16], blocks_all[..shared / 16]);
    }

    #[test]
    fn a_remembered_reply_is_not_tokenized_again_with_the_next_turn() {
        let reply = "Prefix caching keeps the attention keys and values of a prompt's blocks, \
                     so a later prompt that starts the same way skips their prefill. "
            .repeat(8);
        let turn1 = json!({"messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What does prefix caching do for a multi-turn chat?"},
        ]});
        let mut turn2 = turn1.clone();
        let msgs = turn2["messages"].as_array_mut().unwrap();
        msgs.push(json!({"role": "assistant", "content": reply}));
        msgs.push(json!({"role": "user", "content": "Thanks!"}));
        let (b1, b2) = (turn1.to_string(), turn2.to_string());
        let cold = |t: &EngineTokenizer| t.cold_bytes.load(std::sync::atomic::Ordering::Relaxed);
        // Without: the next turn encodes the reply.
        let plain = EngineTokenizer::load(&shipped()).expect("loads");
        plain
            .prompt_tokens(b1.as_bytes(), Endpoint::Chat)
            .expect("turn 1");
        let before = cold(&plain);
        let expected = plain
            .prompt_tokens(b2.as_bytes(), Endpoint::Chat)
            .expect("turn 2");
        let without = cold(&plain) - before;
        // With: the same tokens, and the reply is not encoded again.
        let t = EngineTokenizer::load(&shipped()).expect("loads");
        t.prompt_tokens(b1.as_bytes(), Endpoint::Chat)
            .expect("turn 1");
        t.remember_reply(b1.as_bytes(), Endpoint::Chat, &reply)
            .expect("remembered");
        let before = cold(&t);
        assert_eq!(
            t.prompt_tokens(b2.as_bytes(), Endpoint::Chat)
                .expect("turn 2"),
            expected
        );
        let with = cold(&t) - before;
        assert!(
            with + reply.len() as u64 <= without,
            "{with} bytes encoded with the reply remembered, {without} without"
        );
        assert!(
            t.remember_reply(b"{}", Endpoint::Chat, "x").is_err(),
            "not a chat body"
        );
    }

    #[test]
    fn bad_files_are_config_errors() {
        let mut cfg = shipped();
        cfg.tokenizer_config = cfg.tokenizer.clone();
        let e = EngineTokenizer::load(&cfg)
            .err()
            .expect("tokenizer.json has no chat template");
        assert_eq!(e.key, "kvroute.kv_events.tokenizer_config");
        let mut cfg = shipped();
        cfg.tokenizer = PathBuf::from("/nonexistent/tokenizer.json");
        assert_eq!(
            EngineTokenizer::load(&cfg).err().expect("missing").key,
            "kvroute.kv_events.tokenizer"
        );
    }

    #[test]
    fn completions_and_token_id_prompts() {
        let t = EngineTokenizer::load(&shipped()).expect("loads");
        let ids = t
            .prompt_tokens(br#"{"prompt":[1,2,3]}"#, Endpoint::Completions)
            .expect("ids");
        assert_eq!(ids, vec![1, 2, 3]);
        let s = t
            .prompt_tokens(br#"{"prompt":"hello world"}"#, Endpoint::Completions)
            .expect("text");
        assert_eq!(s, t.encode("hello world").unwrap());
        assert!(t
            .prompt_tokens(br#"{"prompt":[-1]}"#, Endpoint::Completions)
            .is_err());
        assert!(t
            .prompt_tokens(br#"{"messages":"x"}"#, Endpoint::Chat)
            .is_err());
    }
}
