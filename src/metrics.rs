//! Registering `kvroute_*` Prometheus families. Each component registers its own families in
//! the process's one [`Registry`] and keeps the handles it updates (as linkerd2-proxy does); the
//! admin listener renders the registry. This module only holds the shared helpers.

use prometheus::core::Collector;
use prometheus::{
    exponential_buckets, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// Register a collector and hand it back.
fn registered<C: Collector + Clone + 'static>(reg: &Registry, c: C) -> prometheus::Result<C> {
    reg.register(Box::new(c.clone()))?;
    Ok(c)
}

pub(crate) fn counter(reg: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    registered(reg, IntCounter::new(name, help)?)
}

pub(crate) fn counter_vec(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    registered(reg, IntCounterVec::new(Opts::new(name, help), labels)?)
}

pub(crate) fn int_gauge(reg: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    registered(reg, IntGauge::new(name, help)?)
}

pub(crate) fn int_gauge_vec(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntGaugeVec> {
    registered(reg, IntGaugeVec::new(Opts::new(name, help), labels)?)
}

pub(crate) fn gauge(reg: &Registry, name: &str, help: &str) -> prometheus::Result<Gauge> {
    registered(reg, Gauge::new(name, help)?)
}

pub(crate) fn gauge_vec(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<GaugeVec> {
    registered(reg, GaugeVec::new(Opts::new(name, help), labels)?)
}

/// Seconds, 1 ms .. ~524 s: covers a cache-hit first token and a long generation.
pub(crate) fn seconds_vec(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<HistogramVec> {
    let buckets = exponential_buckets(0.001, 2.0, 20)?;
    registered(
        reg,
        HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)?,
    )
}

/// Seconds, 1 us .. ~0.5 s: work done inline on a request's path.
pub(crate) fn microseconds(
    reg: &Registry,
    name: &str,
    help: &str,
) -> prometheus::Result<Histogram> {
    let buckets = exponential_buckets(1e-6, 2.0, 20)?;
    registered(
        reg,
        Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))?,
    )
}

/// Buckets of `estimate_ratio_vec`: fine around 1, so the share within 5% or 10% can be read.
const ESTIMATE_RATIO_BUCKETS: [f64; 13] = [
    0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0,
];

/// A ratio expected near 1 (an estimate that is learned to be right), 0.25 .. 4 with fine
/// buckets between 0.9 and 1.1: the share of estimates within 10% is `le="1.1"` minus
/// `le="0.9"`.
pub(crate) fn estimate_ratio_vec(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<HistogramVec> {
    let opts = HistogramOpts::new(name, help).buckets(ESTIMATE_RATIO_BUCKETS.to_vec());
    registered(reg, HistogramVec::new(opts, labels)?)
}

/// A dimensionless ratio, 1/64 .. 512 by powers of two: how far an estimate was off.
pub(crate) fn ratio_vec(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<HistogramVec> {
    let buckets = exponential_buckets(1.0 / 64.0, 2.0, 16)?;
    registered(
        reg,
        HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)?,
    )
}
