//! report.json, report.md and the charts of one run; the Markdown table is shared with
//! `compare`, which lays several runs side by side.

use std::fmt::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::charts;
use super::metrics::LoadSample;
use super::record::RequestRecord;
use super::stats::Summary;

/// Beyond this many requests report.json keeps only the summaries.
pub const MAX_RECORDS: usize = 20_000;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub label: String,
    /// The run's settings and command line, as given.
    pub config: serde_json::Value,
    pub summary: Summary,
    /// Per rate step for the ladder, labelled by rate.
    #[serde(default)]
    pub steps: Vec<(String, Summary)>,
    #[serde(default)]
    pub records: Vec<RequestRecord>,
    #[serde(default)]
    pub records_omitted: u64,
    #[serde(default)]
    pub load_samples: Vec<LoadSample>,
    /// `compare` only: how close kvroute's prompt-token estimates came to the engines' counts
    /// (see `compare::estimates`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_estimates: Option<serde_json::Value>,
}

impl Report {
    /// Reads a report.json back (`compare` builds its tables from these).
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a kvbench report: {e}", path.display()))
    }
}

const HEADER: &[&str] = &[
    "run",
    "requests",
    "errors",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "e2e p50 ms",
    "e2e p99 ms",
    "ITL p50 ms",
    "output tok/s",
    "goodput req/s",
    "met SLO",
    "cache hit",
    "oracle hit",
    "prefill share max/mean",
    "small-prompt TTFT p50/p99 ms",
];

/// One row per `(label, summary)`.
pub fn markdown_table(rows: &[(String, Summary)]) -> String {
    let mut s = format!(
        "| {} |\n|{}\n",
        HEADER.join(" | "),
        "---|".repeat(HEADER.len())
    );
    for (label, m) in rows {
        let cells = [
            label.replace('|', "/"),
            m.requests.to_string(),
            if m.timeouts > 0 {
                format!("{} ({} timeout)", m.errors, m.timeouts)
            } else {
                m.errors.to_string()
            },
            ms(m.ttft_p50_ms),
            ms(m.ttft_p90_ms),
            ms(m.ttft_p99_ms),
            ms(m.e2e_p50_ms),
            ms(m.e2e_p99_ms),
            m.itl_p50_ms.map_or("n/a".into(), |v| format!("{v:.2}")),
            format!("{:.0}", m.output_tok_s),
            format!("{:.2}", m.goodput_rps),
            format!("{:.1}%", m.slo_fraction * 100.0),
            ratio(m.cache_hit_rate),
            ratio(m.oracle_hit_rate),
            match (m.prefill_share_max, m.prefill_share_mean) {
                (Some(max), Some(mean)) => format!("{max:.3}/{mean:.3} ({:.2}x)", max / mean),
                _ => "n/a".into(),
            },
            format!("{}/{}", ms(m.small_ttft_p50_ms), ms(m.small_ttft_p99_ms)),
        ];
        let _ = writeln!(s, "| {} |", cells.join(" | "));
    }
    s
}

/// First-turn and follow-up TTFT, wall time and rounds queued while idle, for runs of a
/// multi-turn workload or with the engines polled; `None` when no run has either.
pub fn turns_table(rows: &[(String, Summary)]) -> Option<String> {
    let any = rows
        .iter()
        .any(|(_, m)| m.followup_ttft_p90_ms.is_some() || m.queued_while_idle.is_some());
    if !any {
        return None;
    }
    let mut s = "| run | first-turn TTFT p50/p90 ms | follow-up TTFT p50/p90 ms | wall s | queued while another idled (rounds) |\n|---|---|---|---|---|\n".to_owned();
    for (label, m) in rows {
        let _ = writeln!(
            s,
            "| {} | {}/{} | {}/{} | {:.1} | {} |",
            label.replace('|', "/"),
            ms(m.first_ttft_p50_ms),
            ms(m.first_ttft_p90_ms),
            ms(m.followup_ttft_p50_ms),
            ms(m.followup_ttft_p90_ms),
            m.duration_s,
            m.queued_while_idle
                .map_or("n/a".into(), |(hit, seen)| format!("{hit} of {seen}")),
        );
    }
    Some(s)
}

