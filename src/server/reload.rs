//! Hot reload on SIGHUP: re-read the config file, validate it, and publish a new config and
//! fleet without dropping a request. Pingora has no SIGHUP handler of its own (the default
//! action would kill the process), so a background service owns the signal.
//!
//! Backends that stay keep their load accounting, learned prefill rate, telemetry, health and
//! prefix-index slot; requests in flight finish on the backend and fleet generation they were
//! placed with. The BPE tables are rebuilt when the file names other ones (or a rank file changed
//! on disk), dropped when it counts nothing. A file that fails to load or validate, or names a
//! rank file that does not load, changes nothing.

use async_trait::async_trait;
use pingora::server::configuration::{Opt, ServerConf};
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use prometheus::{Gauge, IntCounterVec, IntGauge, Registry};
use std::collections::BTreeSet;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::signal::unix::{signal, SignalKind};

use crate::config::{Config, ConfigError};
use crate::edge::tls::{self, TlsEdge, TlsError};
use crate::edge::EdgeState;
use crate::fleet::{Current, FleetError, FleetMetrics, Generation};
use crate::metrics::{counter_vec, gauge, int_gauge};
use crate::proxy::ProxyMetrics;
use crate::request::engine_tokens::EngineTokenizers;
use crate::request::response_id::ResponseIds;
use crate::request::TokenEstimator;

/// Why a reload changed nothing.
#[derive(Debug)]
pub enum ReloadError {
    /// The file could not be read or is not a valid config.
    Config { path: PathBuf, error: ConfigError },
    /// Pingora's own keys in the file are invalid.
    ServerKeys { path: PathBuf, reason: String },
    /// The fleet the file describes could not be built.
    Fleet(FleetError),
    /// The TLS listener's certificate, key or client CA cannot be served.
    Tls(TlsError),
}

impl fmt::Display for ReloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReloadError::Config { path, error } => write!(f, "{}: {error}", path.display()),
            ReloadError::ServerKeys { path, reason } => {
                write!(f, "{}: Pingora server keys: {reason}", path.display())
            }
            ReloadError::Fleet(e) => e.fmt(f),
            ReloadError::Tls(e) => write!(f, "kvroute.tls: {e}"),
        }
    }
}

impl std::error::Error for ReloadError {}

impl From<FleetError> for ReloadError {
    fn from(e: FleetError) -> Self {
        ReloadError::Fleet(e)
    }
}

/// The reload service's families.
pub(super) struct ReloadMetrics {
    reloads: IntCounterVec,
    /// Also set at start, by `server::run`.
    pub last_success: Gauge,
    pending_upgrade: IntGauge,
}

impl ReloadMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<ReloadMetrics> {
        let m = ReloadMetrics {
            reloads: counter_vec(
                r,
                "kvroute_config_reloads_total",
                "Config reloads (SIGHUP), by result (success, failure).",
                &["result"],
            )?,
            last_success: gauge(
                r,
                "kvroute_config_last_reload_success_timestamp_seconds",
                "Unix time of the last config load that took effect (start or reload).",
            )?,
            pending_upgrade: int_gauge(
                r,
                "kvroute_config_pending_upgrade",
                "1 if the config file changes settings that only a binary upgrade applies \
                 (listeners, health checks, Pingora server keys).",
            )?,
        };
        for result in ["success", "failure"] {
            m.reloads.with_label_values(&[result]);
        }
        Ok(m)
    }
}

/// What a successful reload changed.
#[derive(Debug, Default, PartialEq)]
pub struct Applied {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Settings the file changes that stay as they are until a binary upgrade.
    pub pending_upgrade: Vec<&'static str>,
}

/// Settings of `file` that differ from the `running` config and that this process cannot apply:
/// Pingora binds listeners and fixes the health checker's settings at start.
pub fn needs_upgrade(running: &Config, file: &Config) -> Vec<&'static str> {
    let mut out = Vec::new();
    if running.listen != file.listen {
        out.push("kvroute.listen");
    }
    if running.admin_listen != file.admin_listen {
        out.push("kvroute.admin_listen");
    }
    if running.tls.as_ref().map(|t| &t.listen) != file.tls.as_ref().map(|t| &t.listen) {
        out.push("kvroute.tls.listen");
    }
    if running.health_check != file.health_check {
        out.push("kvroute.health_check");
    }
    out
}

