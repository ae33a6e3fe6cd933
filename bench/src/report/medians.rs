//! `kvbench report medians`: per workload and policy, the median of each metric over repeated
//! runs of one command, every run's value after it. A single run's percentile that sits where
//! the workload's distribution steps lands on either side of the step from run to run; the
//! median of three is what a results page can rest on.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use super::{fixed, median, read_json};

/// Column name, summary key, decimals.
const METRICS: [(&str, &str, usize); 6] = [
    ("TTFT p50 ms", "ttft_p50_ms", 0),
    ("TTFT p90 ms", "ttft_p90_ms", 0),
    ("TTFT p99 ms", "ttft_p99_ms", 0),
    ("e2e p99 ms", "e2e_p99_ms", 0),
    ("cache hit", "cache_hit_rate", 3),
    ("goodput req/s", "goodput_rps", 2),
];

/// Per (workload, policy), each metric's value in every run that had it, in run order.
#[derive(Default)]
struct Table {
    workloads: Vec<String>,
    policies: HashMap<String, Vec<String>>,
    cells: HashMap<(String, String), [Vec<f64>; METRICS.len()]>,
}

impl Table {
    fn add(&mut self, path: &str, results: &Value) -> Result<(), String> {
        let bad = |what: &str| format!("{path}: not a compare results.json ({what})");
        let workloads = results
            .get("results")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no `results` list"))?;
        for w in workloads {
            let workload = w
                .get("workload")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("a result without `workload`"))?
                .to_string();
            if !self.workloads.contains(&workload) {
                self.workloads.push(workload.clone());
            }
            let runs = w
                .get("runs")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("a result without `runs`"))?;
            for run in runs {
                let (label, summary) = match run.as_array().map(Vec::as_slice) {
                    Some([Value::String(label), summary]) => (label.clone(), summary),
                    _ => return Err(bad("a run that is not [label, summary]")),
                };
                let policies = self.policies.entry(workload.clone()).or_default();
                if !policies.contains(&label) {
                    policies.push(label.clone());
                }
                let cell = self.cells.entry((workload.clone(), label)).or_default();
                for (values, (_, key, _)) in cell.iter_mut().zip(METRICS) {
                    // A metric a run could not measure (no requests answered) is null.
                    if let Some(v) = summary.get(key).and_then(Value::as_f64) {
                        values.push(v);
                    }
                }
            }
        }
        Ok(())
    }

    fn render(&self, runs: usize) -> String {
        let mut out = format!("Medians of {runs} runs (each run's value in brackets).\n\n");
        let names: Vec<&str> = METRICS.iter().map(|(name, _, _)| *name).collect();
        out.push_str(&format!("| workload | policy | {} |\n", names.join(" | ")));
        out.push_str(&format!("|---|---|{}\n", "---|".repeat(METRICS.len())));
        for w in &self.workloads {
            for p in self.policies.get(w).into_iter().flatten() {
                let Some(cell) = self.cells.get(&(w.clone(), p.clone())) else {
                    continue;
                };
                let cells: Vec<String> = cell
                    .iter()
                    .zip(METRICS)
                    .map(|(values, (_, _, digits))| match median(values.clone()) {
                        None => "n/a".to_string(),
                        Some(m) => {
                            let each: Vec<String> =
                                values.iter().map(|&v| fixed(v, digits)).collect();
                            format!("{} ({})", fixed(m, digits), each.join(", "))
                        }
                    })
                    .collect();
                out.push_str(&format!("| {w} | {p} | {} |\n", cells.join(" | ")));
            }
        }
        out
    }
}

pub fn report(paths: &[String]) -> Result<String, String> {
    let mut table = Table::default();
    for path in paths {
        let results: Value = read_json(Path::new(path))?;
        table.add(path, &results)?;
    }
    Ok(table.render(paths.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn results(p50: f64, hit: Option<f64>, goodput: f64) -> Value {
        json!({"results": [{"workload": "sharegpt", "runs": [
            ["kv_aware", {"ttft_p50_ms": p50, "ttft_p90_ms": 30.0, "ttft_p99_ms": 200.0,
                          "e2e_p99_ms": 4000.0, "cache_hit_rate": hit, "goodput_rps": goodput}],
        ]}]})
    }

    #[test]
    fn medians_over_three_results() {
        let mut t = Table::default();
        t.add("a", &results(15.4, Some(0.8731), 58.994)).unwrap();
        t.add("b", &results(12.0, None, 59.3)).unwrap();
        t.add("c", &results(16.6, Some(0.8751), 59.391)).unwrap();
        let out = t.render(3);
        let row = out.lines().last().unwrap();
        // p50 median of 15.4, 12.0, 16.6 is 15.4; the null hit rate is left out, so the hit
        // median is the mean of the other two; goodput's median is the middle run's.
        assert_eq!(
            row,
            "| sharegpt | kv_aware | 15 (15, 12, 17) | 30 (30, 30, 30) | 200 (200, 200, 200) \
             | 4000 (4000, 4000, 4000) | 0.874 (0.873, 0.875) | 59.30 (58.99, 59.30, 59.39) |"
        );
        assert!(
            out.starts_with("Medians of 3 runs (each run's value in brackets).\n\n| workload |")
        );
    }

    #[test]
    fn not_a_results_file_is_an_error() {
        let err = Table::default()
            .add("x.json", &json!({"summary": {}}))
            .err()
            .unwrap();
        assert!(err.contains("x.json"), "{err}");
    }
}
