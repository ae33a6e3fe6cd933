//! `GET /v1/models` answered by kvroute: the models its healthy backends serve (configured or
//! listed by their engines), in OpenAI's shape, adapters with their `parent`. Passed through to
//! a backend, as before, only while nothing is known of any healthy backend's models.

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;

use super::ctx::Ctx;
use super::reject::reject;
use crate::edge::access;
use crate::error::ApiError;
use crate::fleet::models::ModelEntry;
use crate::fleet::Fleet;

fn entry(m: &ModelEntry) -> serde_json::Value {
    let mut v =
        serde_json::json!({"id": m.id, "object": "model", "created": 0, "owned_by": "kvroute"});
    if let Some(p) = &m.parent {
        v["parent"] = serde_json::Value::String(p.clone());
    }
    v
}

/// `GET /v1/models[/{id}]` from what the fleet serves (`Ok(true)`: answered); anything else
/// passes through (`Ok(false)`).
pub(super) async fn answer_models(session: &mut Session, ctx: &mut Ctx) -> pingora::Result<bool> {
    let path = session.req_header().uri.path();
    let id = match path.strip_prefix("/v1/models") {
        Some("") => None,
        Some(rest) => match rest.strip_prefix('/') {
            Some(id) if !id.is_empty() => Some(id.to_string()),
            _ => return Ok(false),
        },
        None => return Ok(false),
    };
    let generation = ctx.generation.clone();
    let key = match (&ctx.quota.caller, &generation.config.access) {
        (Some(c), Some(acl)) => acl.keys.get(c.index),
        _ => None,
    };
    let visible = |m: &str| key.is_none_or(|k| access::check_model(k, m).is_ok());
    match answer(&generation.fleet, id.as_deref(), visible) {
        None => Ok(false),
        Some(Ok(body)) => {
            send(session, body).await?;
            Ok(true)
        }
        Some(Err(e)) => reject(session, ctx, e, true).await,
    }
}

/// The answer to `GET /v1/models` or `/v1/models/{id}` (`id`), if kvroute answers it:
/// `visible` filters what the caller may see.
pub(super) fn answer(
    fleet: &Fleet,
    id: Option<&str>,
    visible: impl Fn(&str) -> bool,
) -> Option<Result<Bytes, ApiError>> {
    let (models, unknown) = fleet.served_models();
    if models.is_empty() && unknown {
        return None;
    }
    let models: Vec<&ModelEntry> = models.iter().filter(|m| visible(&m.id)).collect();
    let body = match id {
        None => serde_json::json!({
            "object": "list",
            "data": models.iter().map(|m| entry(m)).collect::<Vec<_>>(),
        }),
        Some(id) => match models.iter().find(|m| m.id == id) {
            Some(m) => entry(m),
            None => return Some(Err(ApiError::model_not_found(id))),
        },
    };
    Some(Ok(Bytes::from(body.to_string())))
}

/// Write `body` as a 200 JSON response (no body for HEAD).
pub(super) async fn send(session: &mut Session, body: Bytes) -> pingora::Result<()> {
    let head = session.req_header().method == http::Method::HEAD;
    let mut h = ResponseHeader::build(200, Some(3))?;
    h.insert_header("content-type", "application/json")?;
    h.insert_header("content-length", body.len().to_string())?;
    session.write_response_header(Box::new(h), head).await?;
    if !head {
        session.write_response_body(Some(body), true).await?;
    }
    Ok(())
}