/// The config to run: everything from `file` except what only an upgrade can change, which
/// keeps its running value so the published config describes what the process really does.
pub fn effective(running: &Config, mut file: Config) -> Config {
    file.listen = running.listen.clone();
    file.admin_listen = running.admin_listen.clone();
    file.health_check = running.health_check.clone();
    // The TLS listener stays bound as it is; its files follow the file where it still has them.
    file.tls = match (&running.tls, file.tls) {
        (Some(run), Some(mut new)) => {
            new.listen = run.listen.clone();
            Some(new)
        }
        (run, _) => run.clone(),
    };
    // h2c needs the plaintext listener this process has, whatever the file says.
    file.h2c &= running.listen.is_some();
    file
}

pub(super) struct Reloader {
    pub current: Arc<Current>,
    pub edge: Arc<EdgeState>,
    /// Shared with the admin listener: a removed backend's gauges are dropped.
    pub fleet_metrics: Arc<FleetMetrics>,
    /// Its BPE tables follow the reloaded `routing` keys.
    pub tokens: Arc<TokenEstimator>,
    pub metrics: ReloadMetrics,
    /// The TLS listener's certificate, re-read on every reload (renewed files keep their path).
    pub tls: Option<Arc<TlsEdge>>,
    /// Added backends' failure counters start at zero.
    pub proxy_metrics: Arc<ProxyMetrics>,
    /// The Pingora options the process started with, to re-read the file's server keys.
    pub opt: Opt,
    pub server_conf: Arc<ServerConf>,
}

impl Reloader {
    fn path(&self) -> PathBuf {
        PathBuf::from(self.opt.conf.clone().unwrap_or_default())
    }

    /// Load the file and, if valid, publish it. On error nothing changes.
    pub async fn reload(&self) -> Result<Applied, ReloadError> {
        let path = self.path();
        let file = Config::load(&path).map_err(|error| ReloadError::Config {
            path: path.clone(),
            error,
        })?;
        let old = self.current.load();
        let running = &old.config;
        let mut pending_upgrade = needs_upgrade(running, &file);
        match ServerConf::load_yaml_with_opt_override(&self.opt) {
            Ok(server) if server != *self.server_conf => {
                pending_upgrade.push("Pingora server keys (threads, pid_file, grace periods, ...)")
            }
            Ok(_) => {}
            Err(e) => {
                return Err(ReloadError::ServerKeys {
                    path,
                    reason: e.to_string(),
                })
            }
        }
        let cfg = effective(running, file);
        let fleet = old.fleet.reload(&cfg)?;
        // Built before anything is published, so a rank file that does not load rejects the
        // whole reload; installed together with the config.
        let tables =
            self.tokens
                .prepare(&cfg.routing)
                .await
                .map_err(|error| ReloadError::Config {
                    path: path.clone(),
                    error,
                })?;
        // Certificates are re-read even when the paths did not change: certbot and ACME clients
        // renew in place. Checked before anything is published; installed after.
        let identity = match (&self.tls, &cfg.tls) {
            (Some(_), Some(t)) => Some(tls::load(t).map_err(ReloadError::Tls)?),
            _ => None,
        };
        // The engines' tokenizers: kept while their settings stay, else loaded (off the
        // runtime: a large tokenizer.json takes a few hundred ms) before anything is published.
        let engine_tokens = match &cfg.kv_events {
            None => None,
            Some(k) if running.kv_events.as_ref() == Some(k) => old.engine_tokens.clone(),
            Some(k) => {
                let k = k.clone();
                let loaded = tokio::task::spawn_blocking(move || EngineTokenizers::load(&k))
                    .await
                    .map_err(|e| ReloadError::Config {
                        path: path.clone(),
                        error: ConfigError {
                            key: "kvroute.kv_events".into(),
                            reason: format!("the tokenizer loader failed: {e}"),
                        },
                    })?
                    .map_err(|error| ReloadError::Config {
                        path: path.clone(),
                        error,
                    })?;
                Some(Arc::new(loaded))
            }
        };
        let response_ids =
            ResponseIds::from_config(&cfg.routing).map_err(|error| ReloadError::Config {
                path: path.clone(),
                error,
            })?;
        fleet.sync_health().await?;

        let before: BTreeSet<&str> = old
            .fleet
            .backends()
            .iter()
            .map(|b| b.name.as_str())
            .collect();
        let after: BTreeSet<&str> = fleet.backends().iter().map(|b| b.name.as_str()).collect();
        let applied = Applied {
            added: after.difference(&before).map(|s| s.to_string()).collect(),
            removed: before.difference(&after).map(|s| s.to_string()).collect(),
            pending_upgrade,
        };
        let limiter = &self.edge.limiter;
        match &cfg.access {
            Some(acl) => limiter.retain(acl),
            None => limiter.retain(&Default::default()),
        }
        self.tokens.apply(tables);
        if let (Some(edge_tls), Some(id)) = (&self.tls, identity) {
            log::info!(
                "TLS certificate serial {} (expires at unix time {}) serves new handshakes",
                id.serial,
                id.not_after
            );
            edge_tls.install(id);
        }
        self.current
            .publish(Generation::new(cfg, fleet, engine_tokens, response_ids));
        for name in &applied.removed {
            self.fleet_metrics.forget_backend(name);
        }
        Ok(applied)
    }

