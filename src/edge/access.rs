//! Access control (off unless `kvroute.access` is configured): API keys, stored only as SHA-256
//! digests and compared in constant time, mapped to tenants; which models a key may use; and per
//! key request and token rate limits (token buckets refilled per minute) and requests in flight.
//! Tokens are charged up
//! front from the request's estimate (prompt + `max_tokens`) and settled from the engine's
//! `usage` once the response is done.

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use subtle::ConstantTimeEq;

use crate::config::{parse_digest, AccessConfig, ApiKeyConfig, KeyDigest};
use crate::error::ApiError;

/// The key a request presented, once recognised.
#[derive(Debug, Clone)]
pub struct Caller {
    pub digest: KeyDigest,
    pub tenant: String,
    /// Index into `access.keys` of the config the request started with.
    pub index: usize,
}

pub fn digest(key: &[u8]) -> KeyDigest {
    Sha256::digest(key).into()
}

/// Who is calling, from the `Authorization: Bearer` header or, as Anthropic's clients send
/// it, `x-api-key`. Every configured key is compared, in constant time, so neither a key's
/// bytes nor its position in the list leak through timing.
pub fn authenticate(
    cfg: &AccessConfig,
    authorization: Option<&[u8]>,
    x_api_key: Option<&[u8]>,
) -> Result<Caller, ApiError> {
    let bearer = authorization
        .and_then(|h| std::str::from_utf8(h).ok())
        .and_then(|h| {
            let (scheme, key) = h.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
        });
    let presented = match (authorization, bearer) {
        // An `Authorization` header that is not a bearer key is refused, not skipped.
        (Some(_), b) => b,
        (None, _) => x_api_key
            .and_then(|h| std::str::from_utf8(h).ok())
            .map(str::trim),
    }
    .filter(|k| !k.is_empty())
    .ok_or_else(|| {
        ApiError::unauthorized(
            "missing_api_key",
            "an API key is required: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
        )
    })?;
    let d = digest(presented.as_bytes());
    let mut found = None;
    for (i, k) in cfg.keys.iter().enumerate() {
        let stored = parse_digest(&k.sha256).unwrap_or([0; 32]);
        if bool::from(stored.ct_eq(&d)) && found.is_none() {
            found = Some(i);
        }
    }
    let index = found
        .ok_or_else(|| ApiError::unauthorized("invalid_api_key", "the API key is not valid"))?;
    Ok(Caller {
        digest: d,
        tenant: cfg.keys[index].tenant.clone(),
        index,
    })
}

/// Whether `key` may use `model` (403 if not).
pub fn check_model(key: &ApiKeyConfig, model: &str) -> Result<(), ApiError> {
    if key.models.is_empty() || key.models.iter().any(|m| m == model) {
        Ok(())
    } else {
        Err(ApiError::forbidden(
            "model_not_allowed",
            format!("this API key may not use model `{model}`"),
        ))
    }
}

/// A token bucket holding up to `cap`, refilled continuously at `cap` a `period` (a minute for
/// the per-minute limits, a day for the per-day budget: a rolling day, not a calendar one).
#[derive(Debug, Clone)]
struct Bucket {
    level: f64,
    updated: Instant,
}

const MINUTE: f64 = 60.0;
const DAY: f64 = 86_400.0;

impl Bucket {
    fn full(cap: u64, now: Instant) -> Bucket {
        Bucket {
            level: cap as f64,
            updated: now,
        }
    }

    fn refill(&mut self, cap: u64, period_s: f64, now: Instant) {
        let rate = cap as f64 / period_s;
        let dt = now.saturating_duration_since(self.updated).as_secs_f64();
        self.level = (self.level + dt * rate).min(cap as f64);
        self.updated = now;
    }

    /// Seconds until `amount` fits (0 if it does now).
    fn wait_for(&self, amount: f64, cap: u64, period_s: f64) -> f64 {
        let missing = amount.min(cap as f64) - self.level;
        if missing <= 0.0 {
            0.0
        } else {
            missing / (cap as f64 / period_s)
        }
    }

    /// Give back what was charged and not used.
    fn settle(&mut self, charged: u64, used: u64, cap: u64) {
        self.level = (self.level + charged as f64 - used as f64).min(cap as f64);
    }
}

#[derive(Debug, Default)]
struct Quota {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    daily: Option<Bucket>,
    /// Requests in flight, each holding a [`Holding`].
    inflight: Arc<AtomicU64>,
}

/// One request in flight for its key (`max_concurrent`): released when dropped, however the
/// request ends.
#[derive(Debug)]
pub struct Holding(Arc<AtomicU64>);

