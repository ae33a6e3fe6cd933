//! Sends one streamed chat request and measures it.

use std::time::Instant;

use futures_util::StreamExt;

use super::api::{Api, Wire};
use super::record::{ChatRequest, RequestRecord, Tenancy, ToolCall};
use super::sse::{clip, Event, SseParser, Usage};
use super::stats::percentile;

/// Everything the request tasks share.
pub struct Ctx {
    pub client: reqwest::Client,
    /// One base URL per router replica (`--target`, then each `--replica-target`).
    pub targets: Vec<String>,
    /// The API the requests speak (`--api`).
    pub api: Api,
    pub model: String,
    pub session_header: bool,
    /// `--header`s, sent with every request.
    pub headers: Vec<(String, String)>,
    /// The tenancy `--header` gave (tenant, integer priority, deadline): for requests whose
    /// workload set none, sent and recorded as theirs.
    pub tenancy: Tenancy,
    /// `--time-scale`: deadlines are sent in the router's wall time.
    pub time_scale: f64,
    /// `--check-text`: the reply must be the simulator's unbroken text.
    pub check_text: bool,
    pub start: Instant,
    /// Requests still running at this instant are abandoned and recorded as "timeout".
    pub hard_deadline: tokio::time::Instant,
}

/// A measured request plus the reply (multi-turn chat appends it to the history).
pub struct Outcome {
    pub record: RequestRecord,
    /// The reply's text, or a tool call's arguments.
    pub text: String,
    /// The tool call the reply made, its arguments `text`.
    pub call: Option<ToolCall>,
    /// A Responses answer's id (for `previous_response_id`).
    pub response_id: Option<String>,
    /// A shed request's `Retry-After`: a closed-loop client waits it out before its next
    /// request, as a polite client does, rather than spinning on 429s. None for any other
    /// answer, after which a worker goes on at once, so runs without sheds send as before.
    pub retry_after: Option<std::time::Duration>,
}

/// Filled in while the response streams, so a timeout still keeps what was measured.
#[derive(Default)]
struct Progress {
    status: Option<u16>,
    backend: Option<String>,
    first: Option<Instant>,
    /// (arrival, bytes of text) per content event.
    events: Vec<(Instant, usize)>,
    text: String,
    usage: Option<Usage>,
    call: Option<ToolCall>,
    response_id: Option<String>,
    dropped_reason: Option<String>,
    slo: Option<String>,
    retry_after: Option<std::time::Duration>,
}

/// The longest `Retry-After` a worker waits: a run is bounded in time, and a worker asleep for
/// longer would only end the run's load early.
const MAX_RETRY_AFTER_S: f64 = 5.0;

/// Sends `req` to replica `replica` (modulo the replicas there are).
pub async fn send(ctx: &Ctx, id: u64, req: ChatRequest, replica: usize) -> Outcome {
    // Think time is the client's, before the request exists: not part of its latency.
    if !req.agent.think.is_zero() {
        tokio::time::sleep(req.agent.think).await;
    }
    let sent = Instant::now();
    let mut p = Progress::default();
    let base = &ctx.targets[replica % ctx.targets.len().max(1)];
    let wire = ctx.api.wire(req.session.as_deref(), id);
    let url = format!("{base}{}", wire.path());
    let tenancy = req.tenancy.clone().or(&ctx.tenancy);
    let exchange = exchange(ctx, &url, wire, &req, &tenancy, &mut p);
    let result = match tokio::time::timeout_at(ctx.hard_deadline, exchange).await {
        Ok(r) => r,
        Err(_) => Err("timeout".to_owned()),
    };
    let end = Instant::now();
    let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
    let itl = token_gaps_ms(&p.events, p.usage.map(|u| u.completion_tokens));
    let retry_after = p.retry_after.filter(|_| p.dropped_reason.is_some());
    let record = RequestRecord {
        id,
        send_ms: ms(ctx.start, sent),
        step: req.step,
        turn: req.turn,
        session: req.session,
        model: req.model,
        status: p.status,
        error: result.err(),
        ttft_ms: p.first.map(|f| ms(sent, f)),
        e2e_ms: ms(sent, end),
        itl_p50_ms: percentile(&itl, 50.0),
        itl_ms: itl,
        prompt_tokens: p.usage.map(|u| u.prompt_tokens),
        cached_tokens: p.usage.and_then(|u| u.cached_tokens),
        completion_tokens: p.usage.map(|u| u.completion_tokens),
        backend: p.backend,
        oracle_hit: req.oracle_hit,
        oracle_total: req.oracle_total,
        response_id: p.response_id.clone().filter(|_| req.agent.store),
        previous_response_id: req
            .agent
            .previous
            .as_ref()
            .filter(|_| wire == Wire::Responses)
            .map(|(id, _)| id.clone()),
        tenancy,
        dropped_reason: p.dropped_reason,
        slo: p.slo,
    };
    Outcome {
        record,
        call: p.call.map(|c| ToolCall {
            arguments: p.text.clone(),
            ..c
        }),
        text: p.text,
        response_id: p.response_id,
        retry_after,
    }
}

