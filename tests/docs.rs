//! The documentation stays true to the code and the committed results:
//! - the configuration reference (`docs/guide/configuration.md`) has exactly one row per config
//!   key, the keys derived from the code itself (serde's own field lists, probed through
//!   [`Config::from_yaml`]), not from a list kept by hand;
//! - the metrics reference (`docs/guide/metrics.md`) has exactly one row per `kvroute_*` family
//!   the code registers, and every metric name any page mentions is one of them;
//! - every run folder under `bench/results/` is cited by a page, every cited run exists, and the
//!   folder holds summaries only (small files, no machine paths);
//! - pages stay short and their relative links resolve.
//!
//! Each check is a function returning the problems it found, so the tests below can also show
//! it failing on a broken input.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use kvroute::config::Config;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Files git tracks or would track (untracked but not ignored), relative to the repository.
fn repo_files() -> Vec<String> {
    let out = std::process::Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(repo())
        .output()
        .expect("git ls-files (the docs checks need git)");
    assert!(out.status.success(), "git ls-files failed");
    String::from_utf8_lossy(&out.stdout)
        .split('\0')
        .filter(|p| !p.is_empty() && repo().join(p).is_file())
        .map(str::to_string)
        .collect()
}

/// The Markdown pages: the README and everything under `docs/`.
fn pages(files: &[String]) -> Vec<String> {
    files
        .iter()
        .filter(|f| f.as_str() == "README.md" || (f.starts_with("docs/") && f.ends_with(".md")))
        .cloned()
        .collect()
}

/// First cells of table rows that start with a backticked name: `| \`name\` | ... |`.
fn row_names(markdown: &str) -> Vec<String> {
    markdown
        .lines()
        .filter_map(|l| {
            let cell = l.trim().strip_prefix('|')?.split('|').next()?.trim();
            let name = cell.strip_prefix('`')?.strip_suffix('`')?;
            Some(name.to_string())
        })
        .collect()
}

// ---- configuration keys ---------------------------------------------------------------------

#[derive(Clone)]
enum Seg {
    Field(String),
    Seq,
}

fn key_of(path: &[Seg]) -> String {
    let mut key = String::from("kvroute");
    for s in path {
        match s {
            Seg::Field(f) => {
                key.push('.');
                key.push_str(f);
            }
            Seg::Seq => key.push_str("[]"),
        }
    }
    key
}

/// The fields of the struct at `path`, or None if what sits there is not a struct. Every config
/// struct denies unknown fields, and serde's error for one lists the fields it expected.
fn struct_fields(path: &[Seg]) -> Option<Vec<String>> {
    const PROBE: &str = "__probe__";
    let mut value = serde_yaml::Value::Mapping(
        [(PROBE.into(), serde_yaml::Value::from(1))]
            .into_iter()
            .collect(),
    );
    for seg in path.iter().rev() {
        value = match seg {
            Seg::Field(f) => {
                serde_yaml::Value::Mapping([(f.as_str().into(), value)].into_iter().collect())
            }
            Seg::Seq => serde_yaml::Value::Sequence(vec![value]),
        };
    }
    let root: serde_yaml::Value =
        serde_yaml::Value::Mapping([("kvroute".into(), value)].into_iter().collect());
    let text = serde_yaml::to_string(&root).expect("probe yaml");
    let err = Config::from_yaml(&text).err()?;
    let reason = err.reason;
    if !reason.contains(&format!("unknown field `{PROBE}`")) {
        return None;
    }
    let expected = reason.split_once("expected").map_or("", |(_, e)| e);
    Some(
        expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect(),
    )
}

/// Every leaf key of the `kvroute:` section, as the configuration reference writes it.
fn config_keys() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut stack: Vec<Vec<Seg>> = vec![vec![]];
    while let Some(path) = stack.pop() {
        let fields = struct_fields(&path).unwrap_or_else(|| {
            panic!(
                "{} is not a struct that denies unknown fields",
                key_of(&path)
            )
        });
        assert!(!fields.is_empty(), "no fields found at {}", key_of(&path));
        for f in fields {
            let mut child = path.clone();
            child.push(Seg::Field(f));
            if struct_fields(&child).is_some() {
                stack.push(child);
                continue;
            }
            let mut item = child.clone();
            item.push(Seg::Seq);
            if struct_fields(&item).is_some() {
                stack.push(item);
            } else {
                keys.insert(key_of(&child));
            }
        }
    }
    keys
}

