//! `kvbench promote NAME`: copy the summary of a `compare` run from the git-ignored runs folder
//! into the committed results, and nothing else. A run folder holds logs, metric scrapes,
//! per-request records and a chart per policy; a results folder holds what a docs page cites:
//! the README (its command with repository-relative paths), `results.json` without records,
//! each policy's kvroute config and the charts the README embeds.

use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug, Clone)]
pub struct PromoteArgs {
    /// The run's folder name under --from.
    pub name: String,
    #[arg(long, default_value = "bench/runs")]
    pub from: PathBuf,
    #[arg(long, default_value = "bench/results")]
    pub to: PathBuf,
    /// Replace a results folder of the same name.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: PromoteArgs) -> Result<(), String> {
    let cwd = std::env::current_dir().map_err(|e| format!("cannot read the working dir: {e}"))?;
    let files = promote(&args.from, &args.to, &args.name, args.force, &cwd)?;
    for f in &files {
        eprintln!("promote: {}", f.display());
    }
    eprintln!(
        "promote: {} files in {}; a docs/results page must cite it by that path",
        files.len(),
        args.to.join(&args.name).display(),
    );
    Ok(())
}

/// Copies run `name` from `from` to `to`; `root` is the checkout, whose absolute paths (and a
/// build's target dir) are made relative. Returns the files written.
pub fn promote(
    from: &Path,
    to: &Path,
    name: &str,
    force: bool,
    root: &Path,
) -> Result<Vec<PathBuf>, String> {
    let src = from.join(name);
    let dst = to.join(name);
    let readme = read(&src.join("README.md"))?;
    let results = read(&src.join("results.json"))?;
    if dst.exists() {
        if !force {
            return Err(format!(
                "{} exists; pass --force to replace it",
                dst.display()
            ));
        }
        std::fs::remove_dir_all(&dst).map_err(|e| format!("{}: {e}", dst.display()))?;
    }
    let rel = Relativize::new(root, from, to);
    let mut written = Vec::new();
    let mut put = |path: PathBuf, text: &str| -> Result<(), String> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        written.push(path);
        Ok(())
    };
    put(dst.join("README.md"), &rel.apply(&readme))?;
    let mut json: serde_json::Value = serde_json::from_str(&results)
        .map_err(|e| format!("{}: not JSON: {e}", src.join("results.json").display()))?;
    empty_records(&mut json);
    let json = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
    put(dst.join("results.json"), &rel.apply(&json))?;
    for (policy, yaml) in configs(&src)? {
        put(
            dst.join("config").join(format!("{policy}.yaml")),
            &rel.apply(&yaml),
        )?;
    }
    for chart in embedded_charts(&readme) {
        let text = read(&src.join(&chart))?;
        put(dst.join(&chart), &text)?;
    }
    Ok(written)
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Per-request records stay in the run folder: they are what makes a run large.
fn empty_records(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                if k == "records" {
                    *v = serde_json::Value::Array(Vec::new());
                } else {
                    empty_records(v);
                }
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(empty_records),
        _ => {}
    }
}

/// Each policy's kvroute config from the first workload that ran it (the configs differ across
/// workloads only in ports and paths).
fn configs(src: &Path) -> Result<Vec<(String, String)>, String> {
    let mut found: Vec<(String, String)> = Vec::new();
    let mut workloads: Vec<PathBuf> = dirs(src)?;
    workloads.sort();
    for workload in workloads {
        let mut policies = dirs(&workload)?;
        policies.sort();
        for policy in policies {
            let yaml = policy.join("kvroute.yaml");
            let Some(name) = policy.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if yaml.is_file() && !found.iter().any(|(p, _)| p == name) {
                found.push((name.to_string(), read(&yaml)?));
            }
        }
    }
    Ok(found)
}

fn dirs(path: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect())
}

/// Relative `.svg` targets of the README's image links, `![alt](dir/chart.svg)`.
fn embedded_charts(readme: &str) -> Vec<PathBuf> {
    let mut charts: Vec<PathBuf> = Vec::new();
    for part in readme.split("](").skip(1) {
        let Some(target) = part.split(')').next() else {
            continue;
        };
        let path = PathBuf::from(target);
        let relative = path.is_relative() && !target.contains("..") && !target.contains("://");
        if relative && target.ends_with(".svg") && !charts.contains(&path) {
            charts.push(path);
        }
    }
    charts
}

/// Rewrites what names one machine: the checkout's absolute path, a build's target dir (the
/// binary is `target/release/kvbench` wherever it was built) and the runs folder itself.
struct Relativize {
    root: String,
    from: String,
    to: String,
}

impl Relativize {
    fn new(root: &Path, from: &Path, to: &Path) -> Self {
        let rel = |p: &Path| {
            p.strip_prefix(root)
                .unwrap_or(p)
                .to_string_lossy()
                .trim_end_matches('/')
                .to_string()
        };
        Relativize {
            root: format!("{}/", root.to_string_lossy().trim_end_matches('/')),
            from: format!("{}/", rel(from)),
            to: format!("{}/", rel(to)),
        }
    }

