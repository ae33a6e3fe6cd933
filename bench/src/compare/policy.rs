//! `--policies` entries and the kvroute config each run gets.
//!
//! An entry is a kvroute policy name, optionally followed by options, each after a `/`:
//! `kv_aware/rates=true/learn=off`. The whole entry labels the run in the report, so variants
//! of one policy sit side by side.
//! - `rates=true`: every backend is configured with `prefill_tokens_per_s`, its profile's true
//!   prefill rate (model time), as an operator who measured the fleet would write it.
//! - `rates=PROFILE*F+PROFILE*F`: backends of the listed profiles get their true rate times
//!   `F` (a deliberately wrong configuration), the others their true rate.
//! - `weights=PROFILE*W+PROFILE*W`: backends of the listed profiles get `weight: W` (1-1000;
//!   the others 1), as an operator who knows the faster engines would weight them.
//! - `learn=on|off`: `routing.learn_prefill_rate`, whether kvroute corrects configured rates
//!   from the engines' telemetry.
//! - `replicas=N`: N kvroute processes with this config in front of the one fleet (each
//!   conversation's turns spread over them; see `compare --replicas`).
//! - `events=on`: kvroute follows the simulated engines' KV events (`compare --kv-events`)
//!   with the simulators' tokenizer and chat template: the exact index, against the
//!   approximate one of a plain entry on the same fleet.
//! - `routing.KEY=VALUE`: any other `kvroute.routing` setting, e.g.
//!   `kv_aware/routing.duplicate_prefill_weight=0`, to measure one knob's effect (kvroute
//!   checks the key and value when it starts).
//! - `telemetry.KEY=VALUE`: a `kvroute.telemetry` setting, e.g.
//!   `kv_aware/replicas=2/telemetry.interval_ms=250`.
//! - `limits.KEY=VALUE`, `tenants.KEY=VALUE`: a `kvroute.limits` or `kvroute.tenants`
//!   setting, a dotted KEY reaching into a nested one: the router queue and its order for the
//!   noisy neighbor, e.g. `kv_aware/limits.backend_max_inflight=4` and, for first come first
//!   served, `.../tenants.fair_share.prompt_weight=0/tenants.fair_share.completion_weight=0`.
//!   A run whose workload names its tenants also gets `tenants.names` (so kvroute's metrics
//!   name them rather than `other`).
//!
//! Without options the config is exactly what a plain policy run always had.
//!
//! - `pd=cost|always`, `pd_protocol=vllm_nixl|sglang_bootstrap` (with `compare --pd`): the
//!   run's servers are prefill and decode servers, and kvroute disaggregates with that
//!   `decision` over that protocol (vLLM's by default; see `pd`).
//!
//! An entry may instead name a peer router and its policy, `sglang-router/cache_aware`: that
//! run starts the peer (see `peer`) in front of the fleet instead of kvroute. `PEER/pd` (with
//! `compare --pd`) is the peer's own P/D mode.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;

use super::pd::{self, Link, PdRun, Protocol, Role};
use crate::sim::{Profile, ProfileName};

/// The options an entry may carry, for errors.
const KNOWN_OPTIONS: &str = "rates, weights, learn, replicas, events, pd, pd_protocol, \
     routing.KEY, telemetry.KEY, limits.KEY, tenants.KEY";

/// The kvroute config sections whose keys an entry may set (`SECTION.KEY=VALUE`).
const SECTIONS: [&str; 4] = ["routing", "telemetry", "limits", "tenants"];

/// Replicas one run may start (each is a kvroute process on this machine's cores).
pub const MAX_REPLICAS: usize = 4;

