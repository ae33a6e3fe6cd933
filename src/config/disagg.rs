//! `kvroute.disaggregation` and `backends[].role`: prefill/decode disaggregation. A request is
//! decoded on a `decode` (or `both`) backend and, when the cost model says so, prefilled first
//! on a `prefill` (or `both`) one, whose KV cache the decode server then reads over the
//! engines' own transfer (NIXL for vLLM).

use serde::Deserialize;

use super::error::{err, ConfigError};

/// What a backend does in a disaggregated fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Serves requests whole, and can prefill for another or decode after another's prefill:
    /// a fleet of only `both` is today's unified fleet.
    #[default]
    Both,
    /// Only prefills, for a decode server to read.
    Prefill,
    /// Serves requests whole, or decodes after a prefill server's prefill; never prefills
    /// for another.
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

    /// May decode (and serve a request whole).
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }

    /// May prefill a request for another backend to decode.
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }
}

/// The wire protocol the engines hand a prefill over by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PdProtocol {
    /// vLLM's NixlConnector: the prefill leg first (`max_tokens: 1`, `kv_transfer_params`
    /// asking for a remote decode), then the decode leg with the parameters it returned.
    VllmNixl,
    /// SGLang's bootstrap protocol: both legs at once, the same body naming the prefill
    /// server's bootstrap server and a random room the decode server fetches the KV from.
    SglangBootstrap,
}

impl PdProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            PdProtocol::VllmNixl => "vllm_nixl",
            PdProtocol::SglangBootstrap => "sglang_bootstrap",
        }
    }

    /// A server of `role` can be sent a request whole. vLLM's `kv_both` servers serve any
    /// request; SGLang's prefill- and decode-mode servers refuse one without a bootstrap room
    /// ("Do not send requests directly to prefill or decode instances; send to the router
    /// instead": the data-parallel controller's `follow_bootstrap_room_scheduler`), so only a
    /// plain (`both`) SGLang server does.
    pub fn serves_whole(self, role: Role) -> bool {
        match self {
            PdProtocol::VllmNixl => role.decodes(),
            PdProtocol::SglangBootstrap => role == Role::Both,
        }
    }
}

/// How the split is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PdDecision {
    /// Per request, from the cost model: whole unless a prefill server finishes it sooner.
    #[default]
    Cost,
    /// Every request that can be split is (the fixed-policy baseline, and what an operator
    /// who wants no prefill on a decode server asks for).
    Always,
}

