//! A chat message's `content` as the canonical prompt takes it: its decoded bytes, borrowed
//! from the body where JSON escaping allows.
//!
//! Message text is most of a long prompt, and decoding it is most of the cost of reading one.
//! serde_json checks every string byte for `"`, `\` and raw control characters eight bytes at a
//! time, then validates each string as UTF-8. When the whole body is known valid UTF-8 and to
//! hold no byte below 0x20 at all (one vectorised pass each, as compact JSON from any client
//! is), neither check can fail inside a string, and the text is read as JSON bytes instead:
//! serde_json then finds the string's end with `memchr2`. A body with a raw control character
//! anywhere (pretty-printed JSON, say) is decoded the strict way, so what is refused, and with
//! what error, stays the same.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::marker::PhantomData;

/// Whether every string in this (UTF-8) body may be read on the fast path: no byte in it is a
/// control character. A `min` over the bytes, unlike an early-exit search, vectorises.
pub(super) fn fast_path_ok(body: &[u8]) -> bool {
    body.iter().fold(u8::MAX, |m, &b| m.min(b)) >= 0x20
}

/// A message's `content`, decoded in the same pass as the rest of the body. Parts stay raw;
/// non-text parts are identified by the hash of their JSON.
pub(super) enum Content<'a> {
    /// Valid UTF-8.
    Text(Cow<'a, [u8]>),
    Parts(Vec<&'a RawValue>),
}

/// [`Content`] as it is deserialized: `FAST` reads the text as JSON bytes (see the module
/// comment), which only a body that passed [`fast_path_ok`] may do.
pub(super) struct Decoded<'a, const FAST: bool>(pub(super) Content<'a>);

impl<'de: 'a, 'a, const FAST: bool> Deserialize<'de> for Decoded<'a, FAST> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = V::<FAST>(PhantomData);
        if FAST {
            // A string arrives as bytes, a list of parts as a sequence; anything else is the
            // same invalid-type error `deserialize_any` gives.
            d.deserialize_bytes(v).map(Decoded)
        } else {
            d.deserialize_any(v).map(Decoded)
        }
    }
}

/// The text of `raw`, a JSON string from a body that passed [`fast_path_ok`] when `FAST`;
/// `None` when it is not a valid JSON string.
pub(super) fn string<const FAST: bool>(raw: &str) -> Option<Cow<'_, [u8]>> {
    match serde_json::from_str::<Decoded<FAST>>(raw) {
        Ok(Decoded(Content::Text(t))) => Some(t),
        _ => None,
    }
}

struct V<'a, const FAST: bool>(PhantomData<&'a ()>);

impl<'de: 'a, 'a, const FAST: bool> serde::de::Visitor<'de> for V<'a, FAST> {
    type Value = Content<'a>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("message content as a string, an array of content parts, or null")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Borrowed(v.as_bytes())))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Owned(v.as_bytes().to_vec())))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Owned(v.into_bytes())))
    }
    // Only on the fast path. A borrowed slice lies between two quotes of a body already known
    // to be UTF-8, so it is UTF-8 itself.
    fn visit_borrowed_bytes<E>(self, v: &'de [u8]) -> Result<Self::Value, E> {
        Ok(Content::Text(Cow::Borrowed(v)))
    }
    // Unescaped text, which the strict decode refuses where a `\u` escape names a lone
    // surrogate. Its raw parts are UTF-8 and end at ASCII characters, and every other escape
    // decodes to UTF-8, so the one way it can fail to be UTF-8 is the surrogate's own encoding
    // (0xED followed by 0xA0-0xBF), which valid UTF-8 never contains.
    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        if memchr::memchr_iter(0xED, v).any(|i| v.get(i + 1).is_some_and(|&b| b >= 0xA0)) {
            return Err(E::custom("lone surrogate in a \\u escape"));
        }
        Ok(Content::Text(Cow::Owned(v.to_vec())))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut parts = Vec::new();
        while let Some(p) = seq.next_element::<&'de RawValue>()? {
            parts.push(p);
        }
        Ok(Content::Parts(parts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Msg<'a, const FAST: bool> {
        #[serde(borrow)]
        content: Option<Decoded<'a, FAST>>,
    }

    fn both(json: &str) -> [Result<Option<Vec<u8>>, String>; 2] {
        fn one<const FAST: bool>(json: &str) -> Result<Option<Vec<u8>>, String> {
            let m: Msg<FAST> = serde_json::from_str(json).map_err(|e| e.to_string())?;
            Ok(m.content.map(|c| match c.0 {
                Content::Text(t) => t.into_owned(),
                Content::Parts(p) => p.iter().flat_map(|r| r.get().bytes()).collect(),
            }))
        }
        [one::<false>(json), one::<true>(json)]
    }

    #[test]
    fn both_paths_decode_the_same_text() {
        for json in [
            r#"{"content":"plain text"}"#,
            r#"{"content":"esc \"q\" \\ \/ \n\t\r\b\f \u00e9 \ud83d\ude00 end"}"#,
            r#"{"content":"héllo ✓ 😀"}"#,
            // Next to the surrogates: U+D7FF (0xED 0x9F 0xBF) and U+E000, escaped and raw.
            r#"{"content":"\ud7ff \ue000 \n \ud83d\ude00"}"#,
            "{\"content\":\"\u{d7ff}\\n\u{e000}\"}",
            r#"{"content":""}"#,
            r#"{"content":null}"#,
            r#"{}"#,
            r#"{"content":[{"type":"text","text":"a"},{"type":"image_url"}]}"#,
        ] {
            let [strict, fast] = both(json);
            assert!(strict.is_ok(), "{json}: {strict:?}");
            assert_eq!(strict, fast, "{json}");
        }
    }

    #[test]
    fn both_paths_refuse_the_same_content() {
        for json in [
            r#"{"content":7}"#,
            r#"{"content":{"a":1}}"#,
            r#"{"content":true}"#,
            r#"{"content":"\ud800 lone"}"#,
            r#"{"content":"\udc00 lone"}"#,
            r#"{"content":"a \ud800\u0041 b"}"#,
            r#"{"content":"\ud83d\n"}"#,
            r#"{"content":"bad \x escape"}"#,
            r#"{"content":"unterminated"#,
        ] {
            let [strict, fast] = both(json);
            assert!(strict.is_err(), "{json}: strict accepted it");
            assert!(fast.is_err(), "{json}: fast accepted it");
        }
    }

    #[test]
    fn control_bytes_anywhere_keep_a_body_off_the_fast_path() {
        assert!(fast_path_ok(br#"{"content":"a b ~ \u0001"}"#));
        assert!(fast_path_ok("é😀\u{7f}".as_bytes()));
        for b in 0u8..0x20 {
            let body = [b'{', b'"', b'a', b, b'"', b'}'];
            assert!(!fast_path_ok(&body), "byte {b:#x}");
        }
        // Long enough to take the vectorised loop, with the control byte at the end.
        let mut long = vec![b'x'; 1000];
        long.push(b'\n');
        assert!(!fast_path_ok(&long));
    }
}
