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

/// Tokens `first..first + n` of a reply: what continues a text that holds the first `first`.
pub fn continued_text(first: u64, n: u64) -> String {
    (first..first + n).map(token_text).collect()
}

/// How many of the reply's tokens `text` ends with: `k` when it ends with
/// `completion_text(k)`. A request that gives a reply's start back to be continued (chat's
/// `continue_final_message`, a completions prompt) is answered from token `k` on, so a stream
/// continued elsewhere reads as one unbroken stream.
pub fn trailing_reply(text: &str) -> u64 {
    let Some(pos) = text.rfind(" tok") else {
        return 0;
    };
    match text[pos + 4..].parse::<u64>() {
        Ok(j) if j < 1 << 20 && text.ends_with(&completion_text(j + 1)) => j + 1,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replys_start_is_found_at_the_end_of_a_text() {
        assert_eq!(trailing_reply(&format!("hello{}", completion_text(5))), 5);
        assert_eq!(trailing_reply(" tok0"), 1);
        assert_eq!(trailing_reply("hello tok3"), 0);
        assert_eq!(trailing_reply(" tok0 tok2"), 0);
        assert_eq!(trailing_reply("no reply"), 0);
        assert_eq!(continued_text(2, 2), " tok2 tok3");
    }
}
