//! The per-tenant tables: one row per run and tenant, then Jain's index per run. Shared by
//! `replay`'s report.md and `compare`'s README.

use std::fmt::Write as _;

use crate::replay::stats::Summary;

const HEADER: &[&str] = &[
    "run",
    "tenant",
    "priority",
    "requests",
    "errors",
    "shed",
    "TTFT p50/p90/p99 ms",
    "goodput req/s",
    "attained service (tokens)",
    "deadline met",
    "at risk",
    "shed answer p99 ms",
];

/// Both tables for the runs that had more than one tenant; `None` when no run had.
pub fn markdown(runs: &[(String, Summary)]) -> Option<String> {
    if runs.iter().all(|(_, s)| s.tenants.is_empty()) {
        return None;
    }
    let mut s = String::from(
        "\nPer tenant (sheds are not errors; goodput counts a request's own deadline, else the \
         run's SLO; attained service is prompt + 2 x completion tokens; deadline met: of the \
         admitted requests that carried one):\n\n",
    );
    let _ = writeln!(
        s,
        "| {} |\n|{}",
        HEADER.join(" | "),
        "---|".repeat(HEADER.len())
    );
    for (label, m) in runs {
        for t in &m.tenants {
            let shed = if t.shed.is_empty() {
                "0".to_owned()
            } else {
                let by: Vec<String> = t.shed.iter().map(|(r, n)| format!("{r} {n}")).collect();
                by.join(", ")
            };
            let d = t.deadlines.as_ref();
            let cells = [
                label.replace('|', "/"),
                t.tenant.replace('|', "/"),
                t.priorities
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                t.requests.to_string(),
                t.errors.to_string(),
                shed,
                format!(
                    "{}/{}/{}",
                    ms(t.ttft_p50_ms),
                    ms(t.ttft_p90_ms),
                    ms(t.ttft_p99_ms)
                ),
                format!("{:.2}", t.goodput_rps),
                t.attained_service.to_string(),
                d.map_or("n/a".into(), |d| match d.met {
                    Some(met) => format!("{:.1}% of {}", met * 100.0, d.admitted),
                    None => format!("none of {} admitted", d.requests),
                }),
                d.map_or("n/a".into(), |d| d.at_risk.to_string()),
                ms(t.shed_answer_p99_ms),
            ];
            let _ = writeln!(s, "| {} |", cells.join(" | "));
        }
    }
    let _ = writeln!(
        s,
        "\nJain's index of attained service among the tenants backlogged (a request \
         outstanding at every moment) through a window, over the windows with two or more:\n\n\
         | run | windows | counted | Jain min | Jain median |\n|---|---|---|---|---|"
    );
    for (label, m) in runs {
        if let Some(f) = &m.fairness {
            let _ = writeln!(
                s,
                "| {} | {} of {:.0} s | {} | {} | {} |",
                label.replace('|', "/"),
                f.windows,
                f.window_s,
                f.counted,
                ratio(f.jain_min),
                ratio(f.jain_median)
            );
        }
    }
    Some(s)
}

fn ms(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.0}"))
}

fn ratio(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.3}"))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::replay::tenants::{Deadlines, Fairness, TenantRow};

    #[test]
    fn a_row_per_run_and_tenant_and_a_fairness_line_per_run() {
        assert!(markdown(&[("solo".into(), Summary::default())]).is_none());
        let run = Summary {
            tenants: vec![
                TenantRow {
                    tenant: "flood".into(),
                    priorities: vec![-1, 0],
                    requests: 9,
                    shed: BTreeMap::from([("sheddable".into(), 3)]),
                    ttft_p50_ms: Some(3025.4),
                    ..TenantRow::default()
                },
                TenantRow {
                    tenant: "steady-0".into(),
                    priorities: vec![1],
                    deadlines: Some(Deadlines {
                        requests: 10,
                        admitted: 8,
                        met: Some(0.75),
                        at_risk: 2,
                    }),
                    ..TenantRow::default()
                },
            ],
            fairness: Some(Fairness {
                window_s: 60.0,
                windows: 2,
                counted: 1,
                jain_min: Some(0.5),
                jain_median: Some(0.5),
                per_window: Vec::new(),
            }),
            ..Summary::default()
        };
        let md = markdown(&[("fair".into(), run), ("other".into(), Summary::default())]).unwrap();
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| fair")).collect();
        assert_eq!(rows.len(), 3, "{md}");
        assert!(rows[0].contains("| flood | -1, 0 | 9 | 0 | sheddable 3 | 3025/n/a/n/a |"));
        assert_eq!(rows[0].matches('|').count(), HEADER.len() + 1);
        assert!(rows[1].contains("| 75.0% of 8 | 2 |"), "{}", rows[1]);
        assert_eq!(rows[2], "| fair | 2 of 60 s | 1 | 0.500 | 0.500 |");
        assert!(!md.contains("| other"));
    }
}