impl Drop for Holding {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Per-key rate state. Kept across reloads (keyed by digest), so a reload neither resets nor
/// loses what a tenant has used.
#[derive(Default)]
pub struct Limiter(Mutex<HashMap<KeyDigest, Quota>>);

impl Limiter {
    /// Charge one request and `est_tokens` to the key, or say how long to wait (429). A request
    /// larger than a whole minute's token allowance is admitted once the bucket is full.
    pub fn admit(
        &self,
        caller: &Caller,
        key: &ApiKeyConfig,
        est_tokens: u64,
        now: Instant,
    ) -> Result<(), ApiError> {
        let Ok(mut map) = self.0.lock() else {
            return Ok(());
        };
        let q = map.entry(caller.digest).or_default();
        let mut wait: f64 = 0.0;
        if let Some(rpm) = key.requests_per_minute {
            let b = q.requests.get_or_insert_with(|| Bucket::full(rpm, now));
            b.refill(rpm, MINUTE, now);
            wait = wait.max(b.wait_for(1.0, rpm, MINUTE));
        }
        if let Some(tpm) = key.tokens_per_minute {
            let b = q.tokens.get_or_insert_with(|| Bucket::full(tpm, now));
            b.refill(tpm, MINUTE, now);
            wait = wait.max(b.wait_for(est_tokens as f64, tpm, MINUTE));
        }
        let mut budget_spent = false;
        if let Some(tpd) = key.tokens_per_day {
            let b = q.daily.get_or_insert_with(|| Bucket::full(tpd, now));
            b.refill(tpd, DAY, now);
            let w = b.wait_for(est_tokens as f64, tpd, DAY);
            budget_spent = w > wait;
            wait = wait.max(w);
        }
        if wait > 0.0 {
            let what = if budget_spent {
                "its daily token budget"
            } else {
                "its rate limit"
            };
            return Err(ApiError::rate_limited(
                format!(
                    "tenant `{}` is over {what}; retry in {:.1} s",
                    caller.tenant, wait
                ),
                wait.ceil().max(1.0) as u32,
            ));
        }
        if let Some(b) = q.requests.as_mut() {
            b.level -= 1.0;
        }
        for b in [q.tokens.as_mut(), q.daily.as_mut()].into_iter().flatten() {
            b.level -= est_tokens as f64;
        }
        Ok(())
    }

    /// One more request in flight for the key, or 429 when it has `max_concurrent` already.
    /// `None` when the key has no cap.
    pub fn enter(&self, caller: &Caller, key: &ApiKeyConfig) -> Result<Option<Holding>, ApiError> {
        let Some(cap) = key.max_concurrent else {
            return Ok(None);
        };
        let Ok(mut map) = self.0.lock() else {
            return Ok(None);
        };
        let inflight = map.entry(caller.digest).or_default().inflight.clone();
        drop(map);
        let held = Holding(inflight);
        if held.0.fetch_add(1, Ordering::Relaxed) >= cap {
            return Err(ApiError::rate_limited(
                format!(
                    "tenant `{}` has {cap} requests in flight, as many as its key may",
                    caller.tenant
                ),
                1,
            ));
        }
        Ok(Some(held))
    }

    /// The request is done: it used `used` tokens where `charged` were taken up front.
    pub fn settle(&self, caller: &Caller, key: &ApiKeyConfig, charged: u64, used: u64) {
        let Ok(mut map) = self.0.lock() else {
            return;
        };
        let Some(q) = map.get_mut(&caller.digest) else {
            return;
        };
        if let (Some(tpm), Some(b)) = (key.tokens_per_minute, q.tokens.as_mut()) {
            b.settle(charged, used, tpm);
        }
        if let (Some(tpd), Some(b)) = (key.tokens_per_day, q.daily.as_mut()) {
            b.settle(charged, used, tpd);
        }
    }

    /// Tokens each key has left of its daily budget now, by tenant (keys without one are
    /// left out).
    pub fn budgets_left(&self, cfg: &AccessConfig, now: Instant) -> Vec<(String, f64)> {
        let Ok(mut map) = self.0.lock() else {
            return Vec::new();
        };
        cfg.keys
            .iter()
            .filter_map(|k| {
                let tpd = k.tokens_per_day?;
                let left = match map
                    .get_mut(&parse_digest(&k.sha256)?)
                    .and_then(|q| q.daily.as_mut())
                {
                    Some(b) => {
                        b.refill(tpd, DAY, now);
                        b.level.max(0.0)
                    }
                    None => tpd as f64,
                };
                Some((k.tenant.clone(), left))
            })
            .collect()
    }

