//! Process wiring: config -> fleet -> Pingora services (proxy, admin, health checks) -> run.
//! Shared by the `kvroute` binary and `kvbench`, which embeds the proxy for its comparisons.

use pingora::server::configuration::Opt;
use pingora::server::Server;
use pingora::services::background::GenBackgroundService;
use pingora::services::listening::Service;
use std::path::PathBuf;
use std::sync::Arc;

use crate::admin::AdminApp;
use crate::config::Config;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::proxy::Router;
use crate::state::State;
use crate::telemetry::TelemetryService;

fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("kvroute: {msg}");
    std::process::exit(1);
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
    let metrics = Metrics::new().unwrap_or_else(|e| fail(format!("metrics: {e}")));
    if opt.test {
        println!(
            "kvroute: config {} is valid ({} backends)",
            path.display(),
            cfg.backends.len()
        );
    }

    let mut server =
        Server::new(Some(opt)).unwrap_or_else(|e| fail(format!("pingora config: {e}")));
    server.bootstrap();

    let telemetry_enabled = cfg.telemetry.enabled;
    let listen = cfg.listen.clone();
    let admin_listen = cfg.admin_listen.clone();
    let health = fleet.load_balancer();
    let state = Arc::new(State::new(cfg, fleet, metrics));

    let mut proxy = pingora::proxy::http_proxy_service_with_name(
        &server.configuration,
        Router {
            state: state.clone(),
        },
        "kvroute proxy",
    );
    proxy.add_tcp(&listen);

    let mut admin = Service::new(
        "kvroute admin".to_string(),
        AdminApp {
            state: state.clone(),
        },
    );
    admin.add_tcp(&admin_listen);

    let health = GenBackgroundService::new("kvroute health checks".to_string(), health);

    server.add_service(proxy);
    server.add_service(admin);
    server.add_service(health);
    if telemetry_enabled {
        server.add_service(GenBackgroundService::new(
            "kvroute engine telemetry".to_string(),
            Arc::new(TelemetryService {
                state: state.clone(),
            }),
        ));
    }
    log::info!("kvroute listening on {listen}, admin on {admin_listen}");
    server.run_forever();
}
