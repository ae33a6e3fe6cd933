//! Line charts as hand-written SVG: no font or image library is needed on the machine, and the
//! files diff and open anywhere.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::metrics::LoadSample;
use super::stats::Summary;

const W: f64 = 860.0;
const H: f64 = 480.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

pub struct Axes<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub log_x: bool,
}

/// TTFT CDFs of several runs overlaid, from each summary's stored quantiles. The x axis turns
/// logarithmic when TTFTs span more than a factor of 20, as they do between good and bad
/// placement.
pub fn ttft_cdf_svg(runs: &[(String, Summary)]) -> String {
    let series: Vec<Series> = runs
        .iter()
        .filter(|(_, s)| !s.ttft_quantiles_ms.is_empty())
        .map(|(label, s)| Series {
            label: label.clone(),
            points: s
                .ttft_quantiles_ms
                .iter()
                .enumerate()
                .map(|(i, &ms)| (ms, i as f64 / (s.ttft_quantiles_ms.len() - 1).max(1) as f64))
                .collect(),
        })
        .collect();
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (lo, hi) = xs.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let log_x = lo > 0.0 && hi / lo > 20.0;
    line_chart(
        &Axes {
            title: "TTFT CDF (successful requests)",
            x_label: "TTFT (ms)",
            y_label: "fraction",
            log_x,
        },
        &series,
    )
}

/// Running + waiting requests per backend over time.
pub fn backend_load_svg(samples: &[LoadSample]) -> String {
    let series = per_backend(samples, |s| Some(s.running + s.waiting));
    line_chart(
        &Axes {
            title: "Backend load (running + waiting)",
            x_label: "time (s)",
            y_label: "requests",
            log_x: false,
        },
        &series,
    )
}

/// KV cache usage per backend over time, in percent.
pub fn backend_kv_svg(samples: &[LoadSample]) -> String {
    let series = per_backend(samples, |s| s.kv_cache_usage.map(|u| u * 100.0));
    line_chart(
        &Axes {
            title: "KV cache usage",
            x_label: "time (s)",
            y_label: "percent",
            log_x: false,
        },
        &series,
    )
}

fn per_backend(samples: &[LoadSample], y: impl Fn(&LoadSample) -> Option<f64>) -> Vec<Series> {
    let mut by: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for s in samples {
        if let Some(v) = y(s) {
            by.entry(short_backend(&s.backend))
                .or_default()
                .push((s.t_ms / 1e3, v));
        }
    }
    by.into_iter()
        .map(|(label, mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series {
                label: label.to_owned(),
                points,
            }
        })
        .collect()
}

/// `http://127.0.0.1:8001/metrics` -> `127.0.0.1:8001`: full URLs overflow the legend.
fn short_backend(url: &str) -> &str {
    let s = url.split_once("://").map_or(url, |(_, rest)| rest);
    s.split('/').next().unwrap_or(s)
}

pub fn line_chart(axes: &Axes, series: &[Series]) -> String {
    let pts = || series.iter().flat_map(|s| s.points.iter().copied());
    let log_x = axes.log_x && pts().all(|p| p.0 > 0.0);
    let fx = |x: f64| if log_x { x.log10() } else { x };
    let (mut x0, mut x1) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
        (a.min(fx(p.0)), b.max(fx(p.0)))
    });
    let mut y1 = pts().fold(0.0f64, |a, p| a.max(p.1));
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    let xticks = if log_x {
        x0 = x0.floor();
        x1 = x1.ceil().max(x0 + 1.0);
        (x0 as i32..=x1 as i32).map(f64::from).collect()
    } else {
        x0 = x0.min(0.0);
        let t = nice_ticks(x1.max(x0 + 1e-9));
        x1 = *t.last().unwrap_or(&1.0);
        t
    };
    if y1 <= 0.0 {
        y1 = 1.0;
    }
    let yticks = nice_ticks(y1);
    let y1 = *yticks.last().unwrap_or(&1.0);
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let sx = |x: f64| LEFT + (fx(x) - x0) / (x1 - x0).max(1e-12) * pw;
    let sy = |y: f64| TOP + ph - y / y1 * ph;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        LEFT + pw / 2.0,
        esc(axes.title)
    );
    for &t in &xticks {
        let x = if log_x {
            LEFT + (t - x0) / (x1 - x0) * pw
        } else {
            sx(t)
        };
        let label = if log_x {
            fmt_num(10f64.powf(t))
        } else {
            fmt_num(t)
        };
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#e5e5e5"/>"##,
            TOP + ph
        );
        let _ = writeln!(
            s,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{label}</text>"#,
            TOP + ph + 16.0
        );
    }
    for &t in &yticks {
        let y = sy(t);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/>"##,
            LEFT + pw
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            y + 4.0,
            fmt_num(t)
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        H - 12.0,
        esc(axes.x_label)
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{}</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0,
        esc(axes.y_label)
    );
    for (i, ser) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = ser
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        if !path.is_empty() {
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{}"/>"#,
                path.join(" ")
            );
        }
        let ly = TOP + 14.0 + i as f64 * 18.0;
        let lx = LEFT + pw + 12.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/>"#,
            lx + 20.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 26.0,
            ly + 4.0,
            esc(&ser.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// About five round ticks from 0 to at least `max`.
fn nice_ticks(max: f64) -> Vec<f64> {
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let n = (max / step).ceil() as usize;
    (0..=n).map(|i| i as f64 * step).collect()
}

fn fmt_num(x: f64) -> String {
    if x == x.round() && x.abs() < 1e9 {
        format!("{}", x as i64)
    } else if x.abs() >= 1.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_labels_are_host_port() {
        assert_eq!(
            short_backend("http://127.0.0.1:8001/metrics"),
            "127.0.0.1:8001"
        );
        assert_eq!(short_backend("localhost:9"), "localhost:9");
    }

    #[test]
    fn ticks_cover_max() {
        let t = nice_ticks(7.3);
        assert_eq!(t.first(), Some(&0.0));
        assert!(*t.last().unwrap() >= 7.3 && t.len() <= 7);
    }

    #[test]
    fn cdf_svg_is_well_formed_and_escaped() {
        let s = Summary {
            ttft_quantiles_ms: (0..=100).map(|i| 10.0 + i as f64 * 30.0).collect(),
            ..Default::default()
        };
        let svg = ttft_cdf_svg(&[
            ("a<b".into(), s.clone()),
            ("empty".into(), Summary::default()),
        ]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a&lt;b") && !svg.contains("empty"));
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert!(!svg.contains("NaN"));
    }
}
