//! How close kvroute's prompt-token estimates came to the engines' counts, from its
//! `kvroute_prompt_tokens_estimate_ratio{method}` histogram (engine-reported prompt tokens over
//! the estimate, before that request's correction): scraped from the admin listener at the end
//! of the warm-up and at the end of the run, the difference is the requests answered in
//! between. The share within 10% is the part of that difference in (0.9, 1.1].

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::Serialize;

const METRIC: &str = "kvroute_prompt_tokens_estimate_ratio";

/// One method's (or all methods') requests, and how many were within 10%.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Share {
    pub requests: u64,
    pub within_10pct: u64,
}

impl Share {
    pub fn fraction(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.within_10pct as f64 / self.requests as f64)
    }

    fn add(&mut self, other: Share) {
        self.requests += other.requests;
        self.within_10pct += other.within_10pct;
    }
}

/// The measured window's histogram, per `method` label, and the shares read from it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Estimates {
    pub overall: Share,
    pub methods: BTreeMap<String, Share>,
    /// Per method, requests per bucket upper bound (`le`), not cumulative.
    pub buckets: BTreeMap<String, Vec<(String, u64)>>,
}

/// Per method: cumulative bucket counts by `le`, in the order scraped, and the total count.
type Histograms = BTreeMap<String, (Vec<(String, f64)>, f64)>;

/// The histogram's samples in Prometheus text format.
fn parse(text: &str) -> Histograms {
    let mut out = Histograms::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(METRIC) else {
            continue;
        };
        let (kind, rest) = match rest.split_once('{') {
            Some((kind, rest)) => (kind, rest),
            None => continue,
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let label = |name: &str| {
            labels.split(',').find_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                (k.trim() == name).then(|| v.trim().trim_matches('"').to_owned())
            })
        };
        let Some(method) = label("method") else {
            continue;
        };
        let entry = out.entry(method).or_default();
        match (kind, label("le")) {
            ("_bucket", Some(le)) => entry.0.push((le, value)),
            ("_count", _) => entry.1 = value,
            _ => {}
        }
    }
    out
}

fn cumulative(buckets: &[(String, f64)], le: &str) -> Option<f64> {
    buckets.iter().find(|(b, _)| b == le).map(|&(_, v)| v)
}

/// The requests observed between two scrapes (`before` is None for the process's start).
pub fn between(before: Option<&str>, after: &str) -> Result<Estimates, String> {
    let before = before.map(parse).unwrap_or_default();
    let after = parse(after);
    let mut est = Estimates::default();
    for (method, (buckets, count)) in &after {
        let (b0, c0) = before.get(method).cloned().unwrap_or_default();
        let at = |le: &str| -> Result<f64, String> {
            let now = cumulative(buckets, le).ok_or_else(|| {
                format!("{METRIC}: no bucket le=\"{le}\" (kvroute has other buckets)")
            })?;
            Ok(now - cumulative(&b0, le).unwrap_or(0.0))
        };
        let share = Share {
            requests: (count - c0).max(0.0) as u64,
            within_10pct: (at("1.1")? - at("0.9")?).max(0.0) as u64,
        };
        let mut below = 0.0;
        let mut per_bucket = Vec::with_capacity(buckets.len());
        for (le, _) in buckets {
            let upto = at(le)?;
            per_bucket.push((le.clone(), (upto - below).max(0.0) as u64));
            below = upto;
        }
        est.overall.add(share);
        est.methods.insert(method.clone(), share);
        est.buckets.insert(method.clone(), per_bucket);
    }
    Ok(est)
}

/// `GET /metrics` of kvroute's admin listener.
pub async fn scrape(admin: SocketAddr) -> Result<String, String> {
    let url = format!("http://{admin}/metrics");
    let res = reqwest::get(&url)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !res.status().is_success() {
        return Err(format!("{url}: status {}", res.status()));
    }
    res.text().await.map_err(|e| format!("{url}: {e}"))
}

