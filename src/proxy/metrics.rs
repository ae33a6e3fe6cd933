//! The request path's families: what happened to each request, how it was placed, retried and
//! answered.

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Registry};

use super::ctx::IndexMode;
use crate::metrics::{
    counter, counter_vec, estimate_ratio_vec, int_gauge_vec, microseconds, ratio_vec, seconds_vec,
};
use crate::request::resume::Unfit;
use crate::request::Endpoint;

pub struct ProxyMetrics {
    pub(super) requests: IntCounterVec,
    pub(super) duration: HistogramVec,
    pub(super) ttft: HistogramVec,
    pub(super) decisions: IntCounterVec,
    /// kv_aware decisions by the index behind them, exact then approximate (children made
    /// once: see `decided_on`).
    decisions_by_index: [IntCounter; 2],
    pub(super) decision_time: Histogram,
    pub(super) predicted_cached: IntCounter,
    pub(super) prompt_tokens: IntCounterVec,
    pub(super) cached_prompt_tokens: IntCounterVec,
    pub(super) upstream_failures: IntCounterVec,
    pub(super) retries: IntCounterVec,
    pub(super) ejections: IntCounterVec,
    pub(super) cut_streams: IntCounterVec,
    pub(super) migrations: IntCounterVec,
    pub(super) migration_gap: HistogramVec,
    pub(super) first_byte_ratio: HistogramVec,
    pub(super) token_estimate_ratio: HistogramVec,
    pub(super) queued_by_model: IntGaugeVec,
    pub(super) access_log_dropped: IntCounter,
    pub(super) exact_tokenize: IntCounterVec,
    pub(super) exact_tokenize_seconds: Histogram,
    pub(super) exact_replies: IntCounterVec,
    pub(super) cached_by_index: IntCounterVec,
    pub(super) client_drain: HistogramVec,
    pub(super) pd_decisions: IntCounterVec,
    pub(super) pd_legs: IntCounterVec,
    pub(super) pd_prefill_seconds: HistogramVec,
}

