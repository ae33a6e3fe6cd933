//! `kvbench report`: analyses of what `compare` wrote, mostly of the per-request records a run
//! keeps with `--keep-records` (docs/dev/kvbench.md, "`kvbench report`").
//!
//! Each analysis lives in its own file and turns one run's report.json into one line (or a
//! row); this file finds the runs, reads them and holds the statistics they share. The
//! percentiles are the nearest-rank-below ones the published tables were made with
//! (`sorted[min(n - 1, floor(q * n))]`), not the interpolated ones of `replay`'s summary, so
//! that re-running a report reproduces the figures already cited in docs/results/.

use std::path::Path;

use serde::Deserialize;

/// The per-request record `replay` writes (report.json's `records`), read back as written.
pub use crate::replay::record::RequestRecord as Record;

mod burst;
mod concurrency;
mod medians;
mod quantiles;
mod tail;
mod turns;

#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    #[command(subcommand)]
    pub command: ReportCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum ReportCommand {
    /// Per workload and policy, the median of each metric over repeated runs of one command.
    Medians {
        /// results.json of each repeat, e.g. bench/results/peers-rep-{1,2,3}/results.json.
        #[arg(required = true, value_name = "RESULTS.json")]
        results: Vec<String>,
    },
    /// TTFT at p40..p60 and p85..p95, and the big misses per session group.
    Quantiles(Runs),
    /// What the TTFT tail is made of: waiting, or misses of which kind of turn.
    Tail(Runs),
    /// Later turns that changed backend, came straight back, and whether they missed.
    Turns(Runs),
    /// How much of the TTFT tail is the opening burst of a closed-loop workload.
    Burst {
        /// Requests sent in the first this many model seconds are the opening.
        #[arg(long, value_name = "S", default_value_t = 2.0)]
        after_s: f64,
        #[command(flatten)]
        runs: Runs,
    },
    /// The e2e tail's requests and per-backend requests in flight over time.
    Concurrency(Runs),
}

#[derive(clap::Args, Debug)]
pub struct Runs {
    /// A `compare --keep-records` run's folder (bench/runs/NAME); its
    /// WORKLOAD/POLICY/report.json are read.
    #[arg(required = true, value_name = "RUN_DIR")]
    pub runs: Vec<String>,
}

pub fn run(args: ReportArgs) -> Result<(), String> {
    let out = match args.command {
        ReportCommand::Medians { results } => medians::report(&results)?,
        ReportCommand::Quantiles(r) => each_run(&r.runs, 28, quantiles::row)?,
        ReportCommand::Tail(r) => each_run(&r.runs, 46, tail::row)?,
        ReportCommand::Turns(r) => each_run(&r.runs, 42, turns::row)?,
        ReportCommand::Burst { after_s, runs } => burst::report(&runs.runs, after_s)?,
        ReportCommand::Concurrency(r) => each_run(&r.runs, 42, concurrency::row)?,
    };
    print!("{out}");
    Ok(())
}

impl Record {
    /// Prompt tokens the backend computed rather than found in its cache.
    pub fn uncached(&self) -> i64 {
        self.prompt_tokens.unwrap_or(0) as i64 - self.cached_tokens.unwrap_or(0) as i64
    }

    /// Answered, with a first token: the requests whose TTFT means something.
    pub fn answered(&self) -> Option<f64> {
        match self.error {
            None => self.ttft_ms,
            Some(_) => None,
        }
    }
}

/// One run's report.json, as far as the reports read it.
#[derive(Debug, Default, Deserialize)]
pub struct RunReport {
    #[serde(default)]
    pub summary: serde_json::Value,
    #[serde(default)]
    pub records: Vec<Record>,
}

impl RunReport {
    /// The records whose TTFT means something (see `Record::answered`).
    pub fn answered(&self) -> Vec<&Record> {
        self.records
            .iter()
            .filter(|r| r.answered().is_some())
            .collect()
    }
}

/// One run of a compare: RUN_DIR/WORKLOAD/POLICY.
pub struct Run {
    pub name: String,
    pub workload: String,
    pub policy: String,
    pub report: RunReport,
}

/// Uncached prompt tokens that make a first token slow (about 10 ms of prefill).
pub const BIG: i64 = 256;

/// Said in place of a run's line when it kept no records (a run over replay's MAX_RECORDS keeps
/// none even with --keep-records, so this is not an error while its siblings have some).
pub const NO_RECORDS: &str = "no per-request records (run compare with --keep-records)";

/// Said when records were kept but none was answered with a first token.
pub const NO_ANSWERS: &str = "no answered request with a first token";

pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text)
        .map_err(|e| format!("{}: not the JSON kvbench writes: {e}", path.display()))
}

