//! `kvbench report concurrency`: how evenly a run spread its requests in flight over the
//! backends, and what that did to decode speed. The e2e tail of a decode-heavy workload is
//! made by long answers on crowded backends, so the tail's requests are shown beside the
//! crowding over time.

use std::collections::HashMap;

use super::{fixed, median, pick, sorted, Record, RunReport};

/// Bins of model time in which requests in flight are counted.
const BIN_MS: f64 = 100.0;

/// Answers at least this long are decode-bound, so their inter-token time shows crowding.
const LONG_TOKENS: u64 = 300;

fn q(values: Vec<f64>, p: f64) -> f64 {
    pick(&sorted(values), p).unwrap_or(f64::NAN)
}

/// Mean time between output tokens after the first.
fn itl(r: &Record, ttft: f64) -> f64 {
    let gaps = (r.completion_tokens.unwrap_or(0) as i64 - 1).max(1);
    (r.e2e_ms - ttft) / gaps as f64
}

/// Requests in flight per backend per bin, over the whole run; a request counts in every bin
/// its span touches.
pub fn in_flight(recs: &[(&Record, f64)]) -> HashMap<Option<String>, Vec<u32>> {
    let t0 = recs
        .iter()
        .map(|(r, _)| r.send_ms)
        .fold(f64::INFINITY, f64::min);
    let end = recs
        .iter()
        .map(|(r, _)| r.send_ms + r.e2e_ms)
        .fold(f64::NEG_INFINITY, f64::max);
    let bins = ((end - t0) / BIN_MS) as usize + 1;
    let mut by: HashMap<Option<String>, Vec<u32>> = HashMap::new();
    for (r, _) in recs {
        let v = by.entry(r.backend.clone()).or_insert_with(|| vec![0; bins]);
        let first = ((r.send_ms - t0) / BIN_MS) as usize;
        let last = ((r.send_ms + r.e2e_ms - t0) / BIN_MS) as usize;
        for c in &mut v[first.min(bins)..(last + 1).min(bins)] {
            *c += 1;
        }
    }
    by
}

/// Over the middle 60% of the run (ramp-up and drain left out): per bin with anything in
/// flight, the busiest backend's count over the mean, and each backend's mean count, rounded to
/// 0.1 and sorted.
pub fn balance(by: &HashMap<Option<String>, Vec<u32>>) -> (Vec<f64>, Vec<f64>) {
    let bins = by.values().next().map_or(0, Vec::len);
    let (lo, hi) = ((bins as f64 * 0.2) as usize, (bins as f64 * 0.8) as usize);
    let mut ratios = Vec::new();
    for i in lo..hi {
        let c: Vec<u32> = by.values().map(|v| v[i]).collect();
        let sum: u32 = c.iter().sum();
        if sum > 0 {
            let max = c.iter().copied().max().unwrap_or(0);
            ratios.push(f64::from(max) / (f64::from(sum) / c.len() as f64));
        }
    }
    let mut means: Vec<f64> = by
        .values()
        .filter(|_| hi > lo)
        .map(|v| {
            let sum: u64 = v[lo..hi].iter().map(|&c| u64::from(c)).sum();
            let mean = sum as f64 / (hi - lo) as f64;
            // Rounded as the decimal shown, so equal-looking means sort as equal.
            format!("{mean:.1}").parse().unwrap_or(mean)
        })
        .collect();
    means.sort_by(f64::total_cmp);
    (ratios, means)
}