/// Problems with a reference page against the code's keys: a key with no row or several, a
/// `kvroute.` row naming no key.
fn config_reference_problems(reference: &str, keys: &BTreeSet<String>) -> Vec<String> {
    one_row_each(
        reference,
        "kvroute.",
        keys,
        RowWords {
            missing: "no row in the configuration reference",
            several: "rows in the configuration reference",
            unknown: "a row for a key the code does not have",
        },
    )
}

/// How a reference page's problems read, for `one_row_each`.
struct RowWords {
    missing: &'static str,
    several: &'static str,
    unknown: &'static str,
}

/// A reference page against the names the code has: every name exactly one row, every row (of a
/// name starting with `prefix`) a name.
fn one_row_each(
    reference: &str,
    prefix: &str,
    names: &BTreeSet<String>,
    words: RowWords,
) -> Vec<String> {
    let mut rows: BTreeMap<String, usize> = BTreeMap::new();
    for name in row_names(reference) {
        if name.starts_with(prefix) {
            *rows.entry(name).or_default() += 1;
        }
    }
    let mut problems = Vec::new();
    for k in names {
        match rows.get(k) {
            None => problems.push(format!("{k}: {}", words.missing)),
            Some(1) => {}
            Some(n) => problems.push(format!("{k}: {n} {}", words.several)),
        }
    }
    for r in rows.keys().filter(|r| !names.contains(*r)) {
        problems.push(format!("{r}: {}", words.unknown));
    }
    problems
}