    /// Forget keys no longer configured (after a reload).
    pub fn retain(&self, cfg: &AccessConfig) {
        let keep: Vec<KeyDigest> = cfg
            .keys
            .iter()
            .filter_map(|k| parse_digest(&k.sha256))
            .collect();
        if let Ok(mut map) = self.0.lock() {
            map.retain(|d, _| keep.contains(d));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn hex(d: &KeyDigest) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn cfg() -> AccessConfig {
        AccessConfig {
            keys: vec![
                ApiKeyConfig {
                    sha256: hex(&digest(b"alpha-key")),
                    tenant: "alpha".into(),
                    models: vec!["m1".into()],
                    requests_per_minute: Some(60),
                    tokens_per_minute: Some(6000),
                    max_priority: 0,
                    max_concurrent: None,
                    tenant_from_header: false,
                    tokens_per_day: None,
                },
                ApiKeyConfig {
                    sha256: hex(&digest(b"beta-key")),
                    tenant: "beta".into(),
                    models: vec![],
                    requests_per_minute: None,
                    tokens_per_minute: None,
                    max_priority: 0,
                    max_concurrent: None,
                    tenant_from_header: false,
                    tokens_per_day: None,
                },
            ],
        }
    }

    #[test]
    fn keys_are_recognised_by_digest_only() {
        let c = cfg();
        let who = authenticate(&c, Some(b"Bearer beta-key"), None).unwrap();
        assert_eq!((who.tenant.as_str(), who.index), ("beta", 1));
        assert_eq!(
            authenticate(&c, Some(b"bearer  alpha-key "), None)
                .unwrap()
                .tenant,
            "alpha"
        );
        for bad in [
            None,
            Some(&b"Bearer"[..]),
            Some(b"Basic alpha-key"),
            Some(b"Bearer nope"),
        ] {
            assert_eq!(
                authenticate(&c, bad, None).unwrap_err().status,
                401,
                "{bad:?}"
            );
        }
        // Anthropic's clients send the key as `x-api-key`; a bad `Authorization` still fails.
        let who = authenticate(&c, None, Some(b" beta-key")).unwrap();
        assert_eq!(who.index, 1);
        assert_eq!(
            authenticate(&c, Some(b"Basic x"), Some(b"beta-key"))
                .unwrap_err()
                .status,
            401
        );
        assert_eq!(authenticate(&c, None, Some(b"")).unwrap_err().status, 401);
        assert_eq!(parse_digest(&c.keys[0].sha256), Some(digest(b"alpha-key")));
        assert_eq!(parse_digest("zz"), None);
    }

    #[test]
    fn models_are_checked_per_key() {
        let c = cfg();
        assert!(check_model(&c.keys[0], "m1").is_ok());
        assert_eq!(check_model(&c.keys[0], "m2").unwrap_err().status, 403);
        assert!(check_model(&c.keys[1], "anything").is_ok());
    }

    #[test]
    fn request_and_token_buckets_refill_and_settle() {
        let c = cfg();
        let (key, l, t0) = (&c.keys[0], Limiter::default(), Instant::now());
        let who = authenticate(&c, Some(b"Bearer alpha-key"), None).unwrap();
        // 6000 tokens a minute: two 2500-token requests fit, a third must wait.
        l.admit(&who, key, 2500, t0).unwrap();
        l.admit(&who, key, 2500, t0).unwrap();
        let e = l.admit(&who, key, 2500, t0).unwrap_err();
        assert_eq!(
            (e.status, e.retry_after),
            (429, Some(15)),
            "1500 missing at 100/s"
        );
        // The first two used only 500 each: settling gives 4000 back.
        l.settle(&who, key, 2500, 500);
        l.settle(&who, key, 2500, 500);
        l.admit(&who, key, 2500, t0).unwrap();
        // 60 requests a minute: the request bucket runs dry, then refills at one a second.
        let big = ApiKeyConfig {
            tokens_per_minute: None,
            ..key.clone()
        };
        for _ in 0..57 {
            l.admit(&who, &big, 0, t0).unwrap();
        }
        assert_eq!(l.admit(&who, &big, 0, t0).unwrap_err().retry_after, Some(1));
        l.admit(&who, &big, 0, t0 + Duration::from_millis(1100))
            .unwrap();
        // A request bigger than a minute's allowance waits for a full bucket, not forever.
        let other = authenticate(&c, Some(b"Bearer alpha-key"), None).unwrap();
        let l2 = Limiter::default();
        l2.admit(&other, key, 50_000, t0).unwrap();
        assert!(l2.admit(&other, key, 50_000, t0).is_err());
    }

    #[test]
    fn a_daily_budget_is_spent_refills_over_a_day_and_settles_from_usage() {
        let c = cfg();
        let key = ApiKeyConfig {
            tokens_per_minute: None,
            requests_per_minute: None,
            tokens_per_day: Some(86_400),
            ..c.keys[0].clone()
        };
        let (l, t0) = (Limiter::default(), Instant::now());
        let who = authenticate(&c, Some(b"Bearer alpha-key"), None).unwrap();
        l.admit(&who, &key, 80_000, t0).unwrap();
        // 6,400 left, 10,000 asked: 3,600 missing at one token a second.
        let e = l.admit(&who, &key, 10_000, t0).unwrap_err();
        assert_eq!((e.status, e.retry_after), (429, Some(3600)));
        assert!(e.message.contains("daily token budget"), "{}", e.message);
        let left = l.budgets_left(
            &AccessConfig {
                keys: vec![key.clone()],
            },
            t0,
        );
        assert_eq!(left, vec![("alpha".to_string(), 6_400.0)]);
        // The first request used 20,000 of its 80,000: the rest comes back.
        l.settle(&who, &key, 80_000, 20_000);
        l.admit(&who, &key, 10_000, t0).unwrap();
        // An hour later, 3,600 more.
        let later = t0 + Duration::from_secs(3600);
        let left = l.budgets_left(
            &AccessConfig {
                keys: vec![key.clone()],
            },
            later,
        );
        assert_eq!(left[0].1, 56_400.0 + 3_600.0);
    }
}