async fn exchange(
    ctx: &Ctx,
    url: &str,
    wire: Wire,
    req: &ChatRequest,
    tenancy: &Tenancy,
    p: &mut Progress,
) -> Result<(), String> {
    let body = wire.body(req, req.model.as_deref().unwrap_or(&ctx.model));
    let mut builder = ctx.client.post(url).json(&body);
    for (name, value) in &ctx.headers {
        builder = builder.header(name, value);
    }
    for (name, value) in tenancy.headers(ctx.time_scale) {
        builder = builder.header(name, value);
    }
    if ctx.session_header {
        if let Some(s) = &req.session {
            builder = builder.header("x-session-id", s);
        }
    }
    let resp = builder
        .send()
        .await
        .map_err(|e| format!("send: {}", error_chain(&e)))?;
    let status = resp.status();
    p.status = Some(status.as_u16());
    let h = resp.headers();
    let text_of = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
    p.backend = text_of("x-kvbench-server").or_else(|| text_of("x-kvbench-addr"));
    p.dropped_reason = text_of("x-kvroute-dropped-reason");
    p.slo = text_of("x-kvroute-slo");
    p.retry_after = text_of("retry-after")
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| std::time::Duration::from_secs_f64(s.min(MAX_RETRY_AFTER_S)));
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!("HTTP {}: {}", status.as_u16(), clip(text.trim())));
    }
    let mut parser = SseParser::new();
    let mut stream = resp.bytes_stream();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("read: {}", error_chain(&e)))?;
        let now = Instant::now();
        for ev in parser.push(&chunk) {
            match ev {
                Event::Content(t) => on_text(p, now, t),
                Event::ContentAndUsage(t, u) => {
                    on_text(p, now, t);
                    p.usage = Some(u);
                }
                Event::Usage(u) => p.usage = Some(u),
                Event::Done => done = true,
                Event::Final(u, id) => {
                    p.usage = Some(u);
                    p.response_id = id;
                    done = true;
                }
                Event::ToolCall { id, name, item } => {
                    p.call = Some(ToolCall {
                        id,
                        name,
                        arguments: String::new(),
                        item_id: item,
                    })
                }
                Event::Error(e) => return Err(format!("stream error: {e}")),
                Event::Ignored => {}
            }
        }
    }
    if !done {
        return Err(format!(
            "stream ended without its last event ({} bytes of a partial event)",
            parser.pending()
        ));
    }
    if p.first.is_none() {
        return Err("stream carried no content".to_owned());
    }
    if ctx.check_text && p.call.is_none() {
        let n = p
            .usage
            .map_or(u64::from(req.max_tokens), |u| u.completion_tokens);
        check_text(&p.text, n)?;
    }
    Ok(())
}

