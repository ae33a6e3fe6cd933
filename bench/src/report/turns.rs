//! `kvbench report turns`: where a multi-turn run's slow first tokens come from, the later
//! turns that changed backend. A conversation's turn order is its requests' send order.

use std::collections::HashMap;

use super::{fixed_or_nan, Record, RunReport, BIG};

/// The answered requests of each session, in send order; requests without a session are
/// single-turn and take no part.
pub fn conversations(records: &[&Record]) -> Vec<Vec<Record>> {
    let mut by_send: Vec<&Record> = records.to_vec();
    by_send.sort_by(|a, b| a.send_ms.total_cmp(&b.send_ms));
    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut convs: Vec<Vec<Record>> = Vec::new();
    for r in by_send {
        let Some(session) = r.session.as_deref().filter(|s| !s.is_empty()) else {
            continue;
        };
        let i = *index.entry(session).or_insert_with(|| {
            convs.push(Vec::new());
            convs.len() - 1
        });
        convs[i].push(r.clone());
    }
    convs
}

/// Turns that went to another backend than the turn before, those of them that missed
/// (at least BIG uncached tokens), and those whose next turn went straight back.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Moves {
    pub moves: usize,
    pub missed: usize,
    pub back: usize,
}

pub fn moves(convs: &[Vec<Record>]) -> Moves {
    let mut m = Moves::default();
    for conv in convs {
        for k in 1..conv.len() {
            if conv[k].backend != conv[k - 1].backend {
                m.moves += 1;
                m.missed += usize::from(conv[k].uncached() >= BIG);
                if conv
                    .get(k + 1)
                    .is_some_and(|next| next.backend == conv[k - 1].backend)
                {
                    m.back += 1;
                }
            }
        }
    }
    m
}

pub fn row(report: &RunReport) -> Option<String> {
    let recs = report.answered();
    if recs.is_empty() {
        return None;
    }
    let m = moves(&conversations(&recs));
    let big = recs.iter().filter(|r| r.uncached() >= BIG).count() as f64 / recs.len() as f64;
    let s = |key: &str| report.summary.get(key).and_then(serde_json::Value::as_f64);
    Some(format!(
        "hit {}  TTFT p50/p90/p99 {}/{}/{} ms  uncached>={BIG}: {big:.3}  moves {} (missed {}, back {})",
        fixed_or_nan(s("cache_hit_rate"), 3),
        fixed_or_nan(s("ttft_p50_ms"), 1),
        fixed_or_nan(s("ttft_p90_ms"), 1),
        fixed_or_nan(s("ttft_p99_ms"), 0),
        m.moves,
        m.missed,
        m.back,
    ))
}

#[cfg(test)]
mod tests {
    use super::super::tests::rec;
    use super::*;

    #[test]
    fn a_moved_turn_and_one_that_came_back() {
        // Session a: 0 -> 1 (moved, missed) -> 0 (moved again, and came back after the first
        // move) -> 0 (stayed). Session b stays on 2. A request without a session never counts.
        let records = vec![
            rec(0, 0.0, Some("a"), "0", 10.0, 1000),
            rec(1, 5.0, Some("b"), "2", 10.0, 1000),
            rec(2, 10.0, Some("a"), "1", 80.0, 900),
            rec(3, 20.0, Some("a"), "0", 12.0, 10),
            rec(4, 30.0, Some("a"), "0", 12.0, 10),
            rec(5, 35.0, Some("b"), "2", 12.0, 10),
            rec(6, 36.0, None, "3", 12.0, 10),
        ];
        let refs: Vec<&Record> = records.iter().collect();
        let convs = conversations(&refs);
        assert_eq!(convs.len(), 2);
        assert_eq!(
            moves(&convs),
            Moves {
                moves: 2,
                missed: 1,
                back: 1
            }
        );

        let report = RunReport {
            summary: serde_json::json!({
                "cache_hit_rate": 0.5, "ttft_p50_ms": 12.0, "ttft_p90_ms": 80.0, "ttft_p99_ms": 80.0
            }),
            records,
        };
        assert_eq!(
            row(&report).unwrap(),
            "hit 0.500  TTFT p50/p90/p99 12.0/80.0/80 ms  uncached>=256: 0.429  moves 2 (missed 1, back 1)"
        );
    }

    #[test]
    fn send_order_not_record_order_makes_the_turns() {
        let records = [
            rec(1, 10.0, Some("a"), "1", 10.0, 0),
            rec(0, 0.0, Some("a"), "0", 10.0, 0),
        ];
        let refs: Vec<&Record> = records.iter().collect();
        let convs = conversations(&refs);
        assert_eq!(convs[0][0].backend.as_deref(), Some("0"));
        assert_eq!(
            moves(&convs),
            Moves {
                moves: 1,
                missed: 0,
                back: 0
            }
        );
    }
}
