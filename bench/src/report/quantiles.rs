//! `kvbench report quantiles`: TTFT at p40..p60 and p85..p95, to show whether a percentile sits
//! on a cliff of the distribution (where one run's p50 or p90 lands on either side from run to
//! run), and the big misses: requests that computed more than BIG_TOKENS uncached tokens as
//! their session group's first request (a miss no router avoids) or later (one the router
//! chose or could not avoid), with how many of each were at or over the run's p90.

use std::collections::{BTreeMap, HashSet};

use super::{fixed, pick, sorted, Record, RunReport};

const QUANTILES: [f64; 8] = [0.40, 0.45, 0.50, 0.55, 0.60, 0.85, 0.90, 0.95];

/// A miss this big costs a prefill of a second or more on the simulated GPUs.
const BIG_TOKENS: i64 = 3000;

/// The session id up to `-req`: hot_prefix's sessions are `TENANT-reqN`, and its tenants share
/// a prefix. A trace without sessions (mooncake) makes every request its own group.
fn group(r: &Record) -> String {
    let session = match r.session.as_deref() {
        Some(s) if !s.is_empty() => s.to_string(),
        _ => format!("request {}", r.id),
    };
    match session.split_once("-req") {
        Some((head, _)) => head.to_string(),
        None => session,
    }
}

pub fn row(report: &RunReport) -> Option<String> {
    // All records, failed ones too, as the published tables counted them.
    let mut records: Vec<&Record> = report.records.iter().collect();
    records.sort_by(|a, b| a.send_ms.total_cmp(&b.send_ms));
    let ttft = sorted(records.iter().filter_map(|r| r.ttft_ms).collect());
    let p90 = pick(&ttft, 0.9)?;
    let qs = QUANTILES
        .iter()
        .map(|&q| {
            format!(
                "p{} {}",
                (q * 100.0).round(),
                fixed(pick(&ttft, q).unwrap_or(f64::NAN), 0)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let mut seen = HashSet::new();
    // Sorted by kind, so the line reads the same in every run.
    let mut counts: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for r in &records {
        let first = seen.insert(group(r));
        let kind = if r.uncached() <= BIG_TOKENS {
            "hit"
        } else if first {
            "first miss"
        } else {
            "later miss"
        };
        let c = counts.entry(kind).or_default();
        c.0 += 1;
        c.1 += usize::from(r.ttft_ms.is_some_and(|t| t >= p90));
    }
    let kinds = counts
        .iter()
        .map(|(k, (total, slow))| format!("{k}: {total} ({slow} at or over p90)"))
        .collect::<Vec<_>>()
        .join("; ");
    Some(format!(
        "{} requests; TTFT ms {qs}\n    {kinds}",
        ttft.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::super::tests::rec;
    use super::*;

    #[test]
    fn quantiles_of_a_known_list_and_misses_by_group() {
        // TTFTs 1..=20 ms; p40 is the 9th value (index 8), p90 the 19th (index 18).
        let mut records: Vec<Record> = (0..20)
            .map(|i| rec(i, i as f64, Some("t1-req0"), "0", (i + 1) as f64, 0))
            .collect();
        // t1's first request misses (group's first), t1-req7 is a later miss of the same
        // tenant, and a request without a session is a group of its own: a first miss.
        records[0].prompt_tokens = Some(5000);
        records[7].session = Some("t1-req7".into());
        records[7].prompt_tokens = Some(4000);
        records[19].session = None;
        records[19].prompt_tokens = Some(9000);
        let report = RunReport {
            records,
            ..Default::default()
        };
        assert_eq!(
            row(&report).unwrap(),
            "20 requests; TTFT ms p40 9, p45 10, p50 11, p55 12, p60 13, p85 18, p90 19, p95 20\n    \
             first miss: 2 (1 at or over p90); hit: 17 (1 at or over p90); later miss: 1 (0 at or over p90)"
        );
    }

    #[test]
    fn group_cuts_at_req() {
        let mut r = rec(3, 0.0, Some("tenant-4-req12"), "0", 1.0, 0);
        assert_eq!(group(&r), "tenant-4");
        r.session = Some(String::new());
        assert_eq!(group(&r), "request 3");
    }
}