impl PdDecision {
    pub fn as_str(self) -> &'static str {
        match self {
            PdDecision::Cost => "cost",
            PdDecision::Always => "always",
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DisaggregationConfig {
    pub protocol: PdProtocol,
    #[serde(default)]
    pub decision: PdDecision,
    /// KV cache bytes one token takes: 2 (K and V) x layers x KV heads x head size x bytes per
    /// value; 131,072 for Llama 3 8B in bf16 (32 x 8 x 128).
    #[serde(default = "default_kv_bytes_per_token")]
    pub kv_bytes_per_token: u64,
    /// Bandwidth of a KV transfer between a prefill and a decode server, GB/s.
    #[serde(default = "default_transfer_gbytes_per_s")]
    pub transfer_gbytes_per_s: f64,
    /// What a transfer costs whatever its size (the decode server's request for the blocks,
    /// the notification back), ms.
    #[serde(default = "default_transfer_base_ms")]
    pub transfer_base_ms: f64,
    /// What one second of a decoding stream's stall costs against one second of the placed
    /// request's TTFT, when its prefill is weighed on a decode server against a split. 1: the
    /// delays count alike. Not `routing.decode_stall_weight` (0.1), which is tuned for
    /// unified fleets, where every choice stalls some stream; here a split stalls none.
    #[serde(default = "default_decode_stall_weight")]
    pub decode_stall_weight: f64,
}

fn default_decode_stall_weight() -> f64 {
    1.0
}

fn default_kv_bytes_per_token() -> u64 {
    131_072
}

/// One 200 Gb/s RDMA link, as NIXL over UCX moves it.
fn default_transfer_gbytes_per_s() -> f64 {
    25.0
}

fn default_transfer_base_ms() -> f64 {
    2.0
}

impl DisaggregationConfig {
    pub(super) fn validate(&self, roles: &[Role]) -> Result<(), ConfigError> {
        if self.kv_bytes_per_token == 0 {
            return Err(err(
                "kvroute.disaggregation.kv_bytes_per_token",
                "must be positive",
            ));
        }
        if !(self.transfer_gbytes_per_s.is_finite() && self.transfer_gbytes_per_s > 0.0) {
            return Err(err(
                "kvroute.disaggregation.transfer_gbytes_per_s",
                "must be positive",
            ));
        }
        if !(self.transfer_base_ms.is_finite() && self.transfer_base_ms >= 0.0) {
            return Err(err(
                "kvroute.disaggregation.transfer_base_ms",
                "must not be negative",
            ));
        }
        if !(self.decode_stall_weight.is_finite() && self.decode_stall_weight >= 0.0) {
            return Err(err(
                "kvroute.disaggregation.decode_stall_weight",
                "must be >= 0",
            ));
        }
        if !roles.iter().any(|r| r.decodes()) {
            return Err(err(
                "kvroute.backends",
                "disaggregation needs a backend that decodes (role decode or both)",
            ));
        }
        Ok(())
    }
}

/// Roles (the backends', in order) other than `both` need the protocol their engines hand a
/// prefill over by.
pub(super) fn validate_roles(
    roles: &[Role],
    disaggregation: Option<&DisaggregationConfig>,
) -> Result<(), ConfigError> {
    match disaggregation {
        Some(d) => d.validate(roles),
        None => match roles.iter().position(|&r| r != Role::Both) {
            Some(i) => Err(err(
                format!("kvroute.backends[{i}].role"),
                "a prefill or decode role needs kvroute.disaggregation (its protocol)",
            )),
            None => Ok(()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_need_the_protocol_and_a_backend_that_decodes() {
        let d: DisaggregationConfig = serde_yaml::from_str("protocol: vllm_nixl\n").unwrap();
        assert_eq!(d.kv_bytes_per_token, 131_072);
        let split = [Role::Prefill, Role::Decode];
        assert!(validate_roles(&split, Some(&d)).is_ok());
        let e = validate_roles(&split, None).unwrap_err().to_string();
        assert!(e.contains("backends[0].role"), "{e}");
        assert!(validate_roles(&[Role::Both], None).is_ok());
        let e = validate_roles(&[Role::Prefill], Some(&d))
            .unwrap_err()
            .to_string();
        assert!(e.contains("decodes"), "{e}");
        let bad = DisaggregationConfig {
            transfer_gbytes_per_s: 0.0,
            ..d.clone()
        };
        assert!(validate_roles(&split, Some(&bad)).is_err());
        assert_eq!(d.decode_stall_weight, 1.0);
        let bad = DisaggregationConfig {
            decode_stall_weight: -0.5,
            ..d.clone()
        };
        let e = validate_roles(&split, Some(&bad)).unwrap_err().to_string();
        assert!(e.contains("disaggregation.decode_stall_weight"), "{e}");
        let s: DisaggregationConfig =
            serde_yaml::from_str("protocol: sglang_bootstrap\ndecision: always\n").unwrap();
        assert_eq!(
            (s.protocol, s.decision),
            (PdProtocol::SglangBootstrap, PdDecision::Always)
        );
        assert_eq!(d.decision, PdDecision::Cost);
        assert!(serde_yaml::from_str::<DisaggregationConfig>("protocol: mooncake\n").is_err());
        assert!(serde_yaml::from_str::<DisaggregationConfig>(
            "protocol: vllm_nixl\ndecision: never\n"
        )
        .is_err());
        // SGLang's prefill and decode servers take nothing whole.
        assert!(PdProtocol::VllmNixl.serves_whole(Role::Decode));
        assert!(!PdProtocol::SglangBootstrap.serves_whole(Role::Decode));
        assert!(PdProtocol::SglangBootstrap.serves_whole(Role::Both));
    }
}