/// Every DIR/*/*/report.json, sorted by path as the Python analysers' glob was, so rows come
/// out in the order of the tables already published.
pub fn load_runs(dir: &str) -> Result<Vec<Run>, String> {
    let mut found = Vec::new();
    for workload in visible_entries(Path::new(dir))? {
        let wpath = Path::new(dir).join(&workload);
        if !wpath.is_dir() {
            continue;
        }
        for policy in visible_entries(&wpath)? {
            if wpath.join(&policy).join("report.json").exists() {
                found.push(format!("{workload}/{policy}/report.json"));
            }
        }
    }
    if found.is_empty() {
        return Err(format!(
            "{dir}: no WORKLOAD/POLICY/report.json in it (is it the folder of a compare run?)"
        ));
    }
    found.sort();
    let name = dir_name(dir);
    let mut runs = Vec::with_capacity(found.len());
    for rel in found {
        let mut parts = rel.splitn(3, '/');
        let workload = parts.next().unwrap_or_default().to_string();
        let policy = parts.next().unwrap_or_default().to_string();
        let report = read_json(&Path::new(dir).join(&rel))?;
        runs.push(Run {
            name: name.clone(),
            workload,
            policy,
            report,
        });
    }
    if runs.iter().all(|r| r.report.records.is_empty()) {
        return Err(format!(
            "{dir}: its runs kept no per-request records; run compare with --keep-records"
        ));
    }
    Ok(runs)
}

/// Names in a folder, without the hidden ones a shell glob would skip.
fn visible_entries(dir: &Path) -> Result<Vec<String>, String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        if let Some(name) = entry.file_name().to_str() {
            if !name.starts_with('.') {
                names.push(name.to_string());
            }
        }
    }
    Ok(names)
}

/// The run's name as the tables print it: the last component of RUN_DIR as given (so `.`
/// stays `.`), ignoring one trailing slash.
fn dir_name(dir: &str) -> String {
    let dir = dir.strip_suffix('/').unwrap_or(dir);
    dir.rsplit('/').next().unwrap_or(dir).to_string()
}

/// `NAME WORKLOAD POLICY LINE` for every run under each RUN_DIR, `row` making the line.
pub fn each_run(
    dirs: &[String],
    width: usize,
    row: fn(&RunReport) -> Option<String>,
) -> Result<String, String> {
    let mut out = String::new();
    for dir in dirs {
        for run in load_runs(dir)? {
            let line = if run.report.records.is_empty() {
                NO_RECORDS.to_string()
            } else {
                row(&run.report).unwrap_or_else(|| NO_ANSWERS.to_string())
            };
            out.push_str(&format!(
                "{:<8} {:<10} {:<width$} {line}\n",
                run.name, run.workload, run.policy
            ));
        }
    }
    Ok(out)
}

/// The nearest-rank-below percentile of sorted values (see the module comment).
pub fn pick(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((q * sorted.len() as f64) as usize).min(sorted.len() - 1);
    Some(sorted[i])
}

pub fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// The middle value, or the mean of the two middle ones.
pub fn median(v: Vec<f64>) -> Option<f64> {
    let v = sorted(v);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// Fixed decimals, with NaN and infinities spelled as the published tables spell them.
pub fn fixed(x: f64, digits: usize) -> String {
    if x.is_nan() {
        "nan".to_string()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.to_string()
    } else {
        format!("{x:.digits$}")
    }
}

/// `fixed` of an optional value, `nan` when there is none.
pub fn fixed_or_nan(x: Option<f64>, digits: usize) -> String {
    fixed(x.unwrap_or(f64::NAN), digits)
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A record answered at `send_ms` by `backend` with the given TTFT and uncached tokens.
    pub fn rec(
        id: u64,
        send_ms: f64,
        session: Option<&str>,
        backend: &str,
        ttft: f64,
        uncached: u64,
    ) -> Record {
        Record {
            id,
            send_ms,
            session: session.map(str::to_string),
            status: Some(200),
            error: None,
            ttft_ms: Some(ttft),
            e2e_ms: ttft + 100.0,
            prompt_tokens: Some(uncached + 100),
            cached_tokens: Some(100),
            completion_tokens: Some(10),
            backend: Some(backend.to_string()),
            ..Default::default()
        }
    }

    #[test]
    fn pick_is_nearest_rank_below() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(pick(&v, 0.5), Some(6.0));
        assert_eq!(pick(&v, 0.9), Some(10.0));
        assert_eq!(pick(&v, 0.99), Some(10.0));
        assert_eq!(pick(&v, 0.0), Some(1.0));
        assert_eq!(pick(&[], 0.5), None);
    }

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }

    #[test]
    fn dir_name_keeps_the_last_component() {
        assert_eq!(dir_name("bench/runs/peers-rep-1/"), "peers-rep-1");
        assert_eq!(dir_name("peers-rep-1"), "peers-rep-1");
        assert_eq!(dir_name("."), ".");
    }

    #[test]
    fn a_run_without_records_is_an_error() {
        let dir = std::env::temp_dir().join(format!("kvbench-report-{}", std::process::id()));
        let run = dir.join("sharegpt").join("kv_aware");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(run.join("report.json"), r#"{"summary": {}, "records": []}"#).unwrap();
        let err = load_runs(dir.to_str().unwrap()).err().unwrap();
        assert!(err.contains("--keep-records"), "{err}");
        std::fs::write(run.join("report.json"), "{not json").unwrap();
        let err = load_runs(dir.to_str().unwrap()).err().unwrap();
        assert!(err.contains("not the JSON"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        let err = load_runs(dir.to_str().unwrap()).err().unwrap();
        assert!(err.contains("cannot read"), "{err}");
    }
}