pub fn row(report: &RunReport) -> Option<String> {
    let recs: Vec<(&Record, f64)> = report
        .records
        .iter()
        .filter_map(|r| r.answered().map(|t| (r, t)))
        .collect();
    if recs.is_empty() {
        return None;
    }
    let p99 = q(recs.iter().map(|(r, _)| r.e2e_ms).collect(), 0.99);
    let tail: Vec<&(&Record, f64)> = recs.iter().filter(|(r, _)| r.e2e_ms >= p99).collect();
    let long: Vec<&(&Record, f64)> = recs
        .iter()
        .filter(|(r, _)| r.completion_tokens.unwrap_or(0) >= LONG_TOKENS)
        .collect();
    let long_itl = if long.is_empty() {
        "n/a".to_string()
    } else {
        let itls: Vec<f64> = long.iter().map(|(r, t)| itl(r, *t)).collect();
        [0.5, 0.9, 0.99]
            .iter()
            .map(|&p| fixed(q(itls.clone(), p), 2))
            .collect::<Vec<_>>()
            .join("/")
    };
    let (ratios, means) = balance(&in_flight(&recs));
    let tail_median = |f: &dyn Fn(&Record, f64) -> f64| {
        median(tail.iter().map(|(r, t)| f(r, *t)).collect()).unwrap_or(f64::NAN)
    };
    let means = means
        .iter()
        .map(|m| format!("{m:.1}"))
        .collect::<Vec<_>>()
        .join(", ");
    Some(format!(
        "e2e p99 {} ms; at or above it: {} requests, output tokens median {}, TTFT median {} ms, \
         mean ITL median {} ms; >={LONG_TOKENS} tokens mean ITL p50/p90/p99 {long_itl} ms; \
         in flight max/mean p50 {} p90 {}; per backend [{means}]",
        fixed(p99, 0),
        tail.len(),
        fixed(
            tail_median(&|r, _| r.completion_tokens.unwrap_or(0) as f64),
            0
        ),
        fixed(tail_median(&|_, t| t), 0),
        fixed(tail_median(&itl), 2),
        fixed(q(ratios.clone(), 0.5), 2),
        fixed(q(ratios, 0.9), 2),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::tests::rec;
    use super::*;

    #[test]
    fn in_flight_bins_and_balance() {
        // Backend 0 holds one request over 0..1000 ms; backend 1 holds two over 0..1000 ms
        // and nothing else: 11 bins (0..=1000 ms), each with 1 and 2 in flight.
        let mut records = vec![
            rec(0, 0.0, None, "0", 10.0, 0),
            rec(1, 0.0, None, "1", 10.0, 0),
            rec(2, 0.0, None, "1", 10.0, 0),
        ];
        for r in &mut records {
            r.e2e_ms = 1000.0;
        }
        // One short request on backend 0 in bin 5 only (500..550 ms).
        let mut short = rec(3, 500.0, None, "0", 10.0, 0);
        short.e2e_ms = 50.0;
        records.push(short);
        let recs: Vec<(&Record, f64)> = records.iter().map(|r| (r, 10.0)).collect();
        let by = in_flight(&recs);
        assert_eq!(
            by[&Some("0".to_string())],
            vec![1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1]
        );
        assert_eq!(by[&Some("1".to_string())], vec![2; 11]);
        // Middle 60%: bins 2..8. Max/mean is 2/1.5 except bin 5 (2/2 = 1).
        let (ratios, means) = balance(&by);
        assert_eq!(ratios.len(), 6);
        assert_eq!(ratios.iter().filter(|&&r| r == 1.0).count(), 1);
        assert!(ratios
            .iter()
            .all(|&r| r == 1.0 || (r - 4.0 / 3.0).abs() < 1e-12));
        assert_eq!(means, vec![1.2, 2.0]);
    }

    #[test]
    fn the_e2e_tail_and_its_decode_speed() {
        // Ten requests, e2e 200..=1100 ms; the slowest (1100 ms) is the p99 tail, with 301
        // output tokens: ITL (1100 - 100) / 300.
        let records: Vec<Record> = (0..10)
            .map(|i| {
                let mut r = rec(i, 0.0, None, "0", 100.0, 0);
                r.e2e_ms = 200.0 + 100.0 * i as f64;
                r.completion_tokens = Some(if i == 9 { 301 } else { 11 });
                r
            })
            .collect();
        let line = row(&RunReport {
            records,
            ..Default::default()
        })
        .unwrap();
        assert!(
            line.starts_with(
                "e2e p99 1100 ms; at or above it: 1 requests, output tokens median 301, TTFT \
                 median 100 ms, mean ITL median 3.33 ms; >=300 tokens mean ITL p50/p90/p99 \
                 3.33/3.33/3.33 ms;"
            ),
            "{line}"
        );
    }
}
