//! The layering of `src/` holds: no file imports a file of a higher layer, and no files import
//! each other in a loop (in `src/` and in kvbench's `bench/src/`). Imports are read from the
//! source text: every `use` tree and every inline `crate::`/`super::` path outside test
//! modules, resolved to the file that defines the module it names.
//!
//! Layers, lowest first (see the crate doc in `src/lib.rs`): `error` and `metrics` (leaves),
//! `config`, `request`, `placement`, `fleet`, `edge`, `proxy`, `server`, then `lib.rs` and
//! `main.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const LAYERS: &[&[&str]] = &[
    &["error", "metrics"],
    &["config"],
    &["request"],
    &["placement"],
    &["fleet"],
    &["edge"],
    &["proxy"],
    &["server"],
];

/// A module path (`["fleet", "roster"]`) and the file that defines it.
struct Tree {
    files: BTreeMap<Vec<String>, PathBuf>,
}

impl Tree {
    fn read(root: &Path) -> Tree {
        let mut files = BTreeMap::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).expect("read source dir") {
                let path = entry.expect("dir entry").path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") {
                    continue;
                }
                let rel = path.strip_prefix(root).expect("under root");
                let mut module: Vec<String> = rel
                    .iter()
                    .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
                    .collect();
                if matches!(
                    module.last().map(String::as_str),
                    Some("mod" | "lib" | "main")
                ) {
                    module.pop();
                }
                // A crate root (lib.rs/main.rs) is the empty path; keep the first one seen.
                files.entry(module).or_insert(path);
            }
        }
        Tree { files }
    }

    /// The file defining the longest module prefix of `path`, read from module `from`.
    fn resolve(&self, from: &[String], path: &[&str]) -> Option<&PathBuf> {
        let mut segs = path.iter().peekable();
        let mut module: Vec<String> = match segs.peek().copied() {
            Some(&"crate") => {
                segs.next();
                Vec::new()
            }
            Some(&"super") => {
                let mut m = from.to_vec();
                while segs.peek() == Some(&&"super") {
                    segs.next();
                    m.pop();
                }
                m
            }
            Some(&"self") => {
                segs.next();
                from.to_vec()
            }
            _ => return None,
        };
        for s in segs {
            let mut next = module.clone();
            next.push(s.to_string());
            if self.files.contains_key(&next) {
                module = next;
            } else {
                break;
            }
        }
        self.files.get(&module)
    }
}

/// The file's code without comment lines and without its `mod tests`.
fn code_of(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim();
        if t == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|n| n.trim_start().starts_with("mod tests"))
        {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Expand a `use` tree (`crate::a::{b, c::{d, e as f}}`) into its paths.
fn expand(tree: &str, prefix: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap_or(tree).trim();
        let full = format!("{prefix}{path}");
        out.push(full.trim_end_matches("::self").to_string());
        return;
    };
    let head = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut depth = 0;
    let mut start = 0;
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                if !inner[start..i].trim().is_empty() {
                    expand(&inner[start..i], &format!("{prefix}{head}"), out);
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    if !inner[start..].trim().is_empty() {
        expand(&inner[start..], &format!("{prefix}{head}"), out);
    }
}

/// Every crate-internal path the code names.
fn paths_in(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = String::new();
    let mut s = code;
    // `use` statements, which may span lines.
    while let Some(i) = s.find("use ") {
        let before_ok = i == 0 || !s.as_bytes()[i - 1].is_ascii_alphanumeric();
        let Some(end) = s[i..].find(';') else { break };
        rest.push_str(&s[..i]);
        let stmt = &s[i + 4..i + end];
        if before_ok
            && (stmt.trim_start().starts_with("crate")
                || stmt.trim_start().starts_with("super")
                || stmt.trim_start().starts_with("self"))
        {
            expand(stmt, "", &mut out);
        } else {
            rest.push_str(&s[i..i + end + 1]);
        }
        s = &s[i + end + 1..];
    }
    rest.push_str(s);
    // Inline paths such as `crate::config::BLOCK_BYTES` in the remaining code.
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(i) = rest[from..].find(start) {
            let at = from + i;
            let len = rest[at..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len() - at);
            out.push(rest[at..at + len].trim_end_matches(':').to_string());
            from = at + len;
        }
    }
    out
}