fn ms(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.0}"))
}

fn ratio(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.3}"))
}

/// Writes report.json, report.md, ttft_cdf.svg and, with load samples, backend_load.svg and
/// backend_kv.svg into `dir`.
pub fn write(dir: &Path, mut report: Report) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let put = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, body).map_err(|e| format!("cannot write {}: {e}", p.display()))
    };
    put("report.md", &markdown(&report))?;
    put(
        "ttft_cdf.svg",
        &charts::ttft_cdf_svg(&[(report.label.clone(), report.summary.clone())]),
    )?;
    if !report.load_samples.is_empty() {
        put(
            "backend_load.svg",
            &charts::backend_load_svg(&report.load_samples),
        )?;
        if report
            .load_samples
            .iter()
            .any(|s| s.kv_cache_usage.is_some())
        {
            put(
                "backend_kv.svg",
                &charts::backend_kv_svg(&report.load_samples),
            )?;
        }
    }
    if report.records.len() > MAX_RECORDS {
        report.records_omitted = report.records.len() as u64;
        report.records.clear();
    }
    let json =
        serde_json::to_string_pretty(&report).map_err(|e| format!("cannot encode report: {e}"))?;
    put("report.json", &json)
}

fn markdown(r: &Report) -> String {
    let mut s = format!("# kvbench replay: {}\n\n", r.label);
    let cfg = &r.config;
    let get = |k: &str| {
        cfg.get(k)
            .map(|v| v.to_string())
            .unwrap_or_else(|| "?".into())
    };
    let _ = writeln!(
        s,
        "workload {}, file {}, time scale {}, target {}, TTFT SLO {} ms\n",
        get("workload"),
        get("file"),
        get("time_scale"),
        get("target"),
        r.summary.slo_ttft_ms
    );
    if let Some(cmd) = cfg.get("command_line").and_then(|v| v.as_str()) {
        let _ = writeln!(s, "```\n{cmd}\n```\n");
    }
    let run = [(r.label.clone(), r.summary.clone())];
    s.push_str(&markdown_table(&run));
    if let Some(tenants) = super::tenant_table::markdown(&run) {
        s.push_str(&tenants);
    }
    if !r.steps.is_empty() {
        s.push_str("\n## Per rate step\n\n");
        s.push_str(&markdown_table(&r.steps));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_then_load_round_trips() {
        let dir = std::env::temp_dir().join(format!("kvbench-report-{}", std::process::id()));
        let rec = RequestRecord {
            ttft_ms: Some(5.0),
            e2e_ms: 9.0,
            ..Default::default()
        };
        let summary = super::super::stats::summarize(std::slice::from_ref(&rec), 2000.0);
        let r = Report {
            label: "x".into(),
            config: serde_json::json!({"workload": "mooncake", "command_line": "kvbench replay"}),
            summary: summary.clone(),
            steps: vec![],
            records: vec![rec],
            records_omitted: 0,
            load_samples: vec![],
            token_estimates: None,
        };
        write(&dir, r).unwrap();
        let back = Report::load(&dir.join("report.json")).unwrap();
        assert_eq!(back.summary, summary);
        assert_eq!(back.records.len(), 1);
        assert!(dir.join("ttft_cdf.svg").is_file() && !dir.join("backend_load.svg").exists());
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.contains("kvbench replay") && md.contains("| x |"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn table_has_one_row_per_run_and_na_cells() {
        let a = Summary {
            requests: 3,
            errors: 1,
            timeouts: 1,
            ttft_p50_ms: Some(12.4),
            ..Default::default()
        };
        let t = markdown_table(&[("a|b".into(), a), ("empty".into(), Summary::default())]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[0].matches('|').count(), HEADER.len() + 1);
        assert_eq!(lines[2].matches('|').count(), HEADER.len() + 1);
        assert!(lines[2].contains("| 12 |") && lines[2].contains("1 (1 timeout)"));
        assert!(lines[3].contains("n/a"));
    }
}
