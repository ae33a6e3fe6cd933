//! Sends one streamed chat request and measures it.

use std::time::Instant;

use futures_util::StreamExt;

use super::api::{Api, Wire};
use super::record::{ChatRequest, RequestRecord, ToolCall};
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
}

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
    let exchange = exchange(ctx, &url, wire, &req, &mut p);
    let result = match tokio::time::timeout_at(ctx.hard_deadline, exchange).await {
        Ok(r) => r,
        Err(_) => Err("timeout".to_owned()),
    };
    let end = Instant::now();
    let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
    let itl = token_gaps_ms(&p.events, p.usage.map(|u| u.completion_tokens));
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
    };
    Outcome {
        record,
        call: p.call.map(|c| ToolCall {
            arguments: p.text.clone(),
            ..c
        }),
        text: p.text,
        response_id: p.response_id,
    }
}

async fn exchange(
    ctx: &Ctx,
    url: &str,
    wire: Wire,
    req: &ChatRequest,
    p: &mut Progress,
) -> Result<(), String> {
    let body = wire.body(req, req.model.as_deref().unwrap_or(&ctx.model));
    let mut builder = ctx.client.post(url).json(&body);
    for (name, value) in &ctx.headers {
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
    p.backend = ["x-kvbench-server", "x-kvbench-addr"]
        .iter()
        .find_map(|n| h.get(*n).and_then(|v| v.to_str().ok()).map(str::to_owned));
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
}
