//! Pass-through requests with a body: read whole and admitted like routed ones, so a route
//! kvroute does not place is no way around a key's models, rates or the body limit.

use serde::Deserialize;

/// Methods whose requests carry a body kvroute reads before forwarding.
pub(super) fn has_body(method: &str) -> bool {
    matches!(method, "POST" | "PUT" | "PATCH")
}

/// The `model` a JSON body names, if it is one that does.
pub(super) fn model_of(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Named {
        model: Option<String>,
    }
    serde_json::from_slice::<Named>(body).ok()?.model
}

/// Tokens charged to a key's rate up front: the body's size at 4 bytes a token (an embedding's
/// input, a count_tokens request); settled by nothing, since these answers carry no `usage`
/// kvroute reads.
pub(super) fn estimated_tokens(body: &[u8]) -> u64 {
    (body.len() as u64).div_ceil(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_of_a_body_and_its_size_in_tokens() {
        assert_eq!(
            model_of(br#"{"model":"e5","input":"hi"}"#).as_deref(),
            Some("e5")
        );
        assert_eq!(model_of(br#"{"input":"hi"}"#), None);
        assert_eq!(model_of(b"not json"), None);
        assert_eq!(estimated_tokens(b"12345"), 2);
        assert!(has_body("POST") && !has_body("GET"));
    }
}
