//! What kvroute serves at the edge: the OpenAI inference API, plus the routes an operator lists
//! in `kvroute.passthrough.allow`. Everything else is refused here and never forwarded, so an
//! engine's admin endpoints (vLLM's `/sleep`, `/reset_prefix_cache`, `/collective_rpc`;
//! SGLang's `/flush_cache`, `/update_weights_from_disk`; ...) stay on the backends' network.

use super::Endpoint;
use crate::config::{path_matches, AllowRule};

/// What to do with a request, by method and path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// A completion: parsed, placed and accounted.
    Inference(Endpoint),
    /// Forwarded unchanged to any healthy backend.
    Forward,
    /// A call on one stored response (`GET`/`DELETE /v1/responses/{id}`, `POST .../cancel`,
    /// `GET .../input_items`): forwarded to the backend that stored it.
    Stored,
    /// A known path with another method: 405, with these methods allowed.
    WrongMethod(&'static str),
    /// 404.
    NotFound,
}

/// The inference API's forwarded routes: `(path or prefix ending in '*', methods)`.
const BUILT_IN: [(&str, &[&str], &str); 4] = [
    ("/v1/embeddings", &["POST"], "POST"),
    // Anthropic's token counter: the engine's tokenizer, no cache to place by.
    ("/v1/messages/count_tokens", &["POST"], "POST"),
    ("/v1/models", &["GET", "HEAD"], "GET, HEAD"),
    ("/v1/models/*", &["GET", "HEAD"], "GET, HEAD"),
];

/// Whether `path` is plain enough to forward: a backend must not read it as another path
/// (`/v1/models/../../sleep`, `%2e%2e`, `//sleep`, a backslash).
fn plain(path: &str) -> bool {
    path.starts_with('/')
        && !path.contains("//")
        && !path.contains('%')
        && !path.contains('\\')
        && !path.split('/').any(|seg| seg == "." || seg == "..")
}

/// The response id in a stored response's path, and the call on it (`""`, `"/cancel"` or
/// `"/input_items"`).
pub fn stored_response(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let (id, call) = rest.find('/').map_or((rest, ""), |i| rest.split_at(i));
    (!id.is_empty() && matches!(call, "" | "/cancel" | "/input_items")).then_some((id, call))
}

pub fn route(method: &str, path: &str, allow: &[AllowRule]) -> Route {
    if let Some(endpoint) = Endpoint::from_path(path) {
        return if method == "POST" {
            Route::Inference(endpoint)
        } else {
            Route::WrongMethod("POST")
        };
    }
    if !plain(path) {
        return Route::NotFound;
    }
    if let Some((_, call)) = stored_response(path) {
        let allowed = match call {
            "" => "GET, DELETE",
            "/cancel" => "POST",
            _ => "GET",
        };
        return if allowed.split(", ").any(|m| m == method) {
            Route::Stored
        } else {
            Route::WrongMethod(allowed)
        };
    }
    if allow.iter().any(|r| r.matches(method, path)) {
        return Route::Forward;
    }
    match BUILT_IN.iter().find(|(rule, ..)| path_matches(rule, path)) {
        Some((_, methods, _)) if methods.contains(&method) => Route::Forward,
        Some((.., allowed)) => Route::WrongMethod(allowed),
        None => Route::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inference_api_and_nothing_else() {
        assert_eq!(
            route("POST", "/v1/chat/completions", &[]),
            Route::Inference(Endpoint::Chat)
        );
        assert_eq!(
            route("GET", "/v1/chat/completions", &[]),
            Route::WrongMethod("POST")
        );
        assert_eq!(route("POST", "/v1/embeddings", &[]), Route::Forward);
        // The agent APIs: placed like chat; Anthropic's token counter is forwarded.
        assert_eq!(
            route("POST", "/v1/responses", &[]),
            Route::Inference(Endpoint::Responses)
        );
        assert_eq!(
            route("POST", "/v1/messages", &[]),
            Route::Inference(Endpoint::Messages)
        );
        assert_eq!(
            route("POST", "/v1/messages/count_tokens", &[]),
            Route::Forward
        );
        assert_eq!(
            route("GET", "/v1/messages/count_tokens", &[]),
            Route::WrongMethod("POST")
        );
        // A stored response's own calls go to the backend that stored it.
        for (m, p) in [
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"),
            ("POST", "/v1/responses/resp_1/cancel"),
            ("GET", "/v1/responses/resp_1/input_items"),
        ] {
            assert_eq!(route(m, p, &[]), Route::Stored, "{m} {p}");
        }
        assert_eq!(
            stored_response("/v1/responses/resp_1/cancel"),
            Some(("resp_1", "/cancel"))
        );
        assert_eq!(
            route("POST", "/v1/responses/resp_1", &[]),
            Route::WrongMethod("GET, DELETE")
        );
        for p in [
            "/v1/responses/",
            "/v1/responses/resp_1/other",
            "/v1/responses/resp_1/cancel/x",
            "/v1/responses/../sleep",
            "/v1/responses/%2e%2e/sleep",
        ] {
            assert_eq!(route("GET", p, &[]), Route::NotFound, "{p}");
        }
        assert_eq!(route("GET", "/v1/models", &[]), Route::Forward);
        assert_eq!(route("GET", "/v1/models/m", &[]), Route::Forward);
        assert_eq!(
            route("DELETE", "/v1/models/m", &[]),
            Route::WrongMethod("GET, HEAD")
        );
        for (m, p) in [
            ("POST", "/reset_prefix_cache"),
            ("POST", "/sleep"),
            ("POST", "/wake_up"),
            ("POST", "/v1/load_lora_adapter"),
            ("POST", "/start_profile"),
            ("POST", "/collective_rpc"),
            ("POST", "/flush_cache"),
            ("POST", "/update_weights_from_disk"),
            ("POST", "/debug/faults"),
            ("GET", "/metrics"),
            ("GET", "/health"),
            ("GET", "/"),
        ] {
            assert_eq!(route(m, p, &[]), Route::NotFound, "{m} {p}");
        }
    }

    #[test]
    fn allowed_routes_and_paths_that_could_escape_them() {
        let allow = [AllowRule {
            path: "/health".into(),
            methods: vec!["GET".into()],
            upgrade: false,
        }];
        assert_eq!(route("GET", "/health", &allow), Route::Forward);
        assert_eq!(route("POST", "/health", &allow), Route::NotFound);
        for p in [
            "/v1/models/../../sleep",
            "/v1/models/%2e%2e/sleep",
            "//sleep",
            "/v1/models/./x",
            "/v1/models\\..\\sleep",
            "sleep",
        ] {
            assert_eq!(route("GET", p, &allow), Route::NotFound, "{p}");
        }
    }
}
