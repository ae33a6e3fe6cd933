//! `kvbench report tail`: what a run's TTFT tail is made of. Requests with few uncached tokens
//! spend their TTFT mostly waiting, so if their percentiles do not move between runs queueing
//! did not either; the others are slow prefills, sorted by where in their conversation they
//! fell (first turn, a turn that stayed, moved to a backend the conversation had not used, or
//! back to one it had).

use std::collections::HashMap;

use super::{fixed_or_nan, pick, sorted, Record, RunReport, BIG};

/// How many slow prefills (at least BIG uncached tokens) fell on each kind of turn.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Kinds {
    pub first: usize,
    pub stayed: usize,
    pub moved_new: usize,
    pub moved_back: usize,
    pub no_session: usize,
}

impl Kinds {
    fn total(&self) -> usize {
        self.first + self.stayed + self.moved_new + self.moved_back + self.no_session
    }

    /// Only the kinds that occurred, in a fixed order.
    fn detail(&self) -> String {
        [
            ("first", self.first),
            ("stayed", self.stayed),
            ("moved_new", self.moved_new),
            ("moved_back", self.moved_back),
            ("no_session", self.no_session),
        ]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect::<Vec<_>>()
        .join(" ")
    }
}

/// Unlike `turns`, requests without a session form one group of their own here, counted as
/// `no_session` (a trace without sessions has no turns to place).
pub fn kinds(recs: &[&Record]) -> Kinds {
    let mut by_send: Vec<&Record> = recs.to_vec();
    by_send.sort_by(|a, b| a.send_ms.total_cmp(&b.send_ms));
    let mut index: HashMap<Option<&str>, usize> = HashMap::new();
    let mut convs: Vec<(bool, Vec<&Record>)> = Vec::new();
    for r in by_send {
        let key = r.session.as_deref();
        let i = *index.entry(key).or_insert_with(|| {
            convs.push((key.is_none(), Vec::new()));
            convs.len() - 1
        });
        convs[i].1.push(r);
    }
    let mut k = Kinds::default();
    for (no_session, conv) in &convs {
        for (i, x) in conv.iter().enumerate() {
            if x.uncached() < BIG {
                continue;
            }
            if *no_session {
                k.no_session += 1;
            } else if i == 0 {
                k.first += 1;
            } else if x.backend == conv[i - 1].backend {
                k.stayed += 1;
            } else if conv[..i - 1].iter().any(|y| y.backend == x.backend) {
                k.moved_back += 1;
            } else {
                k.moved_new += 1;
            }
        }
    }
    k
}

pub fn row(report: &RunReport) -> Option<String> {
    let recs = report.answered();
    if recs.is_empty() {
        return None;
    }
    let ttft = sorted(recs.iter().filter_map(|r| r.ttft_ms).collect());
    let small = sorted(
        recs.iter()
            .filter(|r| r.uncached() < BIG)
            .filter_map(|r| r.ttft_ms)
            .collect(),
    );
    let small_q = if small.is_empty() {
        "-".to_string()
    } else {
        [0.5, 0.9, 0.99]
            .iter()
            .map(|&q| fixed_or_nan(pick(&small, q), 1))
            .collect::<Vec<_>>()
            .join("/")
    };
    let k = kinds(&recs);
    let big = k.total();
    Some(format!(
        "n {}  TTFT p90 {} ms  small-uncached TTFT p50/p90/p99 {small_q} ms  >={BIG} uncached {big} ({:.3}): {}",
        recs.len(),
        fixed_or_nan(pick(&ttft, 0.9), 1),
        big as f64 / recs.len() as f64,
        k.detail(),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::tests::rec;
    use super::*;

    #[test]
    fn slow_prefills_by_kind_of_turn() {
        let records = vec![
            rec(0, 0.0, Some("a"), "0", 500.0, 1000), // first
            rec(1, 1.0, Some("a"), "0", 400.0, 300),  // stayed
            rec(2, 2.0, Some("a"), "1", 300.0, 300),  // moved_new
            rec(3, 3.0, Some("a"), "2", 10.0, 10),    // small: not counted
            rec(4, 4.0, Some("a"), "0", 350.0, 800),  // moved_back (0 was used before 2)
            rec(5, 5.0, None, "3", 600.0, 2000),      // no_session
            rec(6, 6.0, None, "3", 20.0, 0),          // small
        ];
        let refs: Vec<&Record> = records.iter().collect();
        assert_eq!(
            kinds(&refs),
            Kinds {
                first: 1,
                stayed: 1,
                moved_new: 1,
                moved_back: 1,
                no_session: 1
            }
        );
        let report = RunReport {
            records,
            ..Default::default()
        };
        assert_eq!(
            row(&report).unwrap(),
            "n 7  TTFT p90 600.0 ms  small-uncached TTFT p50/p90/p99 20.0/20.0/20.0 ms  \
             >=256 uncached 5 (0.714): first 1 stayed 1 moved_new 1 moved_back 1 no_session 1"
        );
    }
}
