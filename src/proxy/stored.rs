//! Stored responses: a call that names one (`previous_response_id`, or a call on
//! `/v1/responses/{id}`) goes to the backend whose stamp its id carries, with the engine's own
//! id, and never anywhere else; a Responses answer's ids are stamped on the way out.

use bytes::Bytes;
use http::Uri;

use super::ctx::Ctx;
use crate::error::ApiError;
use crate::request::id_stamp::IdStamp;
use crate::request::response_id::{tag, Opened};
use crate::request::surface;

fn not_found(id: &str, why: &str) -> ApiError {
    ApiError::response_not_found(format!("no stored response `{id}`: {why}"))
}

/// Pins `ctx` to the backend that stored `id` and returns the engine's own id, or `None` for
/// an id kvroute did not stamp (it names no backend: placed as usual).
fn pin<'a>(ctx: &mut Ctx, id: &'a str) -> Result<Option<&'a str>, ApiError> {
    let generation = ctx.generation.clone();
    match generation.response_ids.open(id) {
        Opened::Plain => Ok(None),
        Opened::Forged => Err(not_found(id, "its id was not issued by this kvroute")),
        Opened::Stamped {
            tag: t,
            id: engine_id,
        } => {
            let backends = generation.fleet.backends();
            let Some(i) = backends.iter().position(|b| tag(&b.name) == t) else {
                return Err(not_found(
                    id,
                    "the backend that stored it is no longer in the fleet",
                ));
            };
            ctx.route.pinned = Some(i);
            Ok(Some(engine_id))
        }
    }
}

/// A call on a stored response: to its backend, with the engine's id in the path.
pub(super) fn route_call(ctx: &mut Ctx, uri: &Uri) -> Result<(), ApiError> {
    let Some((id, call)) = surface::stored_response(uri.path()) else {
        return Err(ApiError::not_found(format!(
            "{} is not served here",
            uri.path()
        )));
    };
    let Some(engine_id) = pin(ctx, id)? else {
        // An unstamped id names no backend, and asking every backend is not an option.
        return Err(not_found(id, "its id was not issued by this kvroute"));
    };
    let query = uri.query().map_or(String::new(), |q| format!("?{q}"));
    ctx.route.upstream_path = Some(format!("/v1/responses/{engine_id}{call}{query}"));
    ctx.route.stamp_ids = Some(Some(engine_id.to_owned()));
    Ok(())
}

/// A new response that continues `previous`: to the backend that stored it, the body naming
/// the engine's id.
pub(super) fn route_continuation(
    ctx: &mut Ctx,
    previous: &str,
    body: Bytes,
) -> Result<Bytes, ApiError> {
    let Some(engine_id) = pin(ctx, previous)? else {
        ctx.route.stamp_ids = Some(Some(previous.to_owned()));
        return Ok(body);
    };
    ctx.route.stamp_ids = Some(Some(engine_id.to_owned()));
    // The stamped id is JSON-plain (ASCII letters, digits, `_`, and the engine's id after it),
    // so it appears in the body exactly as quoted here.
    let (from, to) = (format!("\"{previous}\""), format!("\"{engine_id}\""));
    let text = std::str::from_utf8(&body)
        .map_err(|_| ApiError::bad_request("invalid_json", "request body is not valid UTF-8"))?;
    Ok(Bytes::from(text.replacen(&from, &to, 1)))
}

/// The stamper of this answer's response ids, if it carries any.
pub(super) fn stamper(ctx: &Ctx, stream: bool) -> Option<IdStamp> {
    let named = ctx.route.stamp_ids.as_ref()?;
    let backend = ctx.generation.fleet.backends()[ctx.attempts.backend?]
        .name
        .clone();
    let ids = ctx.generation.response_ids.clone();
    Some(IdStamp::new(stream, named.as_deref(), move |id| {
        ids.stamp(&backend, id)
    }))
}