    fn apply(&self, text: &str) -> String {
        let text = text.replace(&self.root, "").replace(&self.from, &self.to);
        let mut out = String::with_capacity(text.len());
        for (i, line) in text.split('\n').enumerate() {
            if i > 0 {
                out.push('\n');
            }
            out.push_str(&Self::binary(line));
        }
        out
    }

    /// `/srv/build/release/kvbench` (a `CARGO_TARGET_DIR`) -> `target/release/kvbench`.
    fn binary(line: &str) -> String {
        let mut out = Vec::new();
        for word in line.split(' ') {
            let quote = word.starts_with('`');
            let bare = word.trim_start_matches('`');
            let rewritten = ["release", "debug"].iter().find_map(|profile| {
                let tail = format!("/{profile}/kvbench");
                (bare.starts_with('/') && bare.ends_with(&tail))
                    .then(|| format!("{}target{tail}", if quote { "`" } else { "" }))
            });
            out.push(rewritten.unwrap_or_else(|| word.to_string()));
        }
        out.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder per test (no tempfile dependency for three tests).
    fn scratch(test: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("kvbench-promote-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// A run folder as `compare` leaves it, under a fake checkout.
    fn fixture(root: &Path) {
        let run = root.join("bench/runs/r1");
        write(
            &run.join("README.md"),
            "# r1\n\nCommand: `/srv/tgt/release/kvbench compare --name r1 \
             --sharegpt-file ROOT/bench/data/x.jsonl`\n\n![TTFT CDF](sharegpt/ttft_cdf.svg)\n"
                .replace("ROOT", &root.to_string_lossy())
                .as_str(),
        );
        write(
            &run.join("results.json"),
            r#"{"command_line":"x","results":[{"runs":[{"records":[{"ttft":1}],"n":1}]}]}"#,
        );
        write(&run.join("sharegpt/ttft_cdf.svg"), "<svg/>");
        for workload in ["sharegpt", "mooncake"] {
            for policy in ["kv_aware", "round_robin"] {
                let dir = run.join(workload).join(policy);
                write(
                    &dir.join("kvroute.yaml"),
                    &format!("pid_file: bench/runs/r1/{workload}/{policy}/kvroute.pid\n"),
                );
                write(&dir.join("kvroute.log"), "log");
                write(&dir.join("report.json"), "{}");
                write(&dir.join("ttft_cdf.svg"), "<svg/>");
            }
        }
    }

    #[test]
    fn promotes_only_the_summary_with_relative_paths() {
        let root = &scratch("summary");
        fixture(root);
        let (from, to) = (root.join("bench/runs"), root.join("bench/out"));
        let files = promote(&from, &to, "r1", false, root).unwrap();
        let mut names: Vec<String> = files
            .iter()
            .map(|f| f.strip_prefix(to.join("r1")).unwrap().display().to_string())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "README.md",
                "config/kv_aware.yaml",
                "config/round_robin.yaml",
                "results.json",
                "sharegpt/ttft_cdf.svg"
            ]
        );
        let readme = std::fs::read_to_string(to.join("r1/README.md")).unwrap();
        assert!(
            readme.contains(
                "`target/release/kvbench compare --name r1 --sharegpt-file bench/data/x.jsonl`"
            ),
            "{readme}"
        );
        let json = std::fs::read_to_string(to.join("r1/results.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(
            json["results"][0]["runs"][0]["records"],
            serde_json::json!([])
        );
        assert_eq!(json["results"][0]["runs"][0]["n"], 1);
        let yaml = std::fs::read_to_string(to.join("r1/config/kv_aware.yaml")).unwrap();
        // The first workload in name order, with the committed folder's path.
        assert_eq!(
            yaml,
            "pid_file: bench/out/r1/mooncake/kv_aware/kvroute.pid\n"
        );
    }

    #[test]
    fn refuses_to_overwrite_without_force() {
        let root = &scratch("force");
        fixture(root);
        let (from, to) = (root.join("bench/runs"), root.join("bench/out"));
        promote(&from, &to, "r1", false, root).unwrap();
        write(&to.join("r1/stale.txt"), "old");
        let err = promote(&from, &to, "r1", false, root).unwrap_err();
        assert!(err.contains("--force"), "{err}");
        assert!(to.join("r1/stale.txt").exists());
        promote(&from, &to, "r1", true, root).unwrap();
        assert!(!to.join("r1/stale.txt").exists());
    }

    #[test]
    fn a_missing_run_is_a_clear_error() {
        let root = &scratch("missing");
        let err = promote(root, root, "nope", false, root).unwrap_err();
        assert!(err.contains("nope/README.md"), "{err}");
    }
}
