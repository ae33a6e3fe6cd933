//! `kvbench report medians`: per workload and policy, the median of each metric over repeated
//! runs of one command, every run's value after it. A single run's percentile that sits where
//! the workload's distribution steps lands on either side of the step from run to run; the
//! median of three is what a results page can rest on.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use super::{fixed, median, read_json};

/// Column name, summary key (`key.N`: element N of an array), decimals.
type Metric = (&'static str, &'static str, usize);

const METRICS: [Metric; 6] = [
    ("TTFT p50 ms", "ttft_p50_ms", 0),
    ("TTFT p90 ms", "ttft_p90_ms", 0),
    ("TTFT p99 ms", "ttft_p99_ms", 0),
    ("e2e p99 ms", "e2e_p99_ms", 0),
    ("cache hit", "cache_hit_rate", 3),
    ("goodput req/s", "goodput_rps", 2),
];

/// Multi-turn workloads and polled engines: first turns and follow-ups apart, the run's wall
/// time and the polling rounds with a request queued while another engine idled.
const TURNS: [Metric; 5] = [
    ("first-turn TTFT p90 ms", "first_ttft_p90_ms", 0),
    ("follow-up TTFT p50 ms", "followup_ttft_p50_ms", 0),
    ("follow-up TTFT p90 ms", "followup_ttft_p90_ms", 0),
    ("wall s", "duration_s", 1),
    (
        "rounds queued while another idled",
        "queued_while_idle.0",
        0,
    ),
];

/// A summary's value for `key` (`key.N`: element N of the array at `key`).
fn value(summary: &Value, key: &str) -> Option<f64> {
    match key.split_once('.') {
        Some((key, i)) => summary.get(key)?.get(i.parse::<usize>().ok()?)?.as_f64(),
        None => summary.get(key)?.as_f64(),
    }
}

/// Per (workload, policy), each metric's value in every run that had it, in run order.
struct Table {
    metrics: &'static [Metric],
    workloads: Vec<String>,
    policies: HashMap<String, Vec<String>>,
    cells: HashMap<(String, String), Vec<Vec<f64>>>,
}

impl Default for Table {
    fn default() -> Table {
        Table::new(&METRICS)
    }
}

impl Table {
    fn new(metrics: &'static [Metric]) -> Table {
        Table {
            metrics,
            workloads: Vec::new(),
            policies: HashMap::new(),
            cells: HashMap::new(),
        }
    }

    /// Whether any run had any of the metrics besides its wall time (which every run has).
    fn any(&self) -> bool {
        self.cells.values().any(|cell| {
            cell.iter()
                .zip(self.metrics)
                .any(|(v, (_, key, _))| *key != "duration_s" && !v.is_empty())
        })
    }

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
                let n = self.metrics.len();
                let cell = self
                    .cells
                    .entry((workload.clone(), label))
                    .or_insert_with(|| vec![Vec::new(); n]);
                for (values, (_, key, _)) in cell.iter_mut().zip(self.metrics) {
                    // A metric a run could not measure (no requests answered) is null.
                    if let Some(v) = value(summary, key) {
                        values.push(v);
                    }
                }
            }
        }
        Ok(())
    }

    fn render(&self, runs: usize) -> String {
        let mut out = format!("Medians of {runs} runs (each run's value in brackets).\n\n");
        let names: Vec<&str> = self.metrics.iter().map(|(name, _, _)| *name).collect();
        out.push_str(&format!("| workload | policy | {} |\n", names.join(" | ")));
        out.push_str(&format!("|---|---|{}\n", "---|".repeat(self.metrics.len())));
        for w in &self.workloads {
            for p in self.policies.get(w).into_iter().flatten() {
                let Some(cell) = self.cells.get(&(w.clone(), p.clone())) else {
                    continue;
                };
                let cells: Vec<String> = cell
                    .iter()
                    .zip(self.metrics)
                    .map(|(values, &(_, _, digits))| match median(values.clone()) {
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
    let (mut table, mut turns) = (Table::default(), Table::new(&TURNS));
    for path in paths {
        let results: Value = read_json(Path::new(path))?;
        table.add(path, &results)?;
        turns.add(path, &results)?;
    }
    let mut out = table.render(paths.len());
    if turns.any() {
        out.push('\n');
        out.push_str(&turns.render(paths.len()));
    }
    Ok(out)
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
    fn turns_and_queued_rounds_get_a_table_of_their_own() {
        let run = |f: f64, q: u64| {
            json!({"results": [{"workload": "documents", "runs": [
                ["kv_aware", {"ttft_p90_ms": 3000.0, "first_ttft_p90_ms": 3400.0,
                              "followup_ttft_p50_ms": 150.0, "followup_ttft_p90_ms": f,
                              "duration_s": 60.0, "queued_while_idle": [q, 100]}],
            ]}]})
        };
        let mut t = Table::new(&TURNS);
        for (f, q) in [(160.0, 0), (300.0, 2), (170.0, 1)] {
            t.add("r", &run(f, q)).unwrap();
        }
        assert!(t.any());
        let row = t.render(3).lines().last().unwrap().to_owned();
        assert_eq!(
            row,
            "| documents | kv_aware | 3400 (3400, 3400, 3400) | 150 (150, 150, 150) \
             | 170 (160, 300, 170) | 60.0 (60.0, 60.0, 60.0) | 1 (0, 2, 1) |"
        );
        // Runs of a workload without turns: no table.
        let mut plain = Table::new(&TURNS);
        plain.add("r", &results(15.4, None, 59.0)).unwrap();
        assert!(!plain.any());
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