fn percent(s: &Share) -> String {
    s.fraction()
        .map_or_else(|| "-".to_owned(), |f| format!("{:.1}%", f * 100.0))
}

/// One line: overall, then per method, e.g. `91.2% of 6,120 (counted 95.0% of 5,800, sized
/// 20.3% of 320)`.
pub fn summary_line(e: &Estimates) -> String {
    let methods: Vec<String> = e
        .methods
        .iter()
        .map(|(m, s)| format!("{m} {} of {}", percent(s), s.requests))
        .collect();
    format!(
        "{} of {} ({})",
        percent(&e.overall),
        e.overall.requests,
        methods.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn histogram(counted: [u64; 14], sized: [u64; 14]) -> String {
        let les = [
            "0.25", "0.5", "0.67", "0.8", "0.9", "0.95", "1", "1.05", "1.1", "1.25", "1.5", "2",
            "4", "+Inf",
        ];
        let mut text = format!("# HELP {METRIC} x\n# TYPE {METRIC} histogram\n");
        for (method, counts) in [("counted", counted), ("sized", sized)] {
            let mut total = 0;
            for (le, n) in les.iter().zip(counts) {
                total += n;
                text.push_str(&format!(
                    "{METRIC}_bucket{{method=\"{method}\",le=\"{le}\"}} {total}\n"
                ));
            }
            text.push_str(&format!("{METRIC}_sum{{method=\"{method}\"}} 1.5\n"));
            text.push_str(&format!("{METRIC}_count{{method=\"{method}\"}} {total}\n"));
        }
        text.push_str("kvroute_prompt_tokens_total 5\n");
        text
    }

    #[test]
    fn share_within_ten_percent_after_the_warm_up() {
        // Per bucket (not cumulative): 0.25 .. 4, +Inf.
        let warm = histogram(
            [1, 0, 0, 0, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        );
        let end = histogram(
            [1, 0, 0, 1, 2, 13, 14, 5, 6, 1, 0, 0, 0, 1],
            [0, 0, 0, 9, 0, 1, 1, 0, 0, 0, 0, 3, 0, 0],
        );
        let e = between(Some(&warm), &end).unwrap();
        // Counted after warm-up: 0.8: 1, 0.95: 10, 1: 10, 1.05: 5, 1.1: 6, 1.25: 1, +Inf: 1.
        let counted = e.methods["counted"];
        assert_eq!(
            counted,
            Share {
                requests: 34,
                within_10pct: 31
            }
        );
        let sized = e.methods["sized"];
        assert_eq!(
            sized,
            Share {
                requests: 9,
                within_10pct: 2
            }
        );
        assert_eq!(
            e.overall,
            Share {
                requests: 43,
                within_10pct: 33
            }
        );
        assert_eq!(e.buckets["counted"][5], ("0.95".to_owned(), 10));
        assert_eq!(e.buckets["counted"][13], ("+Inf".to_owned(), 1));
        let line = summary_line(&e);
        assert_eq!(line, "76.7% of 43 (counted 91.2% of 34, sized 22.2% of 9)");
        // No warm-up: everything since kvroute started.
        assert_eq!(between(None, &warm).unwrap().overall.requests, 15);
        // No estimate yet: nothing to report.
        let none = between(None, "kvroute_requests_total 0\n").unwrap();
        assert_eq!(summary_line(&none), "- of 0 ()");
    }

    #[test]
    fn other_buckets_are_an_error_not_a_wrong_share() {
        let wide = format!(
            "{METRIC}_bucket{{method=\"counted\",le=\"1\"}} 3\n\
             {METRIC}_bucket{{method=\"counted\",le=\"2\"}} 4\n\
             {METRIC}_count{{method=\"counted\"}} 4\n"
        );
        let err = between(None, &wide).unwrap_err();
        assert!(err.contains("no bucket le=\"1.1\""), "{err}");
    }
}
