//! The `kvroute:` section of the YAML file as a whole: loading, and validation that spans
//! sections.
//!
//! Pingora's own server keys (threads, pid_file, upgrade_sock, grace_period_seconds, ...) live at
//! the top level of the same file and are read by Pingora. Unknown keys under `kvroute:` are
//! errors, so a typo never silently falls back to a default.

use serde::Deserialize;
use std::path::Path;

use super::access::AccessConfig;
use super::backend::{self, BackendConfig};
use super::disagg::{self, DisaggregationConfig};
use super::error::{err, parse_addr, ConfigError};
use super::headers::ResponseHeadersConfig;
use super::health::{HealthCheckConfig, OutlierConfig, TelemetryConfig};
use super::kv_events::KvEventsConfig;
use super::limits::{LimitsConfig, TimeoutsConfig};
use super::log::LogConfig;
use super::passthrough::PassthroughConfig;
use super::routing::{PolicyKind, RoutingConfig};
use super::tenants::TenantsConfig;
use super::tls::TlsConfig;

/// Backends the prefix index can track: its per-block holder set is a 64-bit mask.
pub const MAX_INDEXED_BACKENDS: usize = 64;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Plaintext client listener (HTTP/1.1; also HTTP/2 with prior knowledge when `h2c`).
    /// Optional once `tls` is set: at least one client listener is required.
    #[serde(default)]
    pub listen: Option<String>,
    /// The TLS client listener; absent: plaintext only.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Serve HTTP/2 with prior knowledge (h2c) on the plaintext listener besides HTTP/1.1.
    #[serde(default)]
    pub h2c: bool,
    /// Metrics and health listener; must differ from the client listeners.
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    pub backends: Vec<BackendConfig>,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub health_check: HealthCheckConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub timeouts: TimeoutsConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub outlier: OutlierConfig,
    /// Models the fleet serves; a request for another gets 404. Empty: not checked.
    #[serde(default)]
    pub models: Vec<String>,
    /// API keys and per-key limits; absent: no access control.
    #[serde(default)]
    pub access: Option<AccessConfig>,
    /// Routes forwarded besides the inference API; everything else is 404.
    #[serde(default)]
    pub passthrough: PassthroughConfig,
    /// What of an engine's response head never reaches clients.
    #[serde(default)]
    pub response_headers: ResponseHeadersConfig,
    /// Tenants, priorities and fair sharing of the router queue.
    #[serde(default)]
    pub tenants: TenantsConfig,
    /// The access log's format.
    #[serde(default)]
    pub log: LogConfig,
    /// How requests are matched against the engines' KV events; absent: backends'
    /// `kv_events` are not followed.
    #[serde(default)]
    pub kv_events: Option<KvEventsConfig>,
    /// Prefill/decode disaggregation; absent: every backend serves requests whole.
    #[serde(default)]
    pub disaggregation: Option<DisaggregationConfig>,
}

fn default_admin_listen() -> String {
    "127.0.0.1:9090".into()
}

#[derive(Deserialize)]
struct FileRoot {
    kvroute: Option<serde_yaml::Value>,
}

