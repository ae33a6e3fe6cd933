//! The engine telemetry scrape loop: each backend's `/metrics` (and DCGM exporter) over
//! Pingora's HTTP/1 client, parsed by `telemetry` into the backend's slot, and its
//! `/v1/models`, which says which models it serves.

use pingora::http::RequestHeader;
use pingora::prelude::HttpPeer;
use pingora::server::ShutdownWatch;
use std::time::Duration;

use super::generation::Current;
use super::models::parse_model_list;
use super::telemetry::{add_llamacpp_props, parse_dcgm, parse_engine, parse_lora};
use super::upstream::{http_peer, probe_session, release_probe_session};
use crate::config::EngineKind;

/// `GET path` on `addr`, body as text. Bounded by `timeout` and 4 MiB.
async fn fetch(
    mut peer: HttpPeer,
    path: &str,
    auth: Option<&str>,
    timeout: Duration,
) -> Result<String, String> {
    let host = if peer.sni.is_empty() {
        peer._address.to_string()
    } else {
        peer.sni.clone()
    };
    peer.options.connection_timeout = Some(timeout);
    peer.options.read_timeout = Some(timeout);
    peer.options.write_timeout = Some(timeout);
    let work = async {
        let mut session = probe_session(&peer).await.map_err(|e| e.to_string())?;
        let mut req =
            RequestHeader::build("GET", path.as_bytes(), None).map_err(|e| e.to_string())?;
        req.insert_header("Host", host).map_err(|e| e.to_string())?;
        if let Some(a) = auth {
            req.insert_header(http::header::AUTHORIZATION, a)
                .map_err(|e| e.to_string())?;
        }
        session
            .write_request_header(Box::new(req))
            .await
            .map_err(|e| e.to_string())?;
        session.finish_body().await.map_err(|e| e.to_string())?;
        session.read_response().await.map_err(|e| e.to_string())?;
        let status = session.resp_header().map_or(0, |h| h.status.as_u16());
        if status != 200 {
            return Err(format!("status {status}"));
        }
        let mut body = Vec::new();
        while let Some(chunk) = session.read_body_bytes().await.map_err(|e| e.to_string())? {
            if body.len() + chunk.len() > 4 << 20 {
                return Err("metrics body over 4 MiB".into());
            }
            body.extend_from_slice(&chunk);
        }
        release_probe_session(session, &peer, Duration::from_secs(30)).await;
        String::from_utf8(body).map_err(|_| "metrics body is not UTF-8".to_string())
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| format!("no answer within {} ms", timeout.as_millis()))?
}

/// Scrape every backend of the fleet in force, every `telemetry.interval_ms`, until `shutdown`.
/// The generation is read afresh each round, so a reload can add backends or turn scraping off.
pub async fn scrape_forever(current: &Current, shutdown: &mut ShutdownWatch) {
    loop {
        let generation = current.load();
        let cfg = &generation.config;
        let interval = Duration::from_millis(cfg.telemetry.interval_ms);
        let timeout = Duration::from_millis(cfg.telemetry.timeout_ms).min(interval);
        let fleet = generation.fleet.clone();
        let mut tasks = tokio::task::JoinSet::new();
        let backends = if cfg.telemetry.enabled {
            fleet.backends()
        } else {
            &[]
        };
        for (i, b) in backends.iter().enumerate() {
            let (b, fleet) = (b.clone(), fleet.clone());
            tasks.spawn(async move {
                // What the engine serves: routed by unless the config pins it (a model that
                // disappears from the list stops being routed here), and where it does, still
                // the word on which models are LoRA adapters. A failed fetch keeps the last list.
                match fetch(b.peer(), "/v1/models", b.engine_auth.as_deref(), timeout).await {
                    Ok(t) => match parse_model_list(&t) {
                        Some(list) => fleet.discover_models(i, list),
                        None => log::debug!("models {}: not an OpenAI model list", b.name),
                    },
                    Err(e) => log::debug!("models {}: {e}", b.name),
                }
                let text = match fetch(b.peer(), &b.metrics_path, b.engine_auth.as_deref(), timeout)
                    .await
                {
                    Ok(t) => t,
                    Err(e) => {
                        log::debug!("telemetry {}: {e}", b.name);
                        return;
                    }
                };
                let mut stats = parse_engine(b.engine, &text);
                let lora = parse_lora(b.engine, &text);
                // llama.cpp exports neither its KV size nor its slots on /metrics; /props
                // says both. Asked until it answers once: they change only with a restart.
                if b.engine == EngineKind::Llamacpp && b.slots().is_none() {
                    match fetch(b.peer(), "/props", b.engine_auth.as_deref(), timeout).await {
                        Ok(t) => add_llamacpp_props(&t, &mut stats),
                        Err(e) => log::debug!("props {}: {e}", b.name),
                    }
                }
                if let Some(dcgm) = b.dcgm {
                    match fetch(http_peer(dcgm, None), "/metrics", None, timeout).await {
                        Ok(t) => parse_dcgm(&t, &mut stats),
                        Err(e) => log::debug!("dcgm {}: {e}", b.name),
                    }
                }
                fleet.observe_scrape(i, stats, lora);
            });
        }
        while tasks.join_next().await.is_some() {}
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => return,
        }
    }
}