/// The simulator's reply of `n` tokens is `" tok0 tok1 … tok{n-1}"`: anything else was
/// mangled on the way (text lost, repeated or reordered where a stream was continued).
fn check_text(text: &str, n: u64) -> Result<(), String> {
    let mut words = text.split(' ');
    let whole = words.next() == Some("")
        && (0..n).all(|i| words.next().and_then(|w| w.strip_prefix("tok")) == Some(&i.to_string()))
        && words.next().is_none();
    if whole {
        return Ok(());
    }
    Err(format!(
        "text differs from an unbroken stream of {n} tokens: {}",
        clip(text)
    ))
}

fn on_text(p: &mut Progress, now: Instant, t: String) {
    p.first.get_or_insert(now);
    p.events.push((now, t.len()));
    p.text.push_str(&t);
}

/// Inter-token gaps. An event carrying several tokens spreads its gap over them; the token
/// count per event is not on the wire, so the final completion-token count is shared out in
/// proportion to each event's text length (exact when every event is one token).
pub fn token_gaps_ms(events: &[(Instant, usize)], completion_tokens: Option<u64>) -> Vec<f64> {
    if events.len() < 2 {
        return Vec::new();
    }
    let total_bytes: usize = events.iter().map(|e| e.1).sum();
    let tokens = completion_tokens.unwrap_or(events.len() as u64) as f64;
    let one_each = tokens as usize == events.len() || total_bytes == 0;
    let mut gaps = Vec::with_capacity(events.len());
    for w in events.windows(2) {
        let gap = w[1].0.saturating_duration_since(w[0].0).as_secs_f64() * 1e3;
        let n = if one_each {
            1
        } else {
            ((w[1].1 as f64 * tokens / total_bytes as f64).round() as usize).max(1)
        };
        gaps.extend(std::iter::repeat_n(gap / n as f64, n));
    }
    gaps
}

