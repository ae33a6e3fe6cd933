//! The session key a client names: the first of `routing.session_keys` (headers and body
//! fields, in the configured order) that the request carries.

use http::HeaderMap;

use super::canon::keyed;
use super::SessionSource;
use crate::config::{BodyKey, KeySource, DEFAULT_SESSION_KEYS};

/// Where to look for a client-named session, and the request's headers.
#[derive(Debug, Clone, Copy)]
pub struct SessionKeys<'a> {
    order: &'a [KeySource],
    headers: Option<&'a HeaderMap>,
}

/// The default order, as a place to borrow it from.
static DEFAULT_ORDER: [KeySource; 8] = DEFAULT_SESSION_KEYS;

impl Default for SessionKeys<'static> {
    /// The default order, with no headers: body fields only.
    fn default() -> Self {
        SessionKeys {
            order: &DEFAULT_ORDER,
            headers: None,
        }
    }
}

/// The body fields that may name a session, as an API's body holds them.
#[derive(Debug, Default)]
pub(super) struct BodyKeys<'a> {
    pub user: Option<&'a str>,
    pub prompt_cache_key: Option<&'a str>,
    pub metadata_user_id: Option<&'a str>,
}

impl<'a> SessionKeys<'a> {
    pub fn new(order: &'a [KeySource], headers: Option<&'a HeaderMap>) -> Self {
        SessionKeys { order, headers }
    }

    /// The default order over these headers.
    pub fn default_order(headers: Option<&'a HeaderMap>) -> Self {
        SessionKeys {
            order: &DEFAULT_ORDER,
            headers,
        }
    }

    /// The first non-empty source, mixed with the model (one session on two models is two
    /// caches). Every header shares one tag, so a session id keeps its key whichever header
    /// an agent sends it in.
    pub(super) fn explicit(&self, model: &str, body: &BodyKeys) -> Option<(u64, SessionSource)> {
        self.order.iter().find_map(|source| {
            let (tag, value, from): (&[u8], Option<&[u8]>, _) = match source {
                KeySource::Header(name) => (
                    b"h",
                    self.headers.and_then(|h| h.get(name)).map(|v| v.as_bytes()),
                    SessionSource::Header,
                ),
                KeySource::Body(BodyKey::User) => {
                    (b"u", body.user.map(str::as_bytes), SessionSource::User)
                }
                KeySource::Body(BodyKey::PromptCacheKey) => (
                    b"p",
                    body.prompt_cache_key.map(str::as_bytes),
                    SessionSource::PromptCacheKey,
                ),
                KeySource::Body(BodyKey::MetadataUserId) => (
                    b"m",
                    body.metadata_user_id.map(str::as_bytes),
                    SessionSource::MetadataUserId,
                ),
            };
            value
                .filter(|v| !v.is_empty())
                .map(|v| (keyed(model, tag, v), from))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn the_first_source_present_names_the_session_in_the_configured_order() {
        let body = BodyKeys {
            user: Some("alice"),
            prompt_cache_key: Some("conv-1"),
            metadata_user_id: Some("user_x_session_y"),
        };
        let none = HeaderMap::new();
        let defaults = SessionKeys::default_order(Some(&none));
        let (_, from) = defaults.explicit("m", &body).unwrap();
        assert_eq!(from, SessionSource::PromptCacheKey);
        let (k, from) = defaults
            .explicit(
                "m",
                &BodyKeys {
                    prompt_cache_key: Some(""),
                    ..body
                },
            )
            .unwrap();
        assert_eq!(from, SessionSource::MetadataUserId);
        assert_ne!(Some(k), defaults.explicit("m2", &body).map(|x| x.0));

        // Every agent header, in the default order, and one value keys the same in any of them.
        let mut keys = Vec::new();
        for name in [
            "x-session-id",
            "x-session-affinity",
            "x-claude-code-session-id",
            "session_id",
            "session-id",
        ] {
            let mut h = HeaderMap::new();
            h.insert(
                http::HeaderName::from_static(name),
                HeaderValue::from_static("s1"),
            );
            let (k, from) = SessionKeys::default_order(Some(&h))
                .explicit("m", &BodyKeys::default())
                .unwrap();
            assert_eq!(from, SessionSource::Header, "{name}");
            keys.push(k);
        }
        assert!(keys.windows(2).all(|w| w[0] == w[1]));
        let mut h = HeaderMap::new();
        h.insert("session_id", HeaderValue::from_static("codex"));
        h.insert("x-session-affinity", HeaderValue::from_static("first"));
        let first = SessionKeys::default_order(Some(&h)).explicit("m", &body);
        h.remove("session_id");
        assert_eq!(
            first,
            SessionKeys::default_order(Some(&h)).explicit("m", &body)
        );

        // A configured order is the only one: what it leaves out is not read.
        let only_user = [KeySource::Body(BodyKey::User)];
        let (_, from) = SessionKeys::new(&only_user, Some(&h))
            .explicit("m", &body)
            .unwrap();
        assert_eq!(from, SessionSource::User);
        assert_eq!(SessionKeys::new(&[], Some(&h)).explicit("m", &body), None);
    }
}
