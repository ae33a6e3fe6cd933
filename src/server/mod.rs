//! Process wiring: config -> fleet -> Pingora services (proxy, admin, health checks) -> run.
//! Shared by the `kvroute` binary and `kvbench`, which embeds the proxy for its comparisons.

use async_trait::async_trait;
use pingora::server::configuration::Opt;
use pingora::server::{RunArgs, Server, ShutdownWatch};
use pingora::services::background::{BackgroundService, GenBackgroundService};
use pingora::services::listening::Service;
use prometheus::Registry;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::Config;
use crate::edge::tls::{self, TlsEdge};
use crate::edge::{EdgeState, Listener, Transport};
use crate::fleet::kv_events::{follow_forever, KvEventMetrics};
use crate::fleet::{scrape_forever, Current, Fleet, FleetMetrics, Generation};
use crate::proxy::{ProxyMetrics, Router};
use crate::request::engine_tokens::EngineTokenizers;
use crate::request::response_id::ResponseIds;
use crate::request::{TokenEstimator, TokenMetrics};

mod admin;
mod drain;
mod ports;
mod reload;

use admin::AdminApp;
use drain::DrainWatch;
use reload::{unix_now, ReloadMetrics, Reloader};

/// The engine telemetry scrape loop as a Pingora background service.
struct Telemetry(Arc<Current>);

#[async_trait]
impl BackgroundService for Telemetry {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        scrape_forever(&self.0, &mut shutdown).await;
    }
}

/// Follows the engines' KV events, as a Pingora background service.
struct KvEvents(Arc<Current>, KvEventMetrics);

#[async_trait]
impl BackgroundService for KvEvents {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        follow_forever(&self.0, self.1.clone(), &mut shutdown).await;
    }
}

/// Loads the BPE tables once the process runs: after `-d` has forked, so no loader thread is
/// lost with the parent.
struct TokenizerLoad(Arc<TokenEstimator>);

#[async_trait]
impl BackgroundService for TokenizerLoad {
    async fn start(&self, _shutdown: ShutdownWatch) {
        let tokens = self.0.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || tokens.load_pending()).await {
            log::error!("the tokenizer loader failed, prompts are estimated by size: {e}");
        }
    }
}

fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("kvroute: {msg}");
    std::process::exit(1);
}

/// Install the process's SIGHUP disposition before anything else runs: until the reload service
/// starts listening, a SIGHUP (an early `systemctl reload`) must not take the default action,
/// which is to exit. tokio's handler, once registered, stays for the life of the process.
fn shield_sighup() {
    let registered = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map(|rt| {
            rt.block_on(async {
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).is_ok()
            })
        });
    if !matches!(registered, Ok(true)) {
        log::warn!("could not pre-register SIGHUP; a reload during start-up would stop kvroute");
    }
}

