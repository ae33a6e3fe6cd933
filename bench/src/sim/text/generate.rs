//! Deterministic output and its timing. Token i is the word `" tok{i}"`, so a replay can append
//! the exact reply to the next turn; token i is due at `start + ttft + i * itl`, computed from
//! the start rather than from the previous token so that scheduler delays do not accumulate.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::openai::Endpoint;
use super::prompt::TURN_END;
use super::tokenizer::PromptTokenizer;
use crate::sim::engine::kvcache::{continued_hashes, BLOCK_BYTES};

#[cfg(test)]
pub use super::filler::completion_text;
pub use super::filler::{continued_text, token_text};

#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub start: Instant,
    pub ttft: Duration,
    pub itl: Duration,
}

impl Schedule {
    pub fn token_due(&self, i: u64) -> Instant {
        let gaps = u32::try_from(i).unwrap_or(u32::MAX);
        self.start + self.ttft + self.itl.saturating_mul(gaps)
    }
}

/// The chain of `prompt_hashes` continued over `n` tokens of reply and what the client puts
/// after it when it sends the reply back: a chat template closes the assistant turn, a
/// completions client appends the text as is. These are the blocks past the prompt's that a
/// server keeps cached after answering, and that the conversation's next turn starts with.
/// `prompt` is the prompt's token stream; a real tokenizer's stream continues with the tokens of
/// the reply's text (`tokenizer`).
pub fn reply_hashes(
    endpoint: Endpoint,
    prompt: &[u8],
    prompt_hashes: &[u64],
    seed: u64,
    reply: Reply<'_>,
    tokenizer: &PromptTokenizer,
) -> Vec<u64> {
    let end = reply_end(endpoint);
    let n = match reply {
        Reply::Filler(n) => n,
        Reply::Rendered(text) => {
            let bytes = rendered_stream(text, end, tokenizer);
            return continued_hashes(prompt, prompt_hashes, seed, [&bytes[..]]);
        }
    };
    let Some(tokens) = tokenizer.reply_stream(n, end) else {
        let reply = (0..n).map(token_text);
        return continued_hashes(
            prompt,
            prompt_hashes,
            seed,
            reply.chain(std::iter::once(end.to_owned())),
        );
    };
    match tokens {
        Ok(tokens) => continued_hashes(prompt, prompt_hashes, seed, [tokens]),
        Err(e) => {
            // Only the reply goes uncached: the next turn misses it and computes it again.
            log::warn!("kvbench-sim: reply not cached: {e}");
            Vec::new()
        }
    }
}

/// The reply as the client sends it back: `n` filler tokens as text, or, for a tool call, the
/// call as the template renders it (`ToolCall::rendered`).
#[derive(Debug, Clone, Copy)]
pub enum Reply<'a> {
    Filler(u64),
    Rendered(&'a str),
}

impl Reply<'_> {
    fn filler_len(self) -> u64 {
        match self {
            Reply::Filler(n) => n,
            Reply::Rendered(_) => 0,
        }
    }
}

/// The token stream of a rendered reply and what follows it; empty (the reply goes uncached,
/// the next turn computes it again) if the tokenizer fails.
fn rendered_stream(text: &str, end: &str, tokenizer: &PromptTokenizer) -> Vec<u8> {
    let whole = format!("{text}{end}");
    match tokenizer.text_stream(&whole) {
        None => whole.into_bytes(),
        Some(Ok(tokens)) => tokens,
        Some(Err(e)) => {
            log::warn!("kvbench-sim: reply not cached: {e}");
            Vec::new()
        }
    }
}

/// What follows the reply when the client sends it back: a chat template closes the
/// assistant turn, a completions client appends the text as is.
fn reply_end(endpoint: Endpoint) -> &'static str {
    if endpoint.is_chat() {
        TURN_END
    } else {
        ""
    }
}

/// `reply_hashes`, and the token stream that the prompt's and the reply's blocks cover (64
/// bytes a block), for the token ids of KV events. Holds the reply whole, which
/// `reply_hashes` avoids, so only an engine that publishes events pays for it.
pub fn reply_hashes_and_tokens(
    endpoint: Endpoint,
    prompt: &[u8],
    prompt_hashes: &[u64],
    seed: u64,
    reply: Reply<'_>,
    tokenizer: &PromptTokenizer,
) -> (Vec<u64>, Arc<[u8]>) {
    let end = reply_end(endpoint);
    let reply: Vec<u8> = match (reply, tokenizer.reply_stream(reply.filler_len(), end)) {
        (Reply::Rendered(text), _) => rendered_stream(text, end, tokenizer),
        (Reply::Filler(n), None) => (0..n)
            .map(token_text)
            .chain(std::iter::once(end.to_owned()))
            .collect::<String>()
            .into_bytes(),
        (_, Some(Ok(tokens))) => tokens.to_vec(),
        (_, Some(Err(e))) => {
            log::warn!("kvbench-sim: reply not cached: {e}");
            Vec::new()
        }
    };
    let hashes = continued_hashes(prompt, prompt_hashes, seed, [&reply]);
    let covered = (prompt_hashes.len() + hashes.len()) * BLOCK_BYTES;
    let mut stream = Vec::with_capacity(covered);
    stream.extend_from_slice(&prompt[..covered.min(prompt.len())]);
    stream.extend_from_slice(&reply);
    stream.truncate(covered);
    (hashes, stream.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filler_is_deterministic() {
        assert_eq!(completion_text(3), " tok0 tok1 tok2");
        assert_eq!(completion_text(0), "");
    }

    #[test]
    fn reply_tokens_cover_exactly_the_named_blocks() {
        use crate::sim::engine::kvcache::block_hashes;
        let tok = PromptTokenizer::default();
        let prompt: Vec<u8> = (0..64 * 3 + 50).map(|i| b'a' + (i % 26) as u8).collect();
        let hashes = block_hashes(&prompt);
        for endpoint in [Endpoint::Chat, Endpoint::Completions] {
            let (reply, tokens) =
                reply_hashes_and_tokens(endpoint, &prompt, &hashes, 0, Reply::Filler(40), &tok);
            assert_eq!(
                reply,
                reply_hashes(endpoint, &prompt, &hashes, 0, Reply::Filler(40), &tok)
            );
            assert_eq!(tokens.len(), (hashes.len() + reply.len()) * BLOCK_BYTES);
            let mut all = hashes.clone();
            all.extend(&reply);
            assert_eq!(block_hashes(&tokens), all);
        }
    }

    #[test]
    fn tokens_are_spaced_from_start() {
        let s = Schedule {
            start: Instant::now(),
            ttft: Duration::from_millis(20),
            itl: Duration::from_millis(5),
        };
        assert_eq!(s.token_due(0) - s.start, Duration::from_millis(20));
        assert_eq!(s.token_due(4) - s.start, Duration::from_millis(40));
    }
}
