//! `kvbench report burst`: how much of a run's TTFT tail is its opening burst. A closed-loop
//! workload (sharegpt, multi_model) starts every conversation at once, so its first turns all
//! arrive in the first milliseconds and queue behind each other wherever they land; comparing
//! percentiles with and without the opening tells that queue apart from the router's doing.

use super::{fixed, load_runs, pick, sorted, Record, RunReport};

/// A percentile of unsorted values; NaN when there are none (a run shorter than the opening).
fn q(values: Vec<f64>, p: f64) -> f64 {
    pick(&sorted(values), p).unwrap_or(f64::NAN)
}

/// The row's cells after the run's name, workload and policy.
pub fn cells(report: &RunReport, after_ms: f64) -> Option<[String; 6]> {
    // Answered with 200 and a first token; the requests a user saw a TTFT for.
    let ok: Vec<(&Record, f64)> = report
        .records
        .iter()
        .filter(|r| r.status == Some(200))
        .filter_map(|r| r.ttft_ms.map(|t| (r, t)))
        .collect();
    if ok.is_empty() {
        return None;
    }
    let ttft: Vec<f64> = ok.iter().map(|(_, t)| *t).collect();
    let p99 = q(ttft.clone(), 0.99);
    let tail: Vec<&(&Record, f64)> = ok.iter().filter(|(_, t)| *t >= p99).collect();
    let late: Vec<&(&Record, f64)> = ok.iter().filter(|(r, _)| r.send_ms >= after_ms).collect();
    let lt: Vec<f64> = late.iter().map(|(_, t)| *t).collect();
    let three = |v: &[f64], all_p99: Option<f64>| {
        let p99 = all_p99.unwrap_or_else(|| q(v.to_vec(), 0.99));
        format!(
            "{}/{}/{}",
            fixed(q(v.to_vec(), 0.5), 0),
            fixed(q(v.to_vec(), 0.9), 0),
            fixed(p99, 0)
        )
    };
    let before = tail.iter().filter(|(r, _)| r.send_ms < after_ms).count();
    Some([
        three(&ttft, Some(p99)),
        three(&lt, None),
        format!("{before} of {}", tail.len()),
        fixed(q(ok.iter().map(|(r, _)| r.e2e_ms).collect(), 0.99), 0),
        fixed(q(late.iter().map(|(r, _)| r.e2e_ms).collect(), 0.99), 0),
        (ok.len() - late.len()).to_string(),
    ])
}

pub fn report(dirs: &[String], after_s: f64) -> Result<String, String> {
    if !after_s.is_finite() || after_s < 0.0 {
        return Err(format!(
            "--after-s {after_s}: give a number of seconds, 0 or more"
        ));
    }
    let mut out = format!(
        "| run | workload | policy | TTFT p50/p90/p99 ms, all | sent after {} s \
         | p99 tail sent before | e2e p99, all | after | requests before |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        general(after_s)
    );
    for dir in dirs {
        for run in load_runs(dir)? {
            let line = if run.report.records.is_empty() {
                // Shorter than the other reports' line: it sits in a Markdown table cell.
                "no per-request records (--keep-records)".to_string()
            } else {
                match cells(&run.report, after_s * 1000.0) {
                    Some(c) => c.join(" | "),
                    None => "no request answered with 200 and a first token".to_string(),
                }
            };
            out.push_str(&format!(
                "| {} | {} | {} | {line} |\n",
                run.name, run.workload, run.policy
            ));
        }
    }
    Ok(out)
}

/// Six significant digits without trailing zeros (C's `%g`), so `--after-s 2` prints `2`.
fn general(x: f64) -> String {
    if x == 0.0 {
        return "0".to_string();
    }
    let exp = x.abs().log10().floor() as i32;
    if !(-4..6).contains(&exp) {
        let s = format!("{x:.5e}");
        let (mantissa, e) = s.split_once('e').unwrap_or((&s, "0"));
        let mantissa = trim_zeros(mantissa);
        let e: i32 = e.parse().unwrap_or(0);
        let sign = if e < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", e.abs());
    }
    let decimals = (5 - exp).max(0) as usize;
    trim_zeros(&format!("{x:.decimals$}")).to_string()
}

fn trim_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::rec;
    use super::*;

    #[test]
    fn the_opening_is_split_at_after_s() {
        // Four requests in the first second, slow; six after it, fast.
        let mut records: Vec<Record> = (0..10)
            .map(|i| {
                let (send, ttft) = if i < 4 {
                    (i as f64 * 100.0, 1000.0 + i as f64)
                } else {
                    (1000.0 + i as f64, 10.0 + i as f64)
                };
                rec(i, send, None, "0", ttft, 0)
            })
            .collect();
        // One failed request: not counted anywhere.
        records[9].status = Some(500);
        let report = RunReport {
            records,
            ..Default::default()
        };
        let c = cells(&report, 1000.0).unwrap();
        // All nine: 14..18 then 1000..1003, so p50 is 18; after the opening only 14..18.
        assert_eq!(c[0], "18/1003/1003");
        assert_eq!(c[1], "16/18/18");
        assert_eq!(c[2], "1 of 1");
        assert_eq!(c[3], "1103");
        assert_eq!(c[4], "118");
        assert_eq!(c[5], "4");
        // With the opening at 0 s every request is after it.
        let c = cells(&report, 0.0).unwrap();
        assert_eq!(c[1], c[0]);
        assert_eq!(c[2], "0 of 1");
        assert_eq!(c[5], "0");
    }

    #[test]
    fn after_s_prints_like_percent_g() {
        assert_eq!(general(2.0), "2");
        assert_eq!(general(0.5), "0.5");
        assert_eq!(general(2.25), "2.25");
        assert_eq!(general(1234567.0), "1.23457e+06");
        assert_eq!(general(0.00001), "1e-05");
    }
}