#[derive(Debug, Clone, PartialEq)]
pub enum Rates {
    /// No `prefill_tokens_per_s`: kvroute's default.
    Omit,
    /// Every backend's true rate.
    True,
    /// True rate times the factor for backends of the listed profiles.
    Scaled(Vec<(ProfileName, f64)>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct PolicyRun {
    /// The entry as given; names the run in the report.
    pub label: String,
    pub policy: String,
    pub rates: Rates,
    /// `weight` for backends of these profiles (`weights=`); the others keep the default.
    pub weights: Vec<(ProfileName, u32)>,
    /// `routing.learn_prefill_rate`, when given.
    pub learn: Option<bool>,
    /// Other `kvroute.routing` settings, in the order given.
    pub routing: Vec<(String, String)>,
    /// `kvroute.telemetry` settings, in the order given.
    pub telemetry: Vec<(String, String)>,
    /// `kvroute.limits` and `kvroute.tenants` settings, dotted keys, in the order given.
    pub limits: Vec<(String, String)>,
    pub tenants: Vec<(String, String)>,
    /// `tenants.names`: set by `compare` from the workload, not by the entry.
    pub tenant_names: Vec<String>,
    /// kvroute processes in front of the fleet (1 unless `replicas=N`).
    pub replicas: usize,
    /// Follow the engines' KV events (`events=on`).
    pub events: bool,
    /// Set when the entry names a peer router: the run starts it instead of kvroute, and
    /// `policy` is the peer's policy.
    pub peer: Option<PeerRouter>,
    /// Set when the run disaggregates (`pd=`, `PEER/pd`): its fleet is split into prefill and
    /// decode servers (`compare --pd`).
    pub pd: Option<PdRun>,
}

/// A router that kvroute is measured against, installed from PyPI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerRouter {
    Sglang,
    Vllm,
}

impl PeerRouter {
    pub const ALL: [PeerRouter; 2] = [PeerRouter::Sglang, PeerRouter::Vllm];
    /// The peers' policies a comparison offers: the ones both peers have and that kvroute's
    /// own policies correspond to (its cache-aware tree, and the no-affinity floor).
    pub const POLICIES: [&'static str; 2] = ["cache_aware", "round_robin"];

    /// The PyPI distribution name, also the entry's first part.
    pub fn name(self) -> &'static str {
        match self {
            PeerRouter::Sglang => "sglang-router",
            PeerRouter::Vllm => "vllm-router",
        }
    }

    fn parse(name: &str) -> Option<PeerRouter> {
        PeerRouter::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The P/D protocol of the peer's P/D mode: each speaks its own engine's.
    pub fn pd_protocol(self) -> Protocol {
        match self {
            PeerRouter::Sglang => Protocol::SglangBootstrap,
            PeerRouter::Vllm => Protocol::VllmNixl,
        }
    }
}

impl PolicyRun {
    /// Parses one `--policies` entry; the error says what is wrong with it.
    pub fn parse(entry: &str) -> Result<Self, String> {
        let label = entry.trim();
        let mut parts = label.split('/');
        let policy = parts.next().unwrap_or_default();
        let name_ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
        if policy.is_empty() || !policy.chars().all(name_ok) {
            return Err(format!(
                "policy entry {label:?}: {policy:?} is not a policy name (letters, digits, _ and -)"
            ));
        }
        let mut run = PolicyRun {
            label: label.to_string(),
            policy: policy.to_string(),
            rates: Rates::Omit,
            weights: Vec::new(),
            learn: None,
            routing: Vec::new(),
            telemetry: Vec::new(),
            limits: Vec::new(),
            tenants: Vec::new(),
            tenant_names: Vec::new(),
            replicas: 1,
            events: false,
            peer: None,
            pd: None,
        };
        if let Some(peer) = PeerRouter::parse(policy) {
            // kvroute's options configure kvroute; a peer runs with its own defaults.
            let rest: Vec<&str> = parts.collect();
            let known = PeerRouter::POLICIES.join(", ");
            let [peer_policy] = rest[..] else {
                return Err(format!(
                    "policy entry {label:?}: a peer takes exactly one policy, {}/POLICY with \
                     POLICY one of {known}, or pd",
                    peer.name()
                ));
            };
            if peer_policy == "pd" {
                run.policy = peer_policy.to_string();
                run.peer = Some(peer);
                run.pd = Some(PdRun {
                    protocol: peer.pd_protocol(),
                    decision: None,
                    link: Link::default(),
                });
                return Ok(run);
            }
            if !PeerRouter::POLICIES.contains(&peer_policy) {
                return Err(format!(
                    "policy entry {label:?}: {peer_policy:?} is not a {} policy offered here \
                     ({known}, or pd)",
                    peer.name()
                ));
            }
            run.policy = peer_policy.to_string();
            run.peer = Some(peer);
            return Ok(run);
        }
        let (mut seen_rates, mut seen_learn, mut seen_replicas) = (false, false, false);
        let (mut seen_events, mut seen_weights) = (false, false);
        let mut protocol = None;
        for option in parts {
            let bad = |why: String| format!("policy entry {label:?}: {why}");
            let Some((key, value)) = option.split_once('=') else {
                return Err(bad(format!(
                    "option {option:?} is not KEY=VALUE (known: {KNOWN_OPTIONS})"
                )));
            };
            match key {
                "rates" if !seen_rates => {
                    seen_rates = true;
                    run.rates = parse_rates(value).map_err(bad)?;
                }
                "weights" if !seen_weights => {
                    seen_weights = true;
                    run.weights = parse_weights(value).map_err(bad)?;
                }
                "learn" if !seen_learn => {
                    seen_learn = true;
                    run.learn = Some(match value {
                        "on" | "true" => true,
                        "off" | "false" => false,
                        _ => return Err(bad(format!("learn={value:?}: expected on or off"))),
                    });
                }
                "replicas" if !seen_replicas => {
                    seen_replicas = true;
                    run.replicas = match value.parse::<usize>() {
                        Ok(n) if (1..=MAX_REPLICAS).contains(&n) => n,
                        _ => {
                            return Err(bad(format!(
                                "replicas={value:?}: expected 1 to {MAX_REPLICAS}"
                            )))
                        }
                    };
                }
                "events" if !seen_events => {
                    seen_events = true;
                    run.events = match value {
                        "on" | "true" => true,
                        "off" | "false" => false,
                        _ => return Err(bad(format!("events={value:?}: expected on or off"))),
                    };
                }
                "pd" if run.pd.is_none() => {
                    run.pd = Some(PdRun {
                        protocol: Protocol::VllmNixl,
                        decision: Some(pd::parse_decision(value).map_err(bad)?),
                        link: Link::default(),
                    });
                }
                "pd_protocol" if protocol.is_none() => {
                    protocol = Some(Protocol::parse(value).map_err(bad)?);
                }
                "rates" | "weights" | "learn" | "replicas" | "events" | "pd" | "pd_protocol" => {
                    return Err(bad(format!("option {key} given twice")))
                }
                _ if SECTIONS
                    .iter()
                    .any(|s| key.split_once('.').is_some_and(|k| k.0 == *s)) =>
                {
                    let (section, name) = key.split_once('.').unwrap_or((key, ""));
                    let list = match section {
                        "routing" => &mut run.routing,
                        "telemetry" => &mut run.telemetry,
                        "limits" => &mut run.limits,
                        _ => &mut run.tenants,
                    };
                    let word = |v: &str| {
                        !v.is_empty()
                            && v.chars()
                                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
                    };
                    if !word(name) || !word(value) || list.iter().any(|(k, _)| k == name) {
                        return Err(bad(format!(
                            "{option:?}: expected {section}.KEY=VALUE, each key once, in \
                             letters, digits, _ . and -"
                        )));
                    }
                    list.push((name.to_string(), value.to_string()));
                }
                _ => {
                    return Err(bad(format!(
                        "unknown option {key:?} (known: {KNOWN_OPTIONS})"
                    )))
                }
            }
        }
        match (&mut run.pd, protocol) {
            (Some(pd), Some(p)) => pd.protocol = p,
            (None, Some(_)) => {
                return Err(format!(
                    "policy entry {label:?}: pd_protocol needs pd=cost or pd=always"
                ))
            }
            _ => {}
        }
        Ok(run)
    }