/// Validate the config named by `opt.conf` and serve until Pingora shuts the process down.
/// With `opt.test` (`-t`), exit after validating. Exits the process on a bad config.
pub fn run(mut opt: Opt) -> ! {
    let Some(conf) = opt.conf.clone() else {
        eprintln!("kvroute: a config file is required: kvroute -c FILE (see conf/kvroute.yaml)");
        std::process::exit(2);
    };
    // `-d` changes directory before the file is read again on reload: keep an absolute path.
    let path: PathBuf =
        std::fs::canonicalize(&conf).unwrap_or_else(|e| fail(format!("config file {conf}: {e}")));
    opt.conf = Some(path.display().to_string());
    let cfg = Config::load(&path)
        .unwrap_or_else(|e| fail(format!("invalid config {}: {e}", path.display())));
    let fleet = Fleet::new(&cfg).unwrap_or_else(|e| fail(e));
    let registry = Registry::new();
    let metrics_failed = |e: prometheus::Error| -> ! { fail(format!("metrics: {e}")) };
    let edge = Arc::new(EdgeState::register(&registry).unwrap_or_else(|e| metrics_failed(e)));
    let proxy_metrics =
        Arc::new(ProxyMetrics::register(&registry).unwrap_or_else(|e| metrics_failed(e)));
    let fleet_metrics = FleetMetrics::register(&registry).unwrap_or_else(|e| metrics_failed(e));
    let reload_metrics = ReloadMetrics::register(&registry).unwrap_or_else(|e| metrics_failed(e));
    let token_metrics = TokenMetrics::register(&registry).unwrap_or_else(|e| metrics_failed(e));
    let tokens = Arc::new(TokenEstimator::with_metrics(token_metrics));
    // Before `-t` returns: a rank file that does not load is a config error like any other.
    tokens
        .start(&cfg.routing)
        .unwrap_or_else(|e| fail(format!("invalid config {}: {e}", path.display())));
    let engine_tokens = cfg.kv_events.as_ref().map(|k| {
        Arc::new(
            EngineTokenizers::load(k)
                .unwrap_or_else(|e| fail(format!("invalid config {}: {e}", path.display()))),
        )
    });
    let response_ids = ResponseIds::from_config(&cfg.routing)
        .unwrap_or_else(|e| fail(format!("invalid config {}: {e}", path.display())));
    if cfg.routing.response_id_key_file.is_none() {
        log::warn!(
            "routing.response_id_key_file is not set: stored-response ids are signed with a key \
             of this process only, so a restart, an upgrade or another replica cannot route them"
        );
    }
    if engine_tokens.is_none() && cfg.backends.iter().any(|b| b.kv_events.is_some()) {
        log::warn!(
            "backends[].kv_events is set but kvroute.kv_events (the engines' tokenizer) is not: \
             placement stays on the approximate index"
        );
    }
    let kv_event_metrics =
        KvEventMetrics::register(&registry).unwrap_or_else(|e| metrics_failed(e));

    // Before `-t` returns: certificate files that do not load, match or are expired fail it.
    let tls_identity = cfg.tls.as_ref().map(|t| {
        tls::load(t).unwrap_or_else(|e| {
            fail(format!(
                "invalid config {}: kvroute.tls: {e}",
                path.display()
            ))
        })
    });
    let tls_edge = tls_identity
        .map(|id| Arc::new(TlsEdge::register(&registry, id).unwrap_or_else(|e| metrics_failed(e))));

    shield_sighup();
    // A reload re-reads the file's Pingora keys as the process did at start (Opt is not Clone).
    let reload_opt = Opt {
        upgrade: opt.upgrade,
        daemon: opt.daemon,
        nocapture: opt.nocapture,
        test: opt.test,
        conf: opt.conf.clone(),
    };
    let mut server =
        Server::new(Some(opt)).unwrap_or_else(|e| fail(format!("pingora config: {e}")));
    if reload_opt.test {
        println!(
            "kvroute: config {} is valid ({} backends)",
            path.display(),
            cfg.backends.len()
        );
        std::process::exit(0);
    }
    // On `-u` the listeners come from the old process, which still holds the addresses.
    if !reload_opt.upgrade {
        let mut addrs = vec![("kvroute.admin_listen", cfg.admin_listen.as_str())];
        if let Some(l) = &cfg.listen {
            addrs.push(("kvroute.listen", l.as_str()));
        }
        if let Some(t) = &cfg.tls {
            addrs.push(("kvroute.tls.listen", t.listen.as_str()));
        }
        ports::check_free(&addrs).unwrap_or_else(|e| fail(e));
    }
    // Bootstrap (taking over the listeners from the old process on `-u`) runs as a service, in
    // the daemon after `-d` forks, which is where Pingora's `daemon_wait_for_ready` expects it.
    let bootstrap = server.bootstrap_as_a_service();

    let listen = cfg.listen.clone();
    let tls_listen = cfg.tls.as_ref().map(|t| t.listen.clone());
    let listeners = cfg.client_listeners();
    let admin_listen = cfg.admin_listen.clone();
    let health = fleet.load_balancer();
    let current = Arc::new(Current::new(Generation::new(
        cfg,
        fleet,
        engine_tokens,
        response_ids,
    )));
    reload_metrics.last_success.set(unix_now());
    let fleet_metrics = Arc::new(fleet_metrics);

    let router = Arc::new(pingora::proxy::http_proxy(
        &server.configuration,
        Router::new(
            current.clone(),
            edge.clone(),
            tokens.clone(),
            proxy_metrics.clone(),
        ),
    ));
    // Both client listeners are plain TCP listeners to Pingora (the TLS one terminates TLS in
    // `edge::tls`), so `-u` hands both sockets over to the new process the same way.
    let mut client_services = Vec::new();
    if let Some(addr) = &listen {
        let mut plain = Service::new(
            "kvroute proxy".to_string(),
            Listener::new(
                router.clone(),
                current.clone(),
                edge.clone(),
                Transport::Plain,
            ),
        );
        plain.add_tcp(addr);
        client_services.push(plain);
    }
    if let (Some(addr), Some(t)) = (&tls_listen, &tls_edge) {
        let mut tls = Service::new(
            "kvroute proxy tls".to_string(),
            Listener::new(
                router,
                current.clone(),
                edge.clone(),
                Transport::Tls(t.clone()),
            ),
        );
        tls.add_tcp(addr);
        client_services.push(tls);
    }

    let mut admin = Service::new(
        "kvroute admin".to_string(),
        AdminApp {
            registry,
            current: current.clone(),
            edge: edge.clone(),
            fleet_metrics: fleet_metrics.clone(),
        },
    );
    admin.add_tcp(&admin_listen);

    let health = GenBackgroundService::new("kvroute health checks".to_string(), health);

    for service in client_services {
        server.add_service(service).add_dependency(&bootstrap);
    }
    server.add_service(admin).add_dependency(&bootstrap);
    server.add_service(health);
    server.add_service(GenBackgroundService::new(
        "kvroute engine telemetry".to_string(),
        Arc::new(Telemetry(current.clone())),
    ));
    server.add_service(GenBackgroundService::new(
        "kvroute kv events".to_string(),
        Arc::new(KvEvents(current.clone(), kv_event_metrics)),
    ));
    server.add_service(GenBackgroundService::new(
        "kvroute tokenizer load".to_string(),
        Arc::new(TokenizerLoad(tokens.clone())),
    ));
    server.add_service(GenBackgroundService::new(
        "kvroute config reload".to_string(),
        Arc::new(Reloader {
            current: current.clone(),
            edge: edge.clone(),
            fleet_metrics,
            tokens,
            metrics: reload_metrics,
            tls: tls_edge,
            proxy_metrics,
            opt: reload_opt,
            server_conf: server.configuration.clone(),
        }),
    ));
    server.add_service(GenBackgroundService::new(
        "kvroute drain watch".to_string(),
        Arc::new(DrainWatch {
            edge,
            // Pingora's own default when the file sets none.
            grace: Duration::from_secs(server.configuration.grace_period_seconds.unwrap_or(300)),
            phases: Mutex::new(Some(server.watch_execution_phase())),
        }),
    ));
    log::info!("kvroute listening on {listeners}, admin on {admin_listen}");
    server.run(RunArgs::default());
    // Pingora ended the process's life (the grace period ran out, or a fast shutdown): the last
    // requests' access lines go out before the process does.
    crate::proxy::access_log::flush(Duration::from_millis(500));
    log::logger().flush();
    std::process::exit(0);
}
