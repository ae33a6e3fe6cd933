//! Fault knobs: set from the CLI at start and changed at run time through `POST /debug/faults`.
//! Per-request decisions are pseudo-random but deterministic in the request's sequence number,
//! so a failing test run can be replayed exactly.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::error::ApiError;

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Faults {
    /// Fraction of POST requests answered 500.
    pub fail_rate: f64,
    /// Fraction of POST requests that are accepted and never answered.
    pub hang_rate: f64,
    /// While set, every POST request is held unanswered until it is cleared.
    pub hang: bool,
    /// While set, `/health` answers 503.
    pub unhealthy: bool,
    /// While non-zero, every stream that reaches this many tokens is cut there: the
    /// connection is dropped mid-response, as when an engine is killed.
    pub cut_after_tokens: u64,
    /// While non-zero, every stream that reaches this many tokens ends there with an error
    /// event (vLLM's shape) and `[DONE]`, as an engine reports a failure mid-stream.
    pub error_after_tokens: u64,
    /// While set, a chat request with `continue_final_message` is refused with 400, as by an
    /// engine that does not know the option.
    pub refuse_continuation: bool,
    /// Fraction of streams whose connection is dropped once, after a pseudo-random number of
    /// their tokens (at least one), as a connection lost mid-response.
    pub cut_rate: f64,
}

/// What a stream does at one of its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamFault {
    Cut,
    Error,
}

impl Faults {
    /// Where `cut_rate` drops stream `seq` of `server`, a stream of `n` tokens: after token
    /// 1 to n-1, or not at all.
    pub fn cut_point(&self, seq: u64, server: usize, n: u64) -> Option<u64> {
        if n < 2 || !hits(self.cut_rate, seq, server, CUT_SALT) {
            return None;
        }
        let seed = CUT_SALT.rotate_left(7) ^ server as u64;
        Some(1 + xxh3_64_with_seed(&seq.to_le_bytes(), seed) % (n - 1))
    }

    /// The fault, if any, for a stream about to send its token `i` (counted from its start).
    pub fn at_token(&self, i: u64) -> Option<StreamFault> {
        if self.cut_after_tokens > 0 && i >= self.cut_after_tokens {
            Some(StreamFault::Cut)
        } else if self.error_after_tokens > 0 && i >= self.error_after_tokens {
            Some(StreamFault::Error)
        } else {
            None
        }
    }
}

/// The error event an engine ends a failed stream with (vLLM's `ErrorResponse`), then
/// `[DONE]`.
pub fn error_events() -> axum::body::Bytes {
    axum::body::Bytes::from_static(
        b"data: {\"error\":{\"object\":\"error\",\"message\":\"kvbench-sim: the engine failed mid-stream\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\ndata: [DONE]\n\n",
    )
}

/// A partial change; absent fields keep their value. Unknown fields are rejected so that a typo
/// in a test does not silently leave a fault off.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultUpdate {
    pub fail_rate: Option<f64>,
    pub hang_rate: Option<f64>,
    pub hang: Option<bool>,
    pub unhealthy: Option<bool>,
    pub cut_after_tokens: Option<u64>,
    pub error_after_tokens: Option<u64>,
    pub refuse_continuation: Option<bool>,
    pub cut_rate: Option<f64>,
}

impl FaultUpdate {
    pub fn validate(&self) -> Result<(), ApiError> {
        for (name, rate) in [
            ("fail_rate", self.fail_rate),
            ("hang_rate", self.hang_rate),
            ("cut_rate", self.cut_rate),
        ] {
            if let Some(rate) = rate {
                check_rate(name, rate).map_err(ApiError::bad_request)?;
            }
        }
        Ok(())
    }
}

impl Faults {
    /// Applies an update that `FaultUpdate::validate` accepted.
    pub fn apply(&mut self, update: &FaultUpdate) {
        if let Some(v) = update.fail_rate {
            self.fail_rate = v;
        }
        if let Some(v) = update.hang_rate {
            self.hang_rate = v;
        }
        if let Some(v) = update.hang {
            self.hang = v;
        }
        if let Some(v) = update.unhealthy {
            self.unhealthy = v;
        }
        if let Some(v) = update.cut_rate {
            self.cut_rate = v;
        }
        if let Some(v) = update.cut_after_tokens {
            self.cut_after_tokens = v;
        }
        if let Some(v) = update.error_after_tokens {
            self.error_after_tokens = v;
        }
        if let Some(v) = update.refuse_continuation {
            self.refuse_continuation = v;
        }
    }
}

pub fn check_rate(name: &str, rate: f64) -> Result<(), String> {
    if (0.0..=1.0).contains(&rate) {
        Ok(())
    } else {
        Err(format!("{name} must be between 0 and 1, got {rate}"))
    }
}

/// Salts keep the fail and hang draws of one request independent.
pub const FAIL_SALT: u64 = 0x6661_696c;
pub const HANG_SALT: u64 = 0x6861_6e67;
pub const CUT_SALT: u64 = 0x6375_7421;

/// True for about `rate` of all sequence numbers.
pub fn hits(rate: f64, seq: u64, server: usize, salt: u64) -> bool {
    if rate <= 0.0 {
        return false;
    }
    let seed = salt ^ (server as u64).rotate_left(32);
    let draw = xxh3_64_with_seed(&seq.to_le_bytes(), seed) >> 11;
    (draw as f64 / (1u64 << 53) as f64) < rate
}

/// A stream's fault: the connection dropped (an error from the body stream makes the server
/// abort it), or the engine's error event.
/// The events before a cut are let out first (the server flushes while the stream waits), so
/// the client has exactly the tokens before it.
pub async fn stream_fault(fault: StreamFault) -> Result<axum::body::Bytes, std::io::Error> {
    match fault {
        StreamFault::Cut => {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            Err(std::io::Error::other("kvbench-sim: stream cut (fault)"))
        }
        StreamFault::Error => Ok(error_events()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_fraction_tracks_rate() {
        let cuts = Faults {
            cut_rate: 0.2,
            ..Faults::default()
        };
        let points: Vec<u64> = (0..10_000)
            .filter_map(|s| cuts.cut_point(s, 2, 40))
            .collect();
        assert!((1_800..2_200).contains(&points.len()), "{}", points.len());
        assert!(points.iter().all(|p| (1..40).contains(p)));
        assert_eq!(
            cuts.cut_point(7, 2, 1),
            None,
            "a one-token stream has no middle"
        );
        let n = (0..10_000).filter(|&s| hits(0.3, s, 1, FAIL_SALT)).count();
        assert!((2_700..3_300).contains(&n), "{n}");
        assert!((0..1000).all(|s| !hits(0.0, s, 0, FAIL_SALT)));
        assert!((0..1000).all(|s| hits(1.0, s, 0, FAIL_SALT)));
    }

    #[test]
    fn update_applies_only_present_fields() {
        let mut f = Faults {
            fail_rate: 0.5,
            ..Faults::default()
        };
        let u: FaultUpdate = serde_json::from_str(r#"{"hang":true}"#).unwrap();
        u.validate().unwrap();
        f.apply(&u);
        assert!(f.hang);
        assert_eq!(f.fail_rate, 0.5);
    }

    #[test]
    fn update_rejects_bad_rate_and_unknown_field() {
        let u: FaultUpdate = serde_json::from_str(r#"{"fail_rate":1.5}"#).unwrap();
        assert!(u.validate().is_err());
        assert!(serde_json::from_str::<FaultUpdate>(r#"{"fail":1}"#).is_err());
    }
}