impl ProxyMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<ProxyMetrics> {
        let m = ProxyMetrics {
            requests: counter_vec(
                r,
                "kvroute_requests_total",
                "Requests answered, by backend (\"none\" if never dispatched) and HTTP status code.",
                &["backend", "code"],
            )?,
            duration: seconds_vec(
                r,
                "kvroute_request_duration_seconds",
                "Time from request start to the last response byte.",
                &["backend"],
            )?,
            ttft: seconds_vec(
                r,
                "kvroute_time_to_first_token_seconds",
                "Time from request start to the first response body byte of a streamed response, \
                 by backend and model.",
                &["backend", "model"],
            )?,
            decisions: counter_vec(
                r,
                "kvroute_routing_decisions_total",
                "Placement decisions by policy, reason (affinity, spill, failover, ...) and model.",
                &["policy", "reason", "model"],
            )?,
            decisions_by_index: {
                let v = counter_vec(
                    r,
                    "kvroute_routing_decisions_by_index_total",
                    "kv_aware placement decisions by the prefix index behind them: exact (the \
                     chosen backend's cache known from its engine's KV events, the prompt \
                     tokenized as the engine sees it), approximate (what kvroute sent it).",
                    &["index"],
                )?;
                [
                    v.with_label_values(&["exact"]),
                    v.with_label_values(&["approximate"]),
                ]
            },
            decision_time: microseconds(
                r,
                "kvroute_routing_decision_seconds",
                "Time to place a routed request: index lookup, snapshot, policy.",
            )?,
            predicted_cached: counter(
                r,
                "kvroute_predicted_cached_prompt_tokens_total",
                "Prompt tokens the prefix index predicted the chosen backend holds (kv_aware).",
            )?,
            prompt_tokens: counter_vec(
                r,
                "kvroute_prompt_tokens_total",
                "Prompt tokens of answered requests, as the engine reported them in usage, by \
                 backend, model and API.",
                &["backend", "model", "api"],
            )?,
            cached_prompt_tokens: counter_vec(
                r,
                "kvroute_cached_prompt_tokens_total",
                "Prompt tokens the engine reported as served from its prefix cache, by backend, \
                 model and API.",
                &["backend", "model", "api"],
            )?,
            upstream_failures: counter_vec(
                r,
                "kvroute_upstream_failures_total",
                "Failed upstream attempts before any response byte, by backend and kind (connect, io).",
                &["backend", "kind"],
            )?,
            retries: counter_vec(
                r,
                "kvroute_retries_total",
                "Retry decisions after a failed attempt (retried, budget_exhausted, attempts_exhausted).",
                &["outcome"],
            )?,
            ejections: counter_vec(
                r,
                "kvroute_outlier_ejections_total",
                "Times a backend was ejected for failing requests in a row.",
                &["backend"],
            )?,
            cut_streams: counter_vec(
                r,
                "kvroute_cut_streams_total",
                "Responses cut after they started (the backend failed mid-stream), by backend.",
                &["backend"],
            )?,
            migrations: counter_vec(
                r,
                "kvroute_migrations_total",
                "Streams whose backend failed after the response started, by what followed: \
                 migrated (continued on another backend), finished (the text was already whole: \
                 the stream was ended), limit (limits.max_migrations reached), disabled \
                 (limits.max_migrations is 0), not_streamed (a whole body was being sent: \
                 its client has part of it), unfit_* (a request another engine cannot \
                 continue faithfully).",
                &["outcome"],
            )?,
            migration_gap: seconds_vec(
                r,
                "kvroute_migration_gap_seconds",
                "A migrated stream's gap: from the last event before its backend failed to the \
                 first event of the continuation, by the backend that continued it and how the \
                 other failed (connection: reset or closed; silent: nothing within the read \
                 deadline; engine_error: the engine's error event).",
                &["backend", "cause"],
            )?,
            first_byte_ratio: ratio_vec(
                r,
                "kvroute_backend_first_byte_prediction_ratio",
                "Observed time to first byte over kv_aware's predicted TTFT, for streamed requests \
                 (predictions are in the engine's time, observations in kvroute's).",
                &["backend"],
            )?,
            token_estimate_ratio: estimate_ratio_vec(
                r,
                "kvroute_prompt_tokens_estimate_ratio",
                "Engine-reported prompt tokens over kvroute's estimate, by method (counted: BPE \
                 count inline, counted_offthread: BPE count on a blocking thread, sized: from the \
                 prompt's bytes), before this request's correction.",
                &["method"],
            )?,
            access_log_dropped: counter(
                r,
                "kvroute_access_log_dropped_total",
                "JSON access-log lines dropped because the writer was behind (stderr too slow).",
            )?,
            queued_by_model: int_gauge_vec(
                r,
                "kvroute_model_queue_depth",
                "Requests waiting in the router queue, by model (configured or listed by an \
                 engine; any other name is `other`).",
                &["model"],
            )?,
            exact_tokenize: counter_vec(
                r,
                "kvroute_exact_tokenize_total",
                "Prompts tokenized as the engines do, for the exact index: tokenized, late (not \
                 within kv_events.tokenize_budget_ms), busy (every slot taken and one request \
                 already waiting per slot, or none freed within the budget), failed, \
                 too_large. All but tokenized are placed on the approximate index.",
                &["outcome"],
            )?,
            exact_tokenize_seconds: microseconds(
                r,
                "kvroute_exact_tokenize_seconds",
                "How long a request waited for its prompt to be tokenized for the exact index.",
            )?,
            pd_decisions: counter_vec(
                r,
                "kvroute_pd_decisions_total",
                "Disaggregation decisions (kvroute.disaggregation): served whole on the decode server, or split with a prefill server.",
                &["outcome"],
            )?,
            pd_legs: counter_vec(
                r,
                "kvroute_pd_prefill_legs_total",
                "Prefill legs of split requests, by outcome (ok; full: no room since the decision; failed; no_params: the engine held nothing). Failed and full legs are placed again; no_params legs are served whole.",
                &["outcome"],
            )?,
            pd_prefill_seconds: seconds_vec(
                r,
                "kvroute_pd_prefill_leg_seconds",
                "Time from sending a prefill leg to its answer.",
                &[],
            )?,
            client_drain: seconds_vec(
                r,
                "kvroute_client_drain_seconds",
                "Time from the engine's last response byte to the client's, for responses read \
                 ahead (limits.upstream_read_ahead_bytes): how long clients hold a response the \
                 engine has finished.",
                &[],
            )?,
            exact_replies: counter_vec(
                r,
                "kvroute_exact_replies_tokenized_total",
                "Chat replies tokenized in the background once answered, so the conversation's \
                 next turn finds them remembered: tokenized, skipped (no tokenizing slot free), \
                 failed.",
                &["outcome"],
            )?,
            cached_by_index: counter_vec(
                r,
                "kvroute_cached_prompt_tokens_by_index_total",
                "Cached prompt tokens of answered kv_aware requests, as predicted and as the \
                 engine reported them, by the index the prediction came from (exact: the \
                 engine's KV events; approximate: what kvroute sent), and by API.",
                &["index", "source", "api"],
            )?,
        };
        for outcome in ["tokenized", "late", "busy", "failed", "too_large"] {
            m.exact_tokenize.with_label_values(&[outcome]);
        }
        for outcome in ["tokenized", "skipped", "failed"] {
            m.exact_replies.with_label_values(&[outcome]);
        }
        for index in ["exact", "approximate"] {
            for source in ["predicted", "reported"] {
                for api in Endpoint::ALL {
                    m.cached_by_index
                        .with_label_values(&[index, source, api.as_str()]);
                }
            }
        }
        for outcome in ["migrated", "finished", "limit", "disabled", "not_streamed"] {
            m.migrations.with_label_values(&[outcome]);
        }
        for unfit in Unfit::ALL {
            m.migrations.with_label_values(&[unfit.as_str()]);
        }
        for outcome in ["retried", "budget_exhausted", "attempts_exhausted"] {
            m.retries.with_label_values(&[outcome]);
        }
        for outcome in ["whole", "split"] {
            m.pd_decisions.with_label_values(&[outcome]);
        }
        // `pd::Leg`'s names (its tests check they match).
        for leg in ["ok", "full", "failed", "no_params"] {
            m.pd_legs.with_label_values(&[leg]);
        }
        // Every request for an unnamed model shares `other`: always a label value.
        m.queued_by_model.with_label_values(&["other"]);
        Ok(m)
    }

    /// The counter of kv_aware decisions made on `index`.
    pub(super) fn decided_on(&self, index: IndexMode) -> &IntCounter {
        match index {
            IndexMode::Exact => &self.decisions_by_index[0],
            IndexMode::Approximate => &self.decisions_by_index[1],
        }
    }

    /// Export `backend`'s failure counters at zero (at start, and for a backend a reload adds),
    /// so an alert on their increase sees the first failure.
    pub fn init_backend(&self, backend: &str) {
        for kind in ["connect", "io", "cut", "refused_continuation"] {
            self.upstream_failures.with_label_values(&[backend, kind]);
        }
        self.ejections.with_label_values(&[backend]);
        self.cut_streams.with_label_values(&[backend]);
    }
}
