//! Per-tenant figures of a run with more than one tenant: what each tenant got (requests,
//! errors, sheds by reason, TTFT, goodput, attained service, deadlines met), and how evenly
//! the fleet served the tenants that wanted more than they got (`fairness`).
//!
//! A request without a tenant is `default`'s, as kvroute names it; one without a priority is
//! in band 0, kvroute's default.
//!
//! # Layout
//! - this file: the rows, from records.
//! - `fairness`: backlogs, windows and Jain's index.
//! - `replay::tenant_table`: the Markdown of both, for `replay`'s report and `compare`'s
//!   README.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::percentile::percentile;
use super::record::RequestRecord;

mod fairness;

pub use fairness::{measure, Fairness, WINDOW_MS};

/// kvroute's tenant for a request that names none.
pub const DEFAULT_TENANT: &str = "default";

/// What one tenant got in a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TenantRow {
    pub tenant: String,
    /// The priorities its requests were sent with, lowest first.
    pub priorities: Vec<i32>,
    pub requests: u64,
    /// Failed requests that were not shed (sheds are counted in `shed`).
    pub errors: u64,
    /// Shed requests by `x-kvroute-dropped-reason`.
    pub shed: BTreeMap<String, u64>,
    /// TTFT of its successful requests.
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// Successful requests whose TTFT met their own deadline (without one: the run's TTFT
    /// SLO), per second of the whole run, so tenants' figures add up.
    pub goodput_rps: f64,
    /// Prompt tokens plus twice the completion tokens, from usage: what kvroute's fair share
    /// charges by default.
    pub attained_service: u64,
    /// Time from sending to the shed answer (the 429), p99 over its shed requests.
    pub shed_answer_p99_ms: Option<f64>,
    /// Its requests that carried a deadline, if any did.
    pub deadlines: Option<Deadlines>,
}

/// A tenant's requests that carried a TTFT deadline (`x-slo-ttft-ms`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Deadlines {
    pub requests: u64,
    /// Not shed.
    pub admitted: u64,
    /// Of the admitted, the share whose TTFT was within the deadline (a failed one missed).
    pub met: Option<f64>,
    /// Admitted with `x-kvroute-slo: at_risk` (kvroute predicted a miss and sent it anyway).
    pub at_risk: u64,
}

pub fn tenant_of(r: &RequestRecord) -> &str {
    r.tenancy.tenant.as_deref().unwrap_or(DEFAULT_TENANT)
}

/// One row per tenant, in name order. `slo_ttft_ms` is the run's SLO and `duration_s` the
/// run's length (goodput is per second of it).
pub fn rows(records: &[RequestRecord], slo_ttft_ms: f64, duration_s: f64) -> Vec<TenantRow> {
    let mut by: BTreeMap<&str, Vec<&RequestRecord>> = BTreeMap::new();
    for r in records {
        by.entry(tenant_of(r)).or_default().push(r);
    }
    by.into_iter()
        .map(|(tenant, rs)| row(tenant, &rs, slo_ttft_ms, duration_s))
        .collect()
}

fn row(tenant: &str, rs: &[&RequestRecord], slo_ttft_ms: f64, duration_s: f64) -> TenantRow {
    let ok: Vec<&RequestRecord> = rs.iter().copied().filter(|r| r.ok()).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let within = |r: &RequestRecord| {
        let deadline = r.tenancy.slo_ttft_ms.map_or(slo_ttft_ms, |ms| ms as f64);
        r.ok() && r.ttft_ms.is_some_and(|t| t <= deadline)
    };
    let mut shed = BTreeMap::new();
    for reason in rs.iter().filter_map(|r| r.dropped_reason.as_deref()) {
        *shed.entry(reason.to_owned()).or_insert(0) += 1;
    }
    let shed_ms: Vec<f64> = rs.iter().filter(|r| r.shed()).map(|r| r.e2e_ms).collect();
    let with_deadline: Vec<&RequestRecord> = rs
        .iter()
        .copied()
        .filter(|r| r.tenancy.slo_ttft_ms.is_some())
        .collect();
    let deadlines = (!with_deadline.is_empty()).then(|| {
        let admitted: Vec<&RequestRecord> = with_deadline
            .iter()
            .copied()
            .filter(|r| !r.shed())
            .collect();
        let met = admitted.iter().filter(|r| within(r)).count();
        Deadlines {
            requests: with_deadline.len() as u64,
            admitted: admitted.len() as u64,
            met: (!admitted.is_empty()).then(|| met as f64 / admitted.len() as f64),
            at_risk: admitted
                .iter()
                .filter(|r| r.slo.as_deref() == Some("at_risk"))
                .count() as u64,
        }
    });
    let priorities: BTreeSet<i32> = rs.iter().map(|r| r.tenancy.priority.unwrap_or(0)).collect();
    let good = rs.iter().filter(|r| within(r)).count() as f64;
    TenantRow {
        tenant: tenant.to_owned(),
        priorities: priorities.into_iter().collect(),
        requests: rs.len() as u64,
        errors: rs.iter().filter(|r| !r.ok() && !r.shed()).count() as u64,
        shed,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        goodput_rps: if duration_s > 0.0 {
            good / duration_s
        } else {
            0.0
        },
        attained_service: rs.iter().map(|r| r.service()).sum(),
        shed_answer_p99_ms: percentile(&shed_ms, 99.0),
        deadlines,
    }
}

