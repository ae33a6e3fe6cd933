//! The request parser and canonicaliser on arbitrary bytes: whatever a client sends, `profile`
//! returns a profile or an error, never panics, and a profile is consistent with the input
//! (the prefix blocks of a request with a reply start with the request's own blocks, and the
//! profile's own continuation gives the same blocks as parsing the body again), on the
//! parser's fast path as on its strict one.
#![no_main]

use kvroute::request::{self, Endpoint};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First byte: endpoint and whether a session header is present; the rest is the body.
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let endpoint = if sel & 1 == 0 {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let header = (sel & 2 != 0).then_some(&body[..body.len().min(16)]);
    let block = [16, 64, 256][(sel as usize >> 2) % 3];
    let profiled = request::profile(endpoint, body, header, block);
    // A trailing newline is JSON whitespace that keeps the body off the parser's fast path
    // (request/text.rs): both paths accept and refuse the same bodies, with the same profile.
    let strict = request::profile(endpoint, &[body, b"\n"].concat(), header, block);
    match (&profiled, &strict) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) if !body.is_empty() => {
            assert_eq!((a.status, a.code), (b.status, b.code))
        }
        (Err(_), Err(_)) => {}
        _ => panic!("fast {profiled:?}, strict {strict:?}"),
    }
    let Ok(p) = profiled else {
        return;
    };
    assert!(p.est_prompt_tokens > 0 || p.prefix_blocks.is_empty());
    if let Ok(with_reply) = request::blocks_with_reply(endpoint, body, "a reply", block) {
        assert!(with_reply.len() >= p.prefix_blocks.len());
        assert_eq!(&with_reply[..p.prefix_blocks.len()], &p.prefix_blocks[..]);
        // The profile continues its own stream to the same blocks, without a second parse.
        assert_eq!(p.reply_blocks("a reply"), Some(with_reply));
    }
});
