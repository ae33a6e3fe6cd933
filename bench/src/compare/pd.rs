//! `compare --pd P:D`: prefill/decode disaggregation on the same P + D simulated GPUs.
//!
//! An entry that disaggregates gets them as P `--role prefill` and D `--role decode` servers
//! speaking one P/D protocol: `kv_aware/pd=cost` (kvroute decides per request whether to
//! split), `kv_aware/pd=always` (kvroute splits every request it can: the always-disaggregate
//! baseline), `vllm-router/pd` and `sglang-router/pd` (the peers' own P/D modes, which split
//! every request). Any other entry (`kv_aware`, `sglang-router/cache_aware`, ...) gets the
//! same P + D servers as one unified fleet of `both` servers: the baseline without
//! disaggregation, on the same GPUs.

use std::fmt::Write as _;

use crate::sim::{Profile, ProfileName};

/// `--pd P:D`: prefill servers and decode servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdSplit {
    pub prefill: u32,
    pub decode: u32,
}

impl PdSplit {
    pub fn parse(spec: &str) -> Result<Self, String> {
        let bad = || format!("--pd {spec:?}: expected P:D, e.g. 2:6 (at least one of each)");
        let (p, d) = spec.split_once(':').ok_or_else(bad)?;
        let (prefill, decode) = (
            p.trim().parse().map_err(|_| bad())?,
            d.trim().parse().map_err(|_| bad())?,
        );
        if prefill == 0 || decode == 0 {
            return Err(bad());
        }
        Ok(PdSplit { prefill, decode })
    }

    pub fn servers(self) -> u32 {
        self.prefill + self.decode
    }
}

/// `kvroute.disaggregation.decision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// kvroute's cost model decides per request.
    Cost,
    /// Every request that can be split is split.
    Always,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Cost => "cost",
            Decision::Always => "always",
        }
    }
}

/// How P and D hand a request over (the simulator's `--pd-protocol`, kvroute's
/// `disaggregation.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// vLLM's NixlConnector: the prefill leg, then the decode leg with its parameters.
    VllmNixl,
    /// SGLang's: one body to P and D at once, with P's bootstrap address and a room.
    SglangBootstrap,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::VllmNixl => "vllm_nixl",
            Protocol::SglangBootstrap => "sglang_bootstrap",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "vllm_nixl" => Ok(Protocol::VllmNixl),
            "sglang_bootstrap" => Ok(Protocol::SglangBootstrap),
            _ => Err(format!(
                "pd_protocol={s:?}: expected vllm_nixl or sglang_bootstrap"
            )),
        }
    }
}

/// How one entry disaggregates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdRun {
    pub protocol: Protocol,
    /// kvroute's decision; None for a peer, which splits every request.
    pub decision: Option<Decision>,
    /// The KV link between the servers (`compare --kv-transfer-*`).
    pub link: Link,
}

/// The KV transfer between a prefill and a decode server, as the simulators model it and
/// kvroute is told of it: one value for both, so kvroute prices the link the fleet has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    pub gbps: f64,
    pub base_ms: f64,
    /// The simulators' `--pd-abort-timeout-s` (their default otherwise).
    pub abort_timeout_s: Option<f64>,
}

impl Default for Link {
    /// Both sides' defaults: one 200 Gb/s RDMA link, 2 ms a transfer.
    fn default() -> Self {
        Link {
            gbps: 25.0,
            base_ms: 2.0,
            abort_timeout_s: None,
        }
    }
}

/// A server's part, as kvroute's `backends[].role` and the simulator's `--role` name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// `pd=cost|always` of a kvroute entry.
pub fn parse_decision(value: &str) -> Result<Decision, String> {
    match value {
        "cost" => Ok(Decision::Cost),
        "always" => Ok(Decision::Always),
        _ => Err(format!("pd={value:?}: expected cost or always")),
    }
}

/// One simulator process of a run: how many servers, in what role, with what arguments
/// besides the run's common ones.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetPart {
    pub servers: u32,
    pub role: Role,
    pub args: Vec<String>,
    /// The models its servers are pinned to in kvroute's config (empty: every model).
    pub models: Vec<String>,
    /// Its servers take SGLang's bootstrap connections on their own HTTP port, which the
    /// router must be told.
    pub bootstrap: bool,
    /// Its log's file name in the run's directory.
    pub log: String,
}

impl FleetPart {
    /// `servers` plain servers: today's fleet.
    pub fn plain(servers: u32) -> Self {
        FleetPart {
            servers,
            role: Role::Both,
            args: Vec::new(),
            models: Vec::new(),
            bootstrap: false,
            log: "sim.log".into(),
        }
    }
}

/// The simulators of a `--pd` run: split for an entry that disaggregates, else unified.
pub fn parts(split: PdSplit, run: Option<PdRun>) -> Vec<FleetPart> {
    let Some(run) = run else {
        return vec![FleetPart::plain(split.servers())];
    };
    [(Role::Prefill, split.prefill), (Role::Decode, split.decode)]
        .into_iter()
        .map(|(role, servers)| FleetPart {
            servers,
            role,
            args: sim_args(role, run),
            models: Vec::new(),
            bootstrap: role == Role::Prefill && run.protocol == Protocol::SglangBootstrap,
            log: format!("sim-{}.log", role.as_str()),
        })
        .collect()
}