/// The per-tenant rows of `measured` (the records after the warm-up, of a run of
/// `duration_s` with a TTFT SLO of `slo_ttft_ms`) and the fairness of `all` from `from_ms` on,
/// when the run had more than one tenant.
pub fn measure_tenants(
    measured: &[RequestRecord],
    all: &[RequestRecord],
    from_ms: f64,
    slo_ttft_ms: f64,
    duration_s: f64,
) -> Option<(Vec<TenantRow>, Fairness)> {
    let rows = rows(measured, slo_ttft_ms, duration_s);
    (rows.len() >= 2).then(|| (rows, measure(all, from_ms, WINDOW_MS)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::record::Tenancy;

    fn rec(tenant: &str, send: f64, ttft: Option<f64>, e2e: f64) -> RequestRecord {
        RequestRecord {
            send_ms: send,
            ttft_ms: ttft,
            e2e_ms: e2e,
            prompt_tokens: ttft.map(|_| 1000),
            completion_tokens: ttft.map(|_| 10),
            tenancy: Tenancy {
                tenant: Some(tenant.into()),
                ..Tenancy::default()
            },
            ..Default::default()
        }
    }

    fn shed(tenant: &str, send: f64, e2e: f64, reason: &str) -> RequestRecord {
        RequestRecord {
            error: Some("HTTP 429: fleet_saturated".into()),
            status: Some(429),
            dropped_reason: Some(reason.into()),
            ..rec(tenant, send, None, e2e)
        }
    }

    #[test]
    fn rows_count_sheds_apart_from_errors_and_sum_service() {
        let mut flood = vec![
            rec("flood", 0.0, Some(3000.0), 3100.0),
            rec("flood", 10.0, Some(1000.0), 1100.0),
            shed("flood", 20.0, 2.0, "sheddable"),
            shed("flood", 30.0, 4.0, "sheddable"),
            shed("flood", 40.0, 9000.0, "queue_timeout"),
        ];
        flood[0].tenancy.priority = Some(0);
        flood[2].tenancy.priority = Some(-1);
        let mut failed = rec("steady-0", 50.0, None, 10.0);
        failed.error = Some("send: connection refused".into());
        let mut recs = flood;
        recs.extend([rec("steady-0", 0.0, Some(100.0), 500.0), failed]);
        let rows = rows(&recs, 2000.0, 10.0);
        assert_eq!(rows.len(), 2);
        let f = &rows[0];
        assert_eq!((f.tenant.as_str(), f.requests, f.errors), ("flood", 5, 0));
        assert_eq!(f.priorities, [-1, 0]);
        assert_eq!(
            f.shed,
            BTreeMap::from([("queue_timeout".into(), 1), ("sheddable".into(), 2)])
        );
        // One of the two served met the run's SLO of 2 s; over the run's 10 s.
        assert!((f.goodput_rps - 0.1).abs() < 1e-12);
        assert_eq!(f.attained_service, 2 * (1000 + 2 * 10));
        assert_eq!(f.ttft_p50_ms, Some(2000.0));
        // The p99 of 2, 4 and 9000 ms: interpolated near the slowest shed.
        assert!(f.shed_answer_p99_ms.unwrap() > 8800.0);
        assert!(f.deadlines.is_none());
        let s = &rows[1];
        assert_eq!((s.requests, s.errors, s.shed.len()), (2, 1, 0));
        assert_eq!(s.attained_service, 1020);
        assert_eq!(s.shed_answer_p99_ms, None);
    }

    #[test]
    fn deadlines_count_the_admitted_that_met_them() {
        let with = |r: RequestRecord, ms: u64, slo: Option<&str>| RequestRecord {
            tenancy: Tenancy {
                slo_ttft_ms: Some(ms),
                ..r.tenancy.clone()
            },
            slo: slo.map(str::to_owned),
            ..r
        };
        let mut late = with(rec("t", 0.0, None, 100.0), 500, Some("on_track"));
        late.error = Some("timeout".into());
        let recs = vec![
            with(rec("t", 0.0, Some(400.0), 450.0), 500, Some("on_track")),
            with(rec("t", 0.0, Some(700.0), 750.0), 500, Some("at_risk")),
            late,
            with(shed("t", 0.0, 3.0, "slo_unattainable"), 500, None),
            // No deadline: judged by the run's SLO, and not in the deadline figures.
            rec("t", 0.0, Some(1500.0), 1600.0),
            rec("u", 0.0, Some(10.0), 20.0),
        ];
        let rows = rows(&recs, 2000.0, 1.0);
        let t = &rows[0];
        let d = t.deadlines.as_ref().unwrap();
        assert_eq!((d.requests, d.admitted, d.at_risk), (4, 3, 1));
        // One of three admitted met 500 ms; the failed one counts as a miss.
        assert!((d.met.unwrap() - 1.0 / 3.0).abs() < 1e-12);
        // Goodput: the 400 ms one (its deadline) and the 1500 ms one (the run's SLO).
        assert_eq!(t.goodput_rps, 2.0);
        assert_eq!(t.shed["slo_unattainable"], 1);
        assert_eq!(t.shed_answer_p99_ms, Some(3.0));
    }

    #[test]
    fn one_tenant_adds_nothing_and_two_add_rows_and_fairness() {
        let one = vec![rec("a", 0.0, Some(1.0), 2.0)];
        assert!(measure_tenants(&one, &one, 0.0, 2000.0, 1.0).is_none());
        // A record with no tenant is `default`'s: beside `a`, two tenants.
        let mut untagged = rec("x", 0.0, Some(1.0), 2.0);
        untagged.tenancy.tenant = None;
        let two = vec![one[0].clone(), untagged];
        let (rows, fairness) = measure_tenants(&two, &two, 0.0, 2000.0, 1.0).unwrap();
        let names: Vec<&str> = rows.iter().map(|r| r.tenant.as_str()).collect();
        assert_eq!(names, ["a", "default"]);
        assert_eq!(fairness.windows, 0);
    }
}