impl Config {
    /// Read and validate the `kvroute:` section of a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| err(path.display().to_string(), format!("cannot read: {e}")))?;
        Self::from_yaml(&text)
    }

    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        let root: FileRoot =
            serde_yaml::from_str(text).map_err(|e| err("(file)", format!("invalid YAML: {e}")))?;
        let section = root
            .kvroute
            .ok_or_else(|| err("kvroute", "missing section"))?;
        // The path names the offending key (`kvroute.routing.policy`), not just the section.
        let mut cfg: Config = serde_path_to_error::deserialize(section).map_err(|e| {
            let path = e.path().to_string();
            let key = if path == "." {
                "kvroute".to_string()
            } else {
                format!("kvroute.{path}")
            };
            err(key, e.into_inner().to_string())
        })?;
        cfg.response_headers.normalize();
        cfg.tenants.normalize();
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_listeners()?;
        backend::validate(&self.backends)?;
        let roles: Vec<_> = self.backends.iter().map(|b| b.role).collect();
        disagg::validate_roles(&roles, self.disaggregation.as_ref())?;
        self.routing.validate()?;
        if self.routing.policy == PolicyKind::KvAware && self.backends.len() > MAX_INDEXED_BACKENDS
        {
            return Err(err(
                "kvroute.backends",
                format!("kv_aware tracks at most {MAX_INDEXED_BACKENDS} backends"),
            ));
        }
        self.routing.validate_kv_aware()?;
        self.telemetry.validate()?;
        self.health_check.validate()?;
        self.limits.validate()?;
        if let Some(a) = &self.access {
            a.validate()?;
        }
        self.outlier.validate()?;
        self.passthrough.validate()?;
        self.response_headers.validate()?;
        self.tenants.validate()?;
        if let Some(k) = &self.kv_events {
            k.validate()?;
        }
        self.timeouts.validate()
    }

    fn validate_listeners(&self) -> Result<(), ConfigError> {
        if self.listen.is_none() && self.tls.is_none() {
            return Err(err(
                "kvroute.listen",
                "required unless kvroute.tls is set (at least one client listener)",
            ));
        }
        if self.h2c && self.listen.is_none() {
            return Err(err(
                "kvroute.h2c",
                "needs kvroute.listen (h2c is HTTP/2 on the plaintext listener)",
            ));
        }
        let admin = parse_addr("kvroute.admin_listen", &self.admin_listen)?;
        let mut clients = Vec::new();
        if let Some(l) = &self.listen {
            clients.push(("kvroute.listen", parse_addr("kvroute.listen", l)?));
        }
        if let Some(t) = &self.tls {
            t.validate()?;
            clients.push((
                "kvroute.tls.listen",
                parse_addr("kvroute.tls.listen", &t.listen)?,
            ));
        }
        for (key, addr) in &clients {
            if *addr == admin {
                return Err(err(
                    "kvroute.admin_listen",
                    format!("must differ from {key} (metrics never share the client port)"),
                ));
            }
        }
        if let [(_, a), (_, b)] = clients.as_slice() {
            if a == b {
                return Err(err("kvroute.tls.listen", "must differ from kvroute.listen"));
            }
        }
        Ok(())
    }

    /// The client listeners' addresses, for logs: `plain` and `tls`.
    pub fn client_listeners(&self) -> String {
        let mut out = Vec::new();
        if let Some(l) = &self.listen {
            out.push(format!(
                "{l}{}",
                if self.h2c { " (http, h2c)" } else { " (http)" }
            ));
        }
        if let Some(t) = &self.tls {
            out.push(format!("{} (https, h2)", t.listen));
        }
        out.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
version: 1
threads: 2
kvroute:
  listen: "127.0.0.1:8080"
  backends:
    - addr: "127.0.0.1:8001"
    - addr: "127.0.0.1:8002"
      weight: 2
"#;

    #[test]
    fn minimal_file_gets_defaults() {
        let c = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(c.admin_listen, "127.0.0.1:9090");
        assert_eq!(c.tls, None);
        assert!(!c.h2c);
        assert_eq!(c.backends[0].weight, 1);
        assert_eq!(c.backends[1].weight, 2);
        assert_eq!(c.routing.policy, PolicyKind::KvAware);
        assert_eq!(c.routing.slack, 1);
        assert_eq!(c.health_check.path, "/health");
    }

    #[test]
    fn unknown_key_is_named() {
        let text = MINIMAL.replace("  listen:", "  lisen: x\n  listen:");
        let e = Config::from_yaml(&text).unwrap_err();
        assert!(e.reason.contains("lisen"), "{e}");
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            (
                "listen: \"127.0.0.1:8080\"",
                "listen: \"nope\"",
                "kvroute.listen",
            ),
            ("weight: 2", "weight: 0", "kvroute.backends[1].weight"),
            (
                "- addr: \"127.0.0.1:8002\"",
                "- addr: \"127.0.0.1:8001\"",
                "kvroute.backends[1].addr",
            ),
        ];
        for (from, to, key) in cases {
            let e = Config::from_yaml(&MINIMAL.replace(from, to)).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
        let e = Config::from_yaml(&format!("{MINIMAL}  routing:\n    epsilon: -1\n")).unwrap_err();
        assert_eq!(e.key, "kvroute.routing.epsilon");
        for replicas in [0, 65] {
            let yaml = format!("{MINIMAL}  routing:\n    replicas: {replicas}\n");
            let e = Config::from_yaml(&yaml).unwrap_err();
            assert_eq!(e.key, "kvroute.routing.replicas", "{e}");
        }
        let e =
            Config::from_yaml(&format!("{MINIMAL}  routing:\n    policy: magic\n")).unwrap_err();
        assert!(e.reason.contains("magic"), "{e}");
        let e = Config::from_yaml(&format!("{MINIMAL}  admin_listen: \"127.0.0.1:8080\"\n"))
            .unwrap_err();
        assert_eq!(e.key, "kvroute.admin_listen");
    }

    #[test]
    fn listeners_tls_and_h2c() {
        let tls = "  tls:\n    listen: \"127.0.0.1:8443\"\n    cert: /c.pem\n    key: /k.pem\n";
        let c = Config::from_yaml(&format!("{MINIMAL}{tls}  h2c: true\n")).unwrap();
        let t = c.tls.as_ref().unwrap();
        assert_eq!(
            (t.listen.as_str(), t.client_ca.as_ref()),
            ("127.0.0.1:8443", None)
        );
        assert!(c.h2c);
        // TLS alone is enough; nothing at all is not.
        let no_plain = MINIMAL.replace("  listen: \"127.0.0.1:8080\"\n", "");
        let c = Config::from_yaml(&format!("{no_plain}{tls}")).unwrap();
        assert_eq!(c.listen, None);
        assert_eq!(
            Config::from_yaml(&no_plain).unwrap_err().key,
            "kvroute.listen"
        );
        let e = Config::from_yaml(&format!("{no_plain}{tls}  h2c: true\n")).unwrap_err();
        assert_eq!(e.key, "kvroute.h2c");
        let cases = [
            (tls.replace("8443", "8080"), "kvroute.tls.listen"),
            (tls.replace("8443", "9090"), "kvroute.admin_listen"),
            (tls.replace("/k.pem", "k.pem"), "kvroute.tls.key"),
            (
                format!("{tls}    client_ca: ca.pem\n"),
                "kvroute.tls.client_ca",
            ),
            (tls.replace("    key: /k.pem\n", ""), "kvroute.tls"),
        ];
        for (section, key) in cases {
            let e = Config::from_yaml(&format!("{MINIMAL}{section}")).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
    }

    #[test]
    fn backend_tls_is_checked() {
        let with =
            |tls: &str| MINIMAL.replace("      weight: 2\n", &format!("      weight: 2\n{tls}"));
        let c = Config::from_yaml(&with("      tls:\n        sni: engine-2.internal\n")).unwrap();
        let t = c.backends[1].tls.as_ref().unwrap();
        assert_eq!(
            (t.sni.as_str(), t.ca.as_ref(), t.verify),
            ("engine-2.internal", None, true)
        );
        for (tls, key) in [
            (
                "      tls:\n        sni: \"\"\n",
                "kvroute.backends[1].tls.sni",
            ),
            (
                "      tls:\n        sni: a\n        ca: ca.pem\n",
                "kvroute.backends[1].tls.ca",
            ),
            (
                "      tls:\n        ca: /ca.pem\n",
                "kvroute.backends[1].tls",
            ),
        ] {
            assert_eq!(Config::from_yaml(&with(tls)).unwrap_err().key, key, "{tls}");
        }
    }

    #[test]
    fn missing_section_and_empty_backends() {
        assert_eq!(
            Config::from_yaml("version: 1\n").unwrap_err().key,
            "kvroute"
        );
        let e =
            Config::from_yaml("kvroute:\n  listen: \"127.0.0.1:1\"\n  backends: []\n").unwrap_err();
        assert_eq!(e.key, "kvroute.backends");
    }

    #[test]
    fn example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/kvroute.yaml");
        Config::load(&path).unwrap();
    }
}