#[test]
fn the_configuration_reference_has_one_row_per_key_of_the_code() {
    let keys = config_keys();
    // The walk reaches the nested sections, not just the top.
    for k in [
        "kvroute.listen",
        "kvroute.backends[].kv_events.topic",
        "kvroute.access.keys[].sha256",
        "kvroute.routing.epsilon",
    ] {
        assert!(keys.contains(k), "{k} not derived: {keys:?}");
    }
    let problems = config_reference_problems(&read("docs/guide/configuration.md"), &keys);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_configuration_check_fails_on_a_missing_a_doubled_and_an_unknown_row() {
    let keys: BTreeSet<String> = ["kvroute.a", "kvroute.b", "kvroute.c"]
        .map(String::from)
        .into();
    let page = "| key | default | meaning |\n|---|---|---|\n| `kvroute.a` | 1 | x |\n\
                | `kvroute.b` | 1 | y |\n| `kvroute.b` | 2 | again |\n| `kvroute.z` | | gone |\n\
                | `threads` | | Pingora's, not checked |\n";
    let problems = config_reference_problems(page, &keys);
    assert_eq!(
        problems,
        [
            "kvroute.b: 2 rows in the configuration reference",
            "kvroute.c: no row in the configuration reference",
            "kvroute.z: a row for a key the code does not have",
        ]
    );
}

// ---- metrics --------------------------------------------------------------------------------

/// Every `kvroute_*` token in `text` (a trailing `_` marks a prefix such as `kvroute_backend_*`).
fn metric_tokens(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kvroute_") {
        let before = text.len() - rest.len() + at;
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        // Part of a longer word (`libkvroute_x`) or a path (`/tmp/kvroute_upgrade.sock`) is not
        // a metric name.
        let glued = text[..before]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '/' | '.' | '-'));
        if !glued {
            out.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// The families the code registers: every `"kvroute_..."` string literal under `src/`.
fn registered_families(files: &[String]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for f in files
        .iter()
        .filter(|f| f.starts_with("src/") && f.ends_with(".rs"))
    {
        let text = read(f);
        let mut rest = text.as_str();
        while let Some(at) = rest.find("\"kvroute_") {
            let tail = &rest[at + 1..];
            let end = tail.find('"').unwrap_or(tail.len());
            out.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    out
}

fn names_a_family(token: &str, families: &BTreeSet<String>) -> bool {
    if token.ends_with('_') {
        return families.iter().any(|f| f.starts_with(token));
    }
    families.contains(token)
        || ["_bucket", "_sum", "_count"]
            .iter()
            .any(|s| token.strip_suffix(s).is_some_and(|f| families.contains(f)))
}

/// Problems with the metrics page and the other pages against the registered families.
fn metrics_problems(
    reference: &str,
    other_pages: &[(String, String)],
    families: &BTreeSet<String>,
) -> Vec<String> {
    let mut problems = one_row_each(
        reference,
        "kvroute_",
        families,
        RowWords {
            missing: "registered but not in the metrics reference",
            several: "rows in the metrics reference",
            unknown: "in the metrics reference but not registered",
        },
    );
    for (page, text) in other_pages {
        for t in metric_tokens(text) {
            if !names_a_family(&t, families) {
                problems.push(format!("{page}: names {t}, which kvroute does not export"));
            }
        }
    }
    problems
}

#[test]
fn every_family_is_documented_once_and_every_named_metric_is_exported() {
    let files = repo_files();
    let families = registered_families(&files);
    assert!(
        families.len() >= 40,
        "only {} families found",
        families.len()
    );
    let mut others: Vec<(String, String)> = pages(&files)
        .into_iter()
        .map(|p| {
            let text = read(&p);
            (p, text)
        })
        .collect();
    for f in files.iter().filter(|f| f.starts_with("conf/")) {
        others.push((f.clone(), read(f)));
    }
    let problems = metrics_problems(&read("docs/guide/metrics.md"), &others, &families);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_metrics_check_fails_on_an_undocumented_family_and_an_unknown_name() {
    let families: BTreeSet<String> = ["kvroute_requests_total", "kvroute_queue_wait_seconds"]
        .map(String::from)
        .into();
    let reference = "| `kvroute_requests_total` | counter | status | requests |\n";
    let others = [(
        "docs/guide/x.md".to_string(),
        "Watch `kvroute_queue_wait_seconds_bucket`, `kvroute_queue_*` and kvroute_made_up_total; \
         KVROUTE_TEST_PYTHON is an environment variable, /tmp/kvroute_upgrade.sock a socket."
            .to_string(),
    )];
    assert_eq!(
        metrics_problems(reference, &others, &families),
        [
            "kvroute_queue_wait_seconds: registered but not in the metrics reference",
            "docs/guide/x.md: names kvroute_made_up_total, which kvroute does not export",
        ]
    );
}

/// This checker: its fixtures hold the very names and paths it looks for.
const THIS_FILE: &str = "tests/docs.rs";

// ---- committed results ----------------------------------------------------------------------

/// Run folders named in `text` as `bench/results/NAME` (`NAME-{1,2}` expands; `<run>`, an
/// upper-case `NAME` and other placeholders are not names).
fn cited_runs(text: &str) -> BTreeSet<String> {
    const NEEDLE: &str = "bench/results/";
    let is_name = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find(NEEDLE) {
        rest = &rest[at + NEEDLE.len()..];
        let end = rest.find(|c: char| !is_name(c)).unwrap_or(rest.len());
        let stem = rest[..end].trim_end_matches('.');
        let after = &rest[end..];
        if let Some(alts) = after
            .strip_prefix('{')
            .and_then(|a| a.split_once('}'))
            .map(|(alts, _)| alts)
        {
            out.extend(alts.split(',').map(|a| format!("{stem}{}", a.trim())));
        } else if !stem.is_empty()
            && !after.starts_with('*')
            && stem.chars().any(|c| !c.is_ascii_uppercase())
        {
            out.insert(stem.to_string());
        }
        rest = after;
    }
    out
}

fn result_runs() -> BTreeSet<String> {
    std::fs::read_dir(repo().join("bench/results"))
        .expect("bench/results")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Problems between the run folders there are and the ones cited: by the pages (every folder
/// must be cited there) and by any text file (every citation must exist).
fn citation_problems(
    runs: &BTreeSet<String>,
    page_citations: &BTreeSet<String>,
    all_citations: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    for r in runs.difference(page_citations) {
        problems.push(format!("bench/results/{r}: no page in docs/ cites it"));
    }
    for (file, cited) in all_citations {
        for c in cited.difference(runs) {
            problems.push(format!(
                "{file}: cites bench/results/{c}, which does not exist"
            ));
        }
    }
    problems
}

#[test]
fn every_result_run_is_cited_and_every_cited_run_exists() {
    let files = repo_files();
    let mut page_citations = BTreeSet::new();
    for p in pages(&files) {
        page_citations.extend(cited_runs(&read(&p)));
    }
    let mut all = BTreeMap::new();
    // This file's own fixtures name runs that are not there on purpose.
    let checked = |f: &&String| !f.starts_with("bench/results/") && f.as_str() != THIS_FILE;
    for f in files.iter().filter(checked) {
        if let Ok(text) = std::fs::read_to_string(repo().join(f)) {
            let cited = cited_runs(&text);
            if !cited.is_empty() {
                all.insert(f.clone(), cited);
            }
        }
    }
    let problems = citation_problems(&result_runs(), &page_citations, &all);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_results_check_fails_on_an_uncited_run_and_a_missing_one() {
    let text = "From `bench/results/peers-rep-{1,2}` and bench/results/tls/README.md; \
                results go to `bench/results/<run>/` (`kvbench promote` makes bench/results/NAME).";
    let cited = cited_runs(text);
    assert_eq!(
        cited,
        ["peers-rep-1", "peers-rep-2", "tls"]
            .map(String::from)
            .into()
    );
    let runs: BTreeSet<String> = ["peers-rep-1", "tls", "soak"].map(String::from).into();
    let all = [("docs/results/peers.md".to_string(), cited.clone())].into();
    assert_eq!(
        citation_problems(&runs, &cited, &all),
        [
            "bench/results/soak: no page in docs/ cites it",
            "docs/results/peers.md: cites bench/results/peers-rep-2, which does not exist",
        ]
    );
}

#[test]
fn committed_results_are_summaries() {
    const MAX_FILE: u64 = 256 * 1024;
    const MAX_TOTAL: u64 = 10 * 1000 * 1000;
    const MAX_FILES: usize = 500;
    let files: Vec<String> = repo_files()
        .into_iter()
        .filter(|f| f.starts_with("bench/results/"))
        .collect();
    let mut total = 0;
    let mut big = Vec::new();
    for f in &files {
        let len = std::fs::metadata(repo().join(f)).map_or(0, |m| m.len());
        total += len;
        if len > MAX_FILE {
            big.push(format!("{f}: {len} bytes"));
        }
    }
    assert!(
        big.is_empty(),
        "files over {MAX_FILE} bytes:\n{}",
        big.join("\n")
    );
    assert!(total <= MAX_TOTAL, "bench/results holds {total} bytes");
    assert!(
        files.len() <= MAX_FILES,
        "bench/results holds {} files",
        files.len()
    );
}

// ---- machine paths, page sizes, links -------------------------------------------------------

/// Absolute paths of one machine (a build's target dir, a checkout, a home): they mean nothing
/// on another. `.ci/run` names CI's own target dir, which it chooses.
fn machine_paths(file: &str, text: &str) -> Vec<String> {
    const PREFIXES: &[&str] = &["/var/tmp/", "/work/", "/root/", "/home/"];
    if file == ".ci/run" || file == THIS_FILE {
        return Vec::new();
    }
    text.lines()
        .enumerate()
        .filter(|(_, l)| PREFIXES.iter().any(|p| l.contains(p)))
        .map(|(i, l)| format!("{file}:{}: {}", i + 1, l.trim()))
        .collect()
}

#[test]
fn no_tracked_text_names_a_machine_path() {
    let mut found = Vec::new();
    for f in repo_files() {
        if let Ok(text) = std::fs::read_to_string(repo().join(&f)) {
            found.extend(machine_paths(&f, &text));
        }
    }
    assert!(found.is_empty(), "machine paths:\n{}", found.join("\n"));
    assert_eq!(
        machine_paths(
            "bench/results/x/README.md",
            "Command: `/var/tmp/t/release/kvbench compare`"
        )
        .len(),
        1
    );
}

#[test]
fn pages_are_short_enough_to_read_in_one_sitting() {
    let mut long = Vec::new();
    for p in pages(&repo_files()) {
        let lines = read(&p).lines().count();
        let max = if p == "README.md" { 200 } else { 500 };
        if lines > max {
            long.push(format!("{p}: {lines} lines (at most {max})"));
        }
    }
    assert!(long.is_empty(), "{}", long.join("\n"));
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for l in markdown.lines() {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && l.starts_with('#') {
            out.insert(anchor(l.trim_start_matches('#')));
        }
    }
    out
}

/// Relative link targets in a page: `](target)`, outside code fences.
fn links(markdown: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for l in markdown.lines() {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = l;
        while let Some(at) = rest.find("](") {
            let tail = &rest[at + 2..];
            let end = tail.find(')').unwrap_or(tail.len());
            let target = tail[..end].split_whitespace().next().unwrap_or("");
            if !target.contains("://") && !target.starts_with("mailto:") && !target.is_empty() {
                out.push(target.to_string());
            }
            rest = &tail[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_in_the_pages_resolves() {
    let mut broken = Vec::new();
    for p in pages(&repo_files()) {
        let text = read(&p);
        let dir = Path::new(&p).parent().unwrap_or(Path::new(""));
        for target in links(&text) {
            let (file, frag) = target.split_once('#').unwrap_or((&target, ""));
            let path: PathBuf = if file.is_empty() {
                PathBuf::from(&p)
            } else {
                dir.join(file)
            };
            let full = repo().join(&path);
            if !full.exists() {
                broken.push(format!("{p}: {target}: no such file"));
                continue;
            }
            if !frag.is_empty() && full.extension().is_some_and(|e| e == "md") {
                let page = std::fs::read_to_string(&full).unwrap_or_default();
                if !anchors(&page).contains(frag) {
                    broken.push(format!("{p}: {target}: no such heading"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert_eq!(
        anchor(" Reload and upgrade (SIGHUP, `-u`)"),
        "reload-and-upgrade-sighup--u"
    );
}