/// reqwest's top-level message hides the cause ("error sending request"); the chain says
/// "connection refused" and the like.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_unbroken_text_passes_and_a_mangled_one_does_not() {
        assert!(check_text(" tok0 tok1 tok2", 3).is_ok());
        assert!(check_text("", 0).is_ok());
        for bad in [
            " tok0 tok2",
            " tok0 tok1 tok1 tok2",
            " tok0 tok1",
            " tok0 tok1 tok2 tok3",
        ] {
            assert!(check_text(bad, 3).is_err(), "{bad}");
        }
    }
    use std::time::Duration;

    #[test]
    fn gaps_one_token_per_event() {
        let t0 = Instant::now();
        let ev = vec![
            (t0, 4),
            (t0 + Duration::from_millis(10), 4),
            (t0 + Duration::from_millis(30), 4),
        ];
        let g = token_gaps_ms(&ev, Some(3));
        assert_eq!(g.len(), 2);
        assert!((g[0] - 10.0).abs() < 1e-6 && (g[1] - 20.0).abs() < 1e-6);
    }

    #[test]
    fn gaps_spread_over_multi_token_events() {
        let t0 = Instant::now();
        // 8 tokens over 3 events in proportion to text: 2, 2 and 4.
        let ev = vec![
            (t0, 2),
            (t0 + Duration::from_millis(10), 2),
            (t0 + Duration::from_millis(50), 4),
        ];
        let g = token_gaps_ms(&ev, Some(8));
        assert_eq!(g.len(), 2 + 4);
        assert!((g[2] - 10.0).abs() < 1e-6);
    }

    /// A stand-in for kvroute's edge: sheds a sheddable request with its reason, answers the
    /// others as a one-token stream, marked at risk when it carries a deadline, and names the
    /// tenancy headers it received where a backend's name goes.
    async fn edge(headers: axum::http::HeaderMap) -> axum::response::Response {
        let get = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("-");
        let seen = format!(
            "{}|{}|{}",
            get("x-tenant-id"),
            get("x-kvroute-priority"),
            get("x-slo-ttft-ms")
        );
        let answer = axum::http::Response::builder().header("x-kvbench-server", seen);
        let answer = if get("x-kvroute-priority") == "-1" {
            answer
                .status(429)
                .header("x-kvroute-dropped-reason", "sheddable")
                .header("retry-after", "1")
                .body(axum::body::Body::from("fleet_saturated"))
        } else {
            let answer = match get("x-slo-ttft-ms") {
                "-" => answer,
                _ => answer.header("x-kvroute-slo", "at_risk"),
            };
            answer
                .header("content-type", "text/event-stream")
                .body(axum::body::Body::from(
                    "data: {\"choices\":[{\"delta\":{\"content\":\" tok0\"}}]}\n\n\
                     data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1}}\n\n\
                     data: [DONE]\n\n",
                ))
        };
        answer.unwrap_or_default()
    }

    #[tokio::test]
    async fn tenancy_goes_out_as_headers_and_sheds_and_verdicts_are_recorded() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route("/v1/chat/completions", axum::routing::post(edge));
        tokio::spawn(async move { axum::serve(listener, app).await });
        // `--header`s: the tenant is taken out to be recorded; a named priority stays a
        // plain header (it is not a number to record).
        let (tenancy, headers) = Tenancy::from_headers(vec![
            ("X-Tenant-Id".into(), "cli".into()),
            ("x-kvroute-priority".into(), "bulk".into()),
        ]);
        assert_eq!(tenancy.tenant.as_deref(), Some("cli"));
        assert_eq!(tenancy.priority, None);
        assert_eq!(headers, [("x-kvroute-priority".into(), "bulk".into())]);
        let ctx = Ctx {
            client: reqwest::Client::new(),
            targets: vec![format!("http://{addr}")],
            api: super::super::api::Api::Chat,
            model: "m".into(),
            session_header: false,
            headers: Vec::new(),
            tenancy,
            time_scale: 2.0,
            check_text: true,
            start: Instant::now(),
            hard_deadline: tokio::time::Instant::now() + Duration::from_secs(20),
        };
        let req = |tenancy: Tenancy| ChatRequest {
            messages: vec![super::super::record::Message::new("user", "hi")],
            max_tokens: 1,
            session: None,
            model: None,
            step: None,
            turn: None,
            oracle_hit: 0.0,
            oracle_total: 0.0,
            agent: Default::default(),
            tenancy,
        };
        // Its own tenant, a band and a deadline of 800 model ms: 400 wall ms at scale 2.
        let steady = Tenancy {
            tenant: Some("steady-0".into()),
            priority: Some(1),
            slo_ttft_ms: Some(800),
        };
        let out = send(&ctx, 1, req(steady.clone()), 0).await;
        let r = &out.record;
        assert!(r.ok(), "{:?}", r.error);
        assert_eq!(r.backend.as_deref(), Some("steady-0|1|400"));
        assert_eq!(
            (r.slo.as_deref(), r.dropped_reason.as_deref()),
            (Some("at_risk"), None)
        );
        assert_eq!((&r.tenancy, r.service()), (&steady, 7 + 2));
        let json = serde_json::to_value(r).unwrap();
        assert_eq!(
            (
                &json["tenant"],
                &json["priority"],
                &json["slo_ttft_ms"],
                &json["slo"]
            ),
            (
                &json!("steady-0"),
                &json!(1),
                &json!(800),
                &json!("at_risk")
            )
        );
        let back: RequestRecord = serde_json::from_value(json).unwrap();
        assert_eq!((back.tenancy, back.slo), (steady, Some("at_risk".into())));
        // Sheddable with no tenant of its own: `--header`'s goes out and is recorded.
        let shed = Tenancy {
            priority: Some(-1),
            ..Tenancy::default()
        };
        let out = send(&ctx, 2, req(shed), 0).await;
        let r = &out.record;
        assert!(r.shed() && !r.ok() && r.status == Some(429));
        assert_eq!(r.dropped_reason.as_deref(), Some("sheddable"));
        assert_eq!(r.backend.as_deref(), Some("cli|-1|-"));
        assert_eq!(r.tenancy.tenant.as_deref(), Some("cli"));
        assert_eq!((r.slo.as_deref(), r.service()), (None, 0));
        assert_eq!(out.retry_after, Some(Duration::from_secs(1)));
    }
}
