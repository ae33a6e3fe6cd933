//! The simulator's output text: token i is the word `" tok{i}"`, so a replay can append the
//! exact reply to the next turn. Below both `generate` (timing, reply hashes) and `tokenizer`
//! (which must count these words as an engine would).

pub fn token_text(i: u64) -> String {
    format!(" tok{i}")
}

/// The whole reply of `n` tokens.
pub fn completion_text(n: u64) -> String {
    (0..n).map(token_text).collect()
}
