//! A fleet of several models (`compare --models`): one simulator process per model group,
//! each server pinned to its group's models in kvroute's config, and after each run an audit
//! from the simulators themselves: adapter loads (`kvbench_lora_loads_total`) and every
//! request a server logged for a model it does not serve.

use std::net::SocketAddr;

use std::fmt::Write as _;

use serde::Deserialize;

use crate::replay::stats::Summary;

/// Servers serving one base model and, on top of it, LoRA adapters.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelGroup {
    pub name: String,
    pub servers: u32,
    pub adapters: Vec<String>,
}

impl ModelGroup {
    /// What a server of this group serves: the base model, then its adapters.
    pub fn served(&self) -> Vec<String> {
        std::iter::once(self.name.clone())
            .chain(self.adapters.iter().cloned())
            .collect()
    }
}

/// `NAME:SERVERS[:ADAPTER+ADAPTER...]`, comma-separated groups.
pub fn parse_spec(spec: &str) -> Result<Vec<ModelGroup>, String> {
    let bad = |part: &str, why: &str| format!("--models {part:?}: {why}");
    let mut groups: Vec<ModelGroup> = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let mut fields = part.split(':');
        let name = fields.next().unwrap_or_default().trim();
        let servers: u32 = fields
            .next()
            .ok_or_else(|| bad(part, "expected NAME:SERVERS[:ADAPTER+ADAPTER...]"))?
            .trim()
            .parse()
            .map_err(|_| bad(part, "SERVERS must be a whole number"))?;
        let adapters: Vec<String> = fields
            .next()
            .map(|a| a.split('+').map(|x| x.trim().to_string()).collect())
            .unwrap_or_default();
        if fields.next().is_some() {
            return Err(bad(part, "too many ':' fields"));
        }
        if name.is_empty() || servers == 0 || adapters.iter().any(String::is_empty) {
            return Err(bad(
                part,
                "needs a name, at least one server, non-empty adapters",
            ));
        }
        groups.push(ModelGroup {
            name: name.to_string(),
            servers,
            adapters,
        });
    }
    let all = popularity(&groups);
    if let Some(dup) = all
        .iter()
        .enumerate()
        .find_map(|(i, m)| all[..i].contains(m).then_some(m))
    {
        return Err(format!("--models: {dup:?} is named twice"));
    }
    Ok(groups)
}

/// Every model name, in the order the workload ranks their popularity (hottest first): each
/// group's base model, then its adapters, group by group.
pub fn popularity(groups: &[ModelGroup]) -> Vec<String> {
    groups.iter().flat_map(ModelGroup::served).collect()
}

/// The simulator arguments that make a server one of `group`'s.
pub fn sim_args(group: &ModelGroup, max_loras: usize, lora_load_ms: f64) -> Vec<String> {
    let mut a = vec!["--model".to_string(), group.name.clone()];
    if !group.adapters.is_empty() {
        a.extend([
            "--lora-adapters".to_string(),
            group.adapters.join(","),
            "--max-loras".to_string(),
            max_loras.to_string(),
            "--lora-load-ms".to_string(),
            lora_load_ms.to_string(),
        ]);
    }
    a
}

/// What the simulators saw during one run.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
pub struct Audit {
    /// Requests the servers logged (their logs are bounded; see `complete`).
    pub logged: u64,
    /// Of those, requests for a model the server does not serve.
    pub misrouted: u64,
    /// LoRA adapter loads over the fleet.
    pub adapter_loads: u64,
}

#[derive(Deserialize)]
struct Logged {
    #[serde(default)]
    model: Option<String>,
}

/// Reads every server's request log and adapter-load counter. `servers` pairs each address
/// with the models it serves.
pub async fn audit(servers: &[(SocketAddr, Vec<String>)]) -> Result<Audit, String> {
    let client = reqwest::Client::new();
    let mut out = Audit::default();
    for (addr, served) in servers {
        let log: Vec<Logged> = get(&client, &format!("http://{addr}/debug/requests"))
            .await
            .and_then(|b| serde_json::from_str(&b).map_err(|e| e.to_string()))
            .map_err(|e| format!("request log of {addr}: {e}"))?;
        out.logged += log.len() as u64;
        out.misrouted += log
            .iter()
            .filter_map(|e| e.model.as_ref())
            .filter(|m| !served.contains(m))
            .count() as u64;
        let metrics = get(&client, &format!("http://{addr}/metrics"))
            .await
            .map_err(|e| format!("metrics of {addr}: {e}"))?;
        out.adapter_loads += metrics
            .lines()
            .find_map(|l| l.strip_prefix("kvbench_lora_loads_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0) as u64;
    }
    Ok(out)
}

async fn get(client: &reqwest::Client, url: &str) -> Result<String, String> {
    let r = client.get(url).send().await.map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("status {}", r.status()));
    }
    r.text().await.map_err(|e| e.to_string())
}

/// Adapter loads and misrouted requests per run, from the simulators, with the hit rate
/// against the oracle's.
pub fn audit_table(runs: &[(String, Summary)], audits: &[(String, Audit)]) -> String {
    let mut md = String::from(
        "\nFrom the simulators (every request each server received; `misrouted`: for a model \
         that server does not serve):\n\n\
         | policy | requests received | adapter loads | loads / 1000 requests | misrouted | hit rate / oracle |\n\
         |---|---|---|---|---|---|\n",
    );
    for (label, a) in audits {
        let per_k = match a.logged {
            0 => "n/a".to_string(),
            n => format!("{:.1}", a.adapter_loads as f64 * 1000.0 / n as f64),
        };
        let vs_oracle = runs
            .iter()
            .find(|(l, _)| l == label)
            .and_then(|(_, s)| Some(s.cache_hit_rate? / s.oracle_hit_rate.filter(|o| *o > 0.0)?))
            .map_or("n/a".to_string(), |r| format!("{r:.3}"));
        let _ = writeln!(
            md,
            "| {label} | {} | {} | {per_k} | {} | {vs_oracle} |",
            a.logged, a.adapter_loads, a.misrouted
        );
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_names_groups_and_their_adapters() {
        let g = parse_spec("a:4, b:4:b-l1+b-l2").unwrap();
        assert_eq!(g.len(), 2);
        assert_eq!((g[0].name.as_str(), g[0].servers), ("a", 4));
        assert!(g[0].adapters.is_empty());
        assert_eq!(g[1].served(), ["b", "b-l1", "b-l2"]);
        assert_eq!(popularity(&g), ["a", "b", "b-l1", "b-l2"]);
        assert_eq!(sim_args(&g[0], 2, 200.0), ["--model", "a"]);
        assert_eq!(
            sim_args(&g[1], 2, 150.0),
            [
                "--model",
                "b",
                "--lora-adapters",
                "b-l1,b-l2",
                "--max-loras",
                "2",
                "--lora-load-ms",
                "150"
            ]
        );
        for bad in [
            "a", "a:0", ":3", "a:x", "a:1:", "a:1:x+", "a:1:x:y", "a:1,a:2", "a:1:a",
        ] {
            assert!(parse_spec(bad).is_err(), "{bad}");
        }
    }
}