    /// Reload and report: log, count, timestamp.
    pub async fn reload_and_report(&self) {
        let m = &self.metrics;
        match self.reload().await {
            Ok(a) => {
                for name in &a.added {
                    self.proxy_metrics.init_backend(name);
                }
                m.reloads.with_label_values(&["success"]).inc();
                m.last_success.set(unix_now());
                m.pending_upgrade
                    .set(i64::from(!a.pending_upgrade.is_empty()));
                log::info!(
                    "config reloaded from {}: backends added {:?}, removed {:?}",
                    self.path().display(),
                    a.added,
                    a.removed
                );
                if !a.pending_upgrade.is_empty() {
                    log::warn!(
                        "config reload: {} changed but only take effect after a binary upgrade \
                         (kvroute -u); the running values are kept",
                        a.pending_upgrade.join(", ")
                    );
                }
            }
            Err(e) => {
                m.reloads.with_label_values(&["failure"]).inc();
                log::error!("config reload rejected, still running the previous config: {e}");
            }
        }
    }
}

pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[async_trait]
impl BackgroundService for Reloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                log::error!("cannot install the SIGHUP handler, reload is unavailable: {e}");
                return;
            }
        };
        loop {
            tokio::select! {
                got = hup.recv() => {
                    if got.is_none() {
                        return;
                    }
                    log::info!("SIGHUP received: reloading the config");
                    self.reload_and_report().await;
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Config {
        Config::from_yaml(&format!(
            "kvroute:\n  listen: \"127.0.0.1:1\"\n  backends:\n    - addr: \"127.0.0.1:2\"\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn upgrade_only_settings_are_reported_and_kept() {
        let running = cfg("");
        let mut file =
            cfg("  routing:\n    policy: round_robin\n  health_check:\n    path: /ping\n");
        file.listen = Some("127.0.0.1:9".into());
        assert_eq!(
            needs_upgrade(&running, &file),
            vec!["kvroute.listen", "kvroute.health_check"]
        );
        let eff = effective(&running, file.clone());
        assert_eq!(eff.listen, running.listen);
        assert_eq!(eff.health_check, running.health_check);
        assert_eq!(
            eff.routing, file.routing,
            "reloadable settings come from the file"
        );
        assert!(needs_upgrade(&running, &eff).is_empty());
    }

    #[test]
    fn tls_listener_is_kept_and_its_files_follow_the_file() {
        let tls = |port: u16, cert: &str| {
            format!("  tls:\n    listen: \"127.0.0.1:{port}\"\n    cert: {cert}\n    key: /k\n")
        };
        let running = cfg(&tls(8443, "/old.pem"));
        let file = cfg(&tls(9443, "/new.pem"));
        assert_eq!(needs_upgrade(&running, &file), vec!["kvroute.tls.listen"]);
        let eff = effective(&running, file);
        let t = eff.tls.as_ref().unwrap();
        assert_eq!(
            (t.listen.as_str(), t.cert.to_str()),
            ("127.0.0.1:8443", Some("/new.pem"))
        );
        // A file that drops the section, or adds one, cannot close or open a listener.
        let eff = effective(&running, cfg(""));
        assert_eq!(eff.tls, running.tls);
        let plain = cfg("");
        let with_tls = cfg(&tls(8443, "/c.pem"));
        assert_eq!(needs_upgrade(&plain, &with_tls), vec!["kvroute.tls.listen"]);
        assert_eq!(effective(&plain, with_tls).tls, None);
    }
}