    /// `prefill_tokens_per_s` for a backend of `profile`, if the run configures one.
    pub fn rate_for(&self, profile: ProfileName) -> Option<f64> {
        let truth = Profile::get(profile).prefill_rate;
        match &self.rates {
            Rates::Omit => None,
            Rates::True => Some(truth),
            Rates::Scaled(factors) => {
                let f = factors.iter().find(|(p, _)| *p == profile).map(|&(_, f)| f);
                Some(truth * f.unwrap_or(1.0))
            }
        }
    }

    /// The run's results directory: the label with `/` as `__`, `*` as `x` and `+` as `_`,
    /// so that an entry is one directory whose name still reads like it.
    pub fn dir_name(&self) -> String {
        let mut out = String::with_capacity(self.label.len() + 4);
        for c in self.label.chars() {
            match c {
                '/' => out.push_str("__"),
                '*' => out.push('x'),
                c if c.is_ascii_alphanumeric() || "-_.=".contains(c) => out.push(c),
                _ => out.push('_'),
            }
        }
        out
    }
}

/// `true`, or `PROFILE*F+PROFILE*F` with each profile at most once and `F` finite and > 0.
fn parse_rates(value: &str) -> Result<Rates, String> {
    if value == "true" {
        return Ok(Rates::True);
    }
    per_profile(
        "rates",
        value,
        "true or PROFILE*FACTOR+PROFILE*FACTOR",
        |f| {
            f.parse()
                .ok()
                .filter(|f: &f64| f.is_finite() && *f > 0.0)
                .ok_or_else(|| format!("factor {f:?} is not a number > 0"))
        },
    )
    .map(Rates::Scaled)
}

/// `PROFILE*W+PROFILE*W` with each profile at most once and `W` a backend weight (1-1000).
fn parse_weights(value: &str) -> Result<Vec<(ProfileName, u32)>, String> {
    per_profile("weights", value, "PROFILE*WEIGHT+PROFILE*WEIGHT", |w| {
        w.parse()
            .ok()
            .filter(|w| (1..=1000).contains(w))
            .ok_or_else(|| format!("weight {w:?} is not 1 to 1000"))
    })
}

/// `option=value` as `PROFILE*X+PROFILE*X`: each profile at most once, each `X` by `parse`.
fn per_profile<T>(
    option: &str,
    value: &str,
    expected: &str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<(ProfileName, T)>, String> {
    let mut out: Vec<(ProfileName, T)> = Vec::new();
    for item in value.split('+') {
        let Some((name, x)) = item.split_once('*') else {
            return Err(format!(
                "{option}={value:?}: expected {expected}, got {item:?}"
            ));
        };
        let profile = ProfileName::parse(name).map_err(|e| format!("{option}={value:?}: {e}"))?;
        let x = parse(x).map_err(|e| format!("{option}={value:?}: {e}"))?;
        if out.iter().any(|(p, _)| *p == profile) {
            return Err(format!("{option}={value:?}: {name} listed twice"));
        }
        out.push((profile, x));
    }
    Ok(out)
}

/// kvroute's config for one run: `run`'s policy and options in front of `backends` (address
/// and profile, in fleet order), with pid file, upgrade socket and so on under `dir`.
/// One simulated server as the router is told of it.
#[derive(Debug, Clone)]
pub struct Member {
    pub addr: SocketAddr,
    pub profile: ProfileName,
    /// Pinned in kvroute's config (`backends[].models`); empty: every model.
    pub models: Vec<String>,
    /// Where its engine publishes KV events, and the tokenizer directory it counts with.
    pub kv_events: Option<KvEndpoints>,
    /// Its part in a disaggregated fleet (`compare --pd`).
    pub role: Role,
    /// Where it takes SGLang's bootstrap connections (a prefill server of that protocol).
    pub bootstrap_port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct KvEndpoints {
    pub publish: String,
    pub replay: String,
    /// Absolute: a Hugging Face tokenizer directory with a chat template.
    pub tokenizer: std::path::PathBuf,
    /// Data-parallel ranks behind the server (`sim --dp-size`), each at these ports + rank.
    pub ranks: u32,
}

pub fn kvroute_yaml(
    dir: &Path,
    listen: SocketAddr,
    admin: SocketAddr,
    run: &PolicyRun,
    backends: &[Member],
) -> String {
    let mut yaml = format!(
        "version: 1\nthreads: 2\npid_file: {d}/kvroute.pid\nupgrade_sock: {d}/kvroute.sock\n\
         grace_period_seconds: 0\ngraceful_shutdown_timeout_seconds: 1\n\
         kvroute:\n  listen: \"{listen}\"\n  admin_listen: \"{admin}\"\n  routing:\n    policy: {p}\n",
        d = dir.display(),
        p = run.policy,
    );
    if let Some(learn) = run.learn {
        let _ = writeln!(yaml, "    learn_prefill_rate: {learn}");
    }
    for (key, value) in &run.routing {
        let _ = writeln!(yaml, "    {key}: {value}");
    }
    // Replicas are told how many they are, as an operator's would be, unless the entry says.
    if run.replicas > 1 && !run.routing.iter().any(|(k, _)| k == "replicas") {
        let _ = writeln!(yaml, "    replicas: {}", run.replicas);
    }
    if let (Some(pd), None, Some(m)) = (run.pd, run.peer, backends.first()) {
        yaml.push_str(&pd::kvroute_section(pd, m.profile));
    }
    if !run.telemetry.is_empty() {
        yaml.push_str("  telemetry:\n");
        for (key, value) in &run.telemetry {
            let _ = writeln!(yaml, "    {key}: {value}");
        }
    }
    if !run.limits.is_empty() {
        yaml.push_str("  limits:\n");
        write_nested(&mut yaml, 4, &run.limits);
    }
    let mut tenants = run.tenants.clone();
    if !run.tenant_names.is_empty() && !tenants.iter().any(|(k, _)| k == "names") {
        let quoted: Vec<String> = run.tenant_names.iter().map(|n| format!("{n:?}")).collect();
        tenants.insert(0, ("names".into(), format!("[{}]", quoted.join(", "))));
    }
    if !tenants.is_empty() {
        yaml.push_str("  tenants:\n");
        write_nested(&mut yaml, 4, &tenants);
    }
    let events = backends
        .iter()
        .find_map(|m| m.kv_events.as_ref())
        .filter(|_| run.events);
    if let Some(e) = events {
        let _ = writeln!(
            yaml,
            "  kv_events:\n    tokenizer: \"{}\"\n    tokenizer_config: \"{}\"",
            e.tokenizer.join("tokenizer.json").display(),
            e.tokenizer.join("tokenizer_config.json").display()
        );
    }
    yaml.push_str("  backends:\n");
    for m in backends {
        let _ = writeln!(yaml, "    - addr: \"{}\"", m.addr);
        if let (Some(e), true) = (&m.kv_events, events.is_some()) {
            let _ = writeln!(
                yaml,
                "      kv_events:\n        endpoint: \"{}\"\n        replay_endpoint: \"{}\"",
                e.publish, e.replay
            );
            if e.ranks > 1 {
                let _ = writeln!(yaml, "        data_parallel_size: {}", e.ranks);
            }
        }
        if m.role != Role::Both {
            let _ = writeln!(yaml, "      role: {}", m.role.as_str());
        }
        if let Some(port) = m.bootstrap_port {
            let _ = writeln!(yaml, "      bootstrap_port: {port}");
        }
        // A llama.cpp engine, real or its stand-in, is scraped as one.
        if m.profile == super::llama::PROFILE {
            yaml.push_str("      engine: llamacpp\n");
        }
        if let Some(&(_, w)) = run.weights.iter().find(|(p, _)| *p == m.profile) {
            let _ = writeln!(yaml, "      weight: {w}");
        }
        if let Some(rate) = run.rate_for(m.profile) {
            let _ = writeln!(yaml, "      prefill_tokens_per_s: {rate}");
        }
        if !m.models.is_empty() {
            let quoted: Vec<String> = m.models.iter().map(|x| format!("{x:?}")).collect();
            let _ = writeln!(yaml, "      models: [{}]", quoted.join(", "));
        }
    }
    yaml
}

/// `entries` as YAML mappings at `indent`, a dotted key nested: `fair_share.prompt_weight`
/// is `prompt_weight` under `fair_share`, with the other keys under `fair_share` beside it.
fn write_nested(yaml: &mut String, indent: usize, entries: &[(String, String)]) {
    let mut heads: Vec<&str> = Vec::new();
    for (key, _) in entries {
        let head = key.split('.').next().unwrap_or(key);
        if !heads.contains(&head) {
            heads.push(head);
        }
    }
    for head in heads {
        let mut below = Vec::new();
        for (key, value) in entries {
            match key.split_once('.') {
                None if key == head => {
                    let _ = writeln!(yaml, "{:indent$}{key}: {value}", "");
                }
                Some((h, rest)) if h == head => below.push((rest.to_owned(), value.clone())),
                _ => {}
            }
        }
        if !below.is_empty() {
            let _ = writeln!(yaml, "{:indent$}{head}:", "");
            write_nested(yaml, indent + 2, &below);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_yaml::Value;

    fn backends() -> Vec<Member> {
        let m = |p: u16, profile, models: &[&str]| Member {
            addr: SocketAddr::from(([127, 0, 0, 1], p)),
            profile,
            models: models.iter().map(|s| s.to_string()).collect(),
            kv_events: None,
            role: Role::Both,
            bootstrap_port: None,
        };
        vec![
            m(9000, ProfileName::H100Llama8b, &[]),
            m(9001, ProfileName::H100Llama8b, &[]),
            m(9002, ProfileName::L40sLlama8b, &[]),
        ]
    }

    /// The generated config, parsed back: the `kvroute` section.
    fn config(entry: &str) -> Value {
        let run = PolicyRun::parse(entry).unwrap();
        let listen = SocketAddr::from(([127, 0, 0, 1], 8080));
        let admin = SocketAddr::from(([127, 0, 0, 1], 8081));
        let yaml = kvroute_yaml(Path::new("/tmp/r"), listen, admin, &run, &backends());
        let v: Value = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(v["pid_file"].as_str(), Some("/tmp/r/kvroute.pid"));
        v["kvroute"].clone()
    }

    fn rates(k: &Value) -> Vec<Option<f64>> {
        let list = k["backends"].as_sequence().unwrap();
        assert_eq!(list[2]["addr"].as_str(), Some("127.0.0.1:9002"));
        list.iter()
            .map(|b| b.get("prefill_tokens_per_s").map(|r| r.as_f64().unwrap()))
            .collect()
    }

    #[test]
    fn pinned_models_are_listed_per_backend() {
        let mut b = backends();
        b[1].models = vec!["b".into(), "b-lora-1".into()];
        let run = PolicyRun::parse("kv_aware").unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], 8080));
        let yaml = kvroute_yaml(Path::new("/tmp/r"), addr, addr, &run, &b);
        let v: Value = serde_yaml::from_str(&yaml).unwrap();
        let list = v["kvroute"]["backends"].as_sequence().unwrap();
        assert!(list[0].get("models").is_none());
        let models: Vec<&str> = list[1]["models"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap())
            .collect();
        assert_eq!(models, ["b", "b-lora-1"]);
    }

    #[test]
    fn plain_entry_is_todays_config() {
        let k = config("kv_aware");
        assert_eq!(k["listen"].as_str(), Some("127.0.0.1:8080"));
        assert_eq!(k["admin_listen"].as_str(), Some("127.0.0.1:8081"));
        assert_eq!(k["routing"]["policy"].as_str(), Some("kv_aware"));
        assert_eq!(k["routing"].as_mapping().unwrap().len(), 1);
        assert_eq!(rates(&k), [None, None, None]);
        let b = &k["backends"][0];
        assert_eq!(b.as_mapping().unwrap().len(), 1);
        let run = PolicyRun::parse("round_robin").unwrap();
        assert_eq!(
            (run.label.as_str(), run.dir_name()),
            ("round_robin", "round_robin".into())
        );
    }

    #[test]
    fn replicas_are_told_how_many_they_are_unless_the_entry_says() {
        assert!(config("kv_aware")["routing"].get("replicas").is_none());
        let k = config("kv_aware/replicas=3");
        assert_eq!(k["routing"]["replicas"].as_i64(), Some(3));
        let k = config("kv_aware/routing.replicas=1/replicas=3");
        assert_eq!(k["routing"]["replicas"].as_i64(), Some(1));
    }

    #[test]
    fn routing_options_go_under_routing() {
        let k = config("kv_aware/routing.duplicate_prefill_weight=0/learn=off");
        assert_eq!(k["routing"]["duplicate_prefill_weight"].as_i64(), Some(0));
        assert_eq!(k["routing"]["learn_prefill_rate"].as_bool(), Some(false));
        assert!(k.get("telemetry").is_none());
        let k = config("kv_aware/telemetry.interval_ms=250/routing.load_factor=1.5");
        assert_eq!(k["telemetry"]["interval_ms"].as_i64(), Some(250));
        assert_eq!(k["routing"]["load_factor"].as_f64(), Some(1.5));
        assert!(k["routing"].get("interval_ms").is_none());
        for bad in [
            "kv_aware/routing.=1",
            "kv_aware/routing.a=",
            "kv_aware/routing.a=1/routing.a=2",
            "kv_aware/routing.a=x: y",
            "kv_aware/telemetry.a=1/telemetry.a=2",
            "kv_aware/telemetry.=1",
        ] {
            assert!(PolicyRun::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn limits_and_tenants_options_nest_and_the_workloads_tenants_are_named() {
        let entry = "kv_aware/limits.backend_max_inflight=4/tenants.fair_share.prompt_weight=0\
                     /limits.queue_timeout_ms=120000/tenants.fair_share.completion_weight=0";
        let k = config(entry);
        assert_eq!(k["limits"]["backend_max_inflight"].as_i64(), Some(4));
        assert_eq!(k["limits"]["queue_timeout_ms"].as_i64(), Some(120_000));
        let fair = &k["tenants"]["fair_share"];
        assert_eq!(
            (
                fair["prompt_weight"].as_i64(),
                fair["completion_weight"].as_i64()
            ),
            (Some(0), Some(0))
        );
        assert!(k["tenants"].get("names").is_none());
        let mut run = PolicyRun::parse(entry).unwrap();
        run.tenant_names = vec!["flood".into(), "steady-0".into()];
        let addr = SocketAddr::from(([127, 0, 0, 1], 8080));
        let yaml = kvroute_yaml(Path::new("/tmp/r"), addr, addr, &run, &backends());
        let v: Value = serde_yaml::from_str(&yaml).unwrap();
        let names: Vec<&str> = v["kvroute"]["tenants"]["names"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect();
        assert_eq!(names, ["flood", "steady-0"]);
        assert_eq!(
            v["kvroute"]["tenants"]["fair_share"]["prompt_weight"].as_i64(),
            Some(0)
        );
        assert!(PolicyRun::parse("kv_aware/limits.a=1/limits.a=2").is_err());
        assert!(PolicyRun::parse("kv_aware/quotas.a=1").is_err());
    }

    #[test]
    fn weights_apply_to_the_listed_profiles_only() {
        let k = config("kv_aware/weights=h100-llama8b*3");
        let list = k["backends"].as_sequence().unwrap();
        let w: Vec<Option<u64>> = list.iter().map(|b| b["weight"].as_u64()).collect();
        assert_eq!(w, [Some(3), Some(3), None]);
        for bad in [
            "kv_aware/weights=h100-llama8b*0",
            "kv_aware/weights=h100-llama8b*1001",
            "kv_aware/weights=h100-llama8b*1.5",
            "kv_aware/weights=h100-llama8b",
            "kv_aware/weights=h100-llama8b*2+h100-llama8b*3",
            "kv_aware/weights=x100*2",
            "kv_aware/weights=h100-llama8b*2/weights=l40s-llama8b*1",
        ] {
            assert!(PolicyRun::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rates_true_writes_each_backends_true_rate() {
        let k = config("kv_aware/rates=true");
        assert_eq!(rates(&k), [Some(25_000.0), Some(25_000.0), Some(9_000.0)]);
        assert!(k["routing"].get("learn_prefill_rate").is_none());
    }

    #[test]
    fn scaled_rates_apply_to_the_listed_profiles_only() {
        let k = config("kv_aware/rates=l40s-llama8b*100");
        assert_eq!(rates(&k), [Some(25_000.0), Some(25_000.0), Some(900_000.0)]);
        let k = config("kv_aware/rates=h100-llama8b*0.01+l40s-llama8b*100");
        let r = rates(&k);
        assert!((r[0].unwrap() - 250.0).abs() < 1e-9, "{r:?}");
        assert_eq!(r[2], Some(900_000.0));
        // A listed profile the fleet does not have changes nothing.
        let k = config("kv_aware/rates=a100-llama8b*2");
        assert_eq!(rates(&k), [Some(25_000.0), Some(25_000.0), Some(9_000.0)]);
    }

    #[test]
    fn learn_switch_goes_under_routing() {
        let k = config("kv_aware/learn=off");
        assert_eq!(k["routing"]["learn_prefill_rate"].as_bool(), Some(false));
        assert_eq!(rates(&k), [None, None, None]);
        let k = config("kv_aware/learn=on/rates=true");
        assert_eq!(k["routing"]["learn_prefill_rate"].as_bool(), Some(true));
        assert_eq!(k["routing"]["policy"].as_str(), Some("kv_aware"));
        assert_eq!(rates(&k)[0], Some(25_000.0));
    }

    #[test]
    fn label_is_the_whole_entry_and_dir_one_component() {
        let entry = "kv_aware/rates=h100-llama8b*0.01+l40s-llama8b*100";
        let run = PolicyRun::parse(entry).unwrap();
        assert_eq!(run.label, entry);
        assert_eq!(run.policy, "kv_aware");
        let dir = run.dir_name();
        assert_eq!(dir, "kv_aware__rates=h100-llama8bx0.01_l40s-llama8bx100");
        assert!(!dir.contains('/'));
    }

    #[test]
    fn peer_entries_name_the_peer_and_its_policy() {
        for peer in PeerRouter::ALL {
            for policy in PeerRouter::POLICIES {
                let entry = format!("{}/{policy}", peer.name());
                let run = PolicyRun::parse(&entry).unwrap();
                assert_eq!(
                    (run.peer, run.policy.as_str(), run.label.as_str()),
                    (Some(peer), policy, entry.as_str())
                );
                assert_eq!(run.rates, Rates::Omit);
                assert_eq!(run.dir_name(), entry.replace('/', "__"));
            }
        }
        assert_eq!(PolicyRun::parse("cache_aware").unwrap().peer, None);
        assert_eq!(PolicyRun::parse("kv_aware/learn=off").unwrap().peer, None);
        for (entry, says) in [
            ("sglang-router", "exactly one policy"),
            ("vllm-router/", "not a vllm-router policy"),
            ("sglang-router/kv_aware", "not a sglang-router policy"),
            ("vllm-router/cache_aware/rates=true", "exactly one policy"),
            (
                "sglang-router/cache_aware/round_robin",
                "exactly one policy",
            ),
        ] {
            let err = PolicyRun::parse(entry).unwrap_err();
            assert!(err.contains(says), "{entry:?}: {err}");
        }
    }

    #[test]
    fn pd_entries_configure_disaggregation_roles_and_bootstrap_ports() {
        let run = PolicyRun::parse("kv_aware/pd=always/pd_protocol=sglang_bootstrap").unwrap();
        let pd = run.pd.unwrap();
        assert_eq!(
            (pd.protocol, pd.decision),
            (Protocol::SglangBootstrap, Some(pd::Decision::Always))
        );
        let mut b = backends();
        b[0].role = Role::Prefill;
        b[0].bootstrap_port = Some(9000);
        b[1].role = Role::Decode;
        b[2].role = Role::Decode;
        let addr = SocketAddr::from(([127, 0, 0, 1], 8080));
        let yaml = kvroute_yaml(Path::new("/tmp/r"), addr, addr, &run, &b);
        let v: Value = serde_yaml::from_str(&yaml).unwrap();
        let k = &v["kvroute"];
        let d = &k["disaggregation"];
        assert_eq!(d["protocol"].as_str(), Some("sglang_bootstrap"));
        assert_eq!(d["decision"].as_str(), Some("always"));
        assert_eq!(d["kv_bytes_per_token"].as_u64(), Some(131_072));
        let list = k["backends"].as_sequence().unwrap();
        assert_eq!(list[0]["role"].as_str(), Some("prefill"));
        assert_eq!(list[0]["bootstrap_port"].as_u64(), Some(9000));
        assert_eq!(list[1]["role"].as_str(), Some("decode"));
        assert!(list[1].get("bootstrap_port").is_none());
        let cost = PolicyRun::parse("kv_aware/pd=cost").unwrap().pd.unwrap();
        assert_eq!(
            (cost.protocol, cost.decision),
            (Protocol::VllmNixl, Some(pd::Decision::Cost))
        );
        assert_eq!(
            config("kv_aware/pd=cost")["disaggregation"]["decision"].as_str(),
            Some("cost")
        );
        // A unified entry's config is today's.
        assert!(config("kv_aware").get("disaggregation").is_none());
        for peer in PeerRouter::ALL {
            let run = PolicyRun::parse(&format!("{}/pd", peer.name())).unwrap();
            let pd = run.pd.unwrap();
            assert_eq!((pd.protocol, pd.decision), (peer.pd_protocol(), None));
        }
        for (entry, says) in [
            ("kv_aware/pd=sometimes", "expected cost or always"),
            ("kv_aware/pd=cost/pd=always", "given twice"),
            (
                "kv_aware/pd_protocol=sglang_bootstrap",
                "needs pd=cost or pd=always",
            ),
            (
                "kv_aware/pd=cost/pd_protocol=mooncake",
                "expected vllm_nixl or sglang_bootstrap",
            ),
            ("vllm-router/pd/pd=cost", "exactly one policy"),
        ] {
            let err = PolicyRun::parse(entry).unwrap_err();
            assert!(err.contains(says), "{entry:?}: {err}");
        }
    }

    #[test]
    fn rejects_unknown_options_and_malformed_values() {
        for (entry, says) in [
            ("", "not a policy name"),
            ("/rates=true", "not a policy name"),
            ("kv aware", "not a policy name"),
            ("kv_aware/", "not KEY=VALUE"),
            ("kv_aware/rates", "not KEY=VALUE"),
            ("kv_aware/speed=3", "unknown option \"speed\""),
            ("kv_aware/replicas=0", "expected 1 to 4"),
            ("kv_aware/replicas=9", "expected 1 to 4"),
            ("kv_aware/replicas=2/replicas=3", "given twice"),
            ("kv_aware/rates=yes", "expected true or PROFILE*FACTOR"),
            ("kv_aware/rates=", "expected true or PROFILE*FACTOR"),
            ("kv_aware/rates=b200*2", "unknown profile"),
            ("kv_aware/rates=h100-llama8b*0", "not a number > 0"),
            ("kv_aware/rates=h100-llama8b*-1", "not a number > 0"),
            ("kv_aware/rates=h100-llama8b*inf", "not a number > 0"),
            ("kv_aware/rates=h100-llama8b*x", "not a number > 0"),
            (
                "kv_aware/rates=h100-llama8b*2+",
                "expected true or PROFILE*FACTOR",
            ),
            (
                "kv_aware/rates=h100-llama8b*2+h100-llama8b*3",
                "listed twice",
            ),
            ("kv_aware/learn=maybe", "expected on or off"),
            ("kv_aware/learn=on/learn=off", "given twice"),
            ("kv_aware/rates=true/rates=true", "given twice"),
        ] {
            let err = PolicyRun::parse(entry).unwrap_err();
            assert!(err.contains(says), "{entry:?}: {err}");
        }
    }
}