/// A simulator's P/D arguments for servers of `role` in `run`.
fn sim_args(role: Role, run: PdRun) -> Vec<String> {
    let mut args = vec![
        "--role".to_string(),
        role.as_str().into(),
        "--pd-protocol".into(),
        run.protocol.as_str().into(),
        "--kv-transfer-gbps".into(),
        run.link.gbps.to_string(),
        "--kv-transfer-base-ms".into(),
        run.link.base_ms.to_string(),
    ];
    if let Some(s) = run.link.abort_timeout_s {
        args.extend(["--pd-abort-timeout-s".to_string(), s.to_string()]);
    }
    args
}

/// kvroute's `disaggregation` section for a kvroute entry that disaggregates: the link the
/// simulators have, and the KV size per token of the fleet's model, as they read it.
pub fn kvroute_section(run: PdRun, profile: ProfileName) -> String {
    let mut yaml = String::from("  disaggregation:\n");
    let _ = writeln!(yaml, "    protocol: {}", run.protocol.as_str());
    if let Some(d) = run.decision {
        let _ = writeln!(yaml, "    decision: {}", d.as_str());
    }
    let _ = writeln!(
        yaml,
        "    kv_bytes_per_token: {}\n    transfer_gbytes_per_s: {}\n    transfer_base_ms: {}",
        Profile::get(profile).kv_bytes_per_token,
        run.link.gbps,
        run.link.base_ms
    );
    yaml
}

/// The peers' P/D policies: the cache-aware tree for prefills (where the prompt's KV is), the
/// lighter of two random decode servers (where the streams are), as both peers' docs pair them.
pub const PEER_PREFILL_POLICY: &str = "cache_aware";
pub const PEER_DECODE_POLICY: &str = "power_of_two";

/// A peer's P/D arguments in place of `--policy` and `--worker-urls`: its P/D switch, every
/// prefill server (with its bootstrap port for SGLang's protocol) and decode server.
/// `members`: (URL, role, bootstrap port).
pub fn peer_args(switch: &str, members: &[(String, Role, Option<u16>)]) -> Vec<String> {
    let mut args = vec![switch.to_string()];
    for (url, role, port) in members {
        match role {
            Role::Decode => args.extend(["--decode".to_string(), url.clone()]),
            _ => {
                args.extend(["--prefill".to_string(), url.clone()]);
                args.extend(port.map(|p| p.to_string()));
            }
        }
    }
    args.extend([
        "--prefill-policy".to_string(),
        PEER_PREFILL_POLICY.to_string(),
        "--decode-policy".to_string(),
        PEER_DECODE_POLICY.to_string(),
    ]);
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_prefill_colon_decode_with_one_of_each() {
        let s = PdSplit::parse("2:6").unwrap();
        assert_eq!((s.prefill, s.decode, s.servers()), (2, 6, 8));
        for bad in ["2", "0:3", "3:0", "a:2", "2:6:1", ""] {
            assert!(PdSplit::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_splitting_entry_gets_prefill_and_decode_simulators_others_one_fleet() {
        let split = PdSplit::parse("1:2").unwrap();
        assert_eq!(parts(split, None), [FleetPart::plain(3)]);
        let run = PdRun {
            protocol: Protocol::SglangBootstrap,
            decision: Some(Decision::Always),
            link: Link {
                gbps: 50.0,
                base_ms: 1.5,
                abort_timeout_s: Some(30.0),
            },
        };
        let p = parts(split, Some(run));
        assert_eq!(
            (p[0].servers, p[0].role, p[0].bootstrap),
            (1, Role::Prefill, true)
        );
        assert_eq!(
            (p[1].servers, p[1].role, p[1].bootstrap),
            (2, Role::Decode, false)
        );
        assert_eq!(
            p[1].args.join(" "),
            "--role decode --pd-protocol sglang_bootstrap --kv-transfer-gbps 50 \
             --kv-transfer-base-ms 1.5 --pd-abort-timeout-s 30"
        );
        let yaml = kvroute_section(run, ProfileName::L40sLlama8b);
        assert!(yaml.contains("decision: always\n"), "{yaml}");
        assert!(
            yaml.contains("transfer_gbytes_per_s: 50\n    transfer_base_ms: 1.5\n"),
            "{yaml}"
        );
        assert_eq!(p[0].log, "sim-prefill.log");
    }

    #[test]
    fn peer_args_list_prefills_with_their_bootstrap_ports_and_decodes() {
        let m = [
            (
                "http://127.0.0.1:9000".to_string(),
                Role::Prefill,
                Some(9000),
            ),
            ("http://127.0.0.1:9001".to_string(), Role::Decode, None),
            ("http://127.0.0.1:9002".to_string(), Role::Decode, None),
        ];
        let line = peer_args("--pd-disaggregation", &m).join(" ");
        assert_eq!(
            line,
            "--pd-disaggregation --prefill http://127.0.0.1:9000 9000 \
             --decode http://127.0.0.1:9001 --decode http://127.0.0.1:9002 \
             --prefill-policy cache_aware --decode-policy power_of_two"
        );
    }
}