/// File -> files it imports.
fn graph(root: &Path) -> (Tree, BTreeMap<PathBuf, BTreeSet<PathBuf>>) {
    let tree = Tree::read(root);
    let mut edges = BTreeMap::new();
    for (module, file) in &tree.files {
        let text = std::fs::read_to_string(file).expect("read source file");
        let mut to = BTreeSet::new();
        for p in paths_in(&code_of(&text)) {
            let segs: Vec<&str> = p.split("::").collect();
            if let Some(target) = tree.resolve(module, &segs) {
                if target != file {
                    to.insert(target.clone());
                }
            }
        }
        edges.insert(file.clone(), to);
    }
    (tree, edges)
}

fn cycles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    // Depth-first search; a grey node reached again closes a loop.
    fn visit(
        n: &PathBuf,
        edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        colour: &mut BTreeMap<PathBuf, u8>,
        stack: &mut Vec<PathBuf>,
        found: &mut Vec<Vec<PathBuf>>,
    ) {
        colour.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in edges.get(n).into_iter().flatten() {
            match colour.get(m).copied().unwrap_or(0) {
                0 => visit(m, edges, colour, stack, found),
                1 => {
                    let from = stack.iter().position(|x| x == m).unwrap_or(0);
                    found.push(stack[from..].to_vec());
                }
                _ => {}
            }
        }
        stack.pop();
        colour.insert(n.clone(), 2);
    }
    let mut colour = BTreeMap::new();
    let mut found = Vec::new();
    for n in edges.keys() {
        if colour.get(n).copied().unwrap_or(0) == 0 {
            visit(n, edges, &mut colour, &mut Vec::new(), &mut found);
        }
    }
    found
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn layer(src: &Path, file: &Path) -> usize {
    let top = file
        .strip_prefix(src)
        .ok()
        .and_then(|r| r.iter().next())
        .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
        .unwrap_or_default();
    LAYERS
        .iter()
        .position(|l| l.contains(&top.as_str()))
        .unwrap_or(LAYERS.len())
}

#[test]
fn no_file_imports_a_higher_layer() {
    let src = root().join("src");
    let (tree, edges) = graph(&src);
    assert!(tree.files.len() > 20, "read {} files", tree.files.len());
    let mut upward = Vec::new();
    for (from, tos) in &edges {
        for to in tos {
            if layer(&src, to) > layer(&src, from) {
                upward.push(format!("{} -> {}", from.display(), to.display()));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports from a lower layer into a higher one:\n{}",
        upward.join("\n")
    );
}

#[test]
fn no_import_cycles() {
    for dir in ["src", "bench/src"] {
        let (_, edges) = graph(&root().join(dir));
        let found = cycles(&edges);
        assert!(found.is_empty(), "import cycles in {dir}: {found:#?}");
    }
}

#[test]
fn the_checker_sees_imports_and_cycles() {
    // The reader itself: brace trees, aliases, `self`, inline paths, and a planted loop.
    let code = "use crate::a::{b, c::{d, e as f}, self};\nfn x() { super::g::h(); }\n";
    let mut p = paths_in(code);
    p.sort();
    assert_eq!(
        p,
        [
            "crate::a",
            "crate::a::b",
            "crate::a::c::d",
            "crate::a::c::e",
            "super::g::h"
        ]
    );
    let (a, b) = (PathBuf::from("a.rs"), PathBuf::from("b.rs"));
    let mut edges = BTreeMap::new();
    edges.insert(a.clone(), BTreeSet::from([b.clone()]));
    edges.insert(b.clone(), BTreeSet::from([a.clone()]));
    assert_eq!(cycles(&edges).len(), 1);
    // And the real tree has the arrows it should: the proxy imports the fleet.
    let src = root().join("src");
    let (_, real) = graph(&src);
    assert!(real[&src.join("proxy/mod.rs")].contains(&src.join("fleet/mod.rs")));
}
