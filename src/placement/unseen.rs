//! Turns of a conversation that another kvroute placed.
//!
//! Replicas share no state: each knows only the turns it placed. A turn whose previous prompt
//! this kvroute never sent anywhere (every match it knows ends short of that prompt) was
//! placed by another replica, which walks the same ring and so most likely sent it to the
//! key's owner. Believing that keeps the replicas on one backend per conversation. Without it
//! a replica follows its own older, shorter match, and after one spill the conversation
//! alternates between two backends, each turn prefilling two turns of text instead of one.

/// Credit `owner` (the key's owner, fleet index) with `history_tokens` (the previous turn's
/// prompt) when no backend is believed to hold that much of it. A backend followed through
/// its engine's events is known, not believed: where any is, the matches stand as they are.
pub fn credit_unseen_history(
    matched: &mut [u64],
    exact: &[bool],
    owner: Option<usize>,
    history_tokens: u64,
) {
    if history_tokens == 0 || exact.iter().any(|&e| e) {
        return;
    }
    if matched.iter().any(|&m| m >= history_tokens) {
        return;
    }
    if let Some(m) = owner.and_then(|o| matched.get_mut(o)) {
        *m = history_tokens;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Ring;

    fn ring(n: usize) -> Ring {
        let v: Vec<(std::net::SocketAddr, u32)> = (0..n)
            .map(|i| (([127, 0, 0, 1], 9100 + i as u16).into(), 1))
            .collect();
        Ring::new(&v)
    }

    #[test]
    fn history_no_match_reaches_is_credited_to_the_owner() {
        let r = ring(4);
        let key = 99;
        let order: Vec<usize> = r.walk(key, 4).collect();
        // This replica placed turn 1 on a spill target; turn 2 went through another replica.
        let mut matched = vec![0u64; 4];
        matched[order[1]] = 300;
        credit_unseen_history(&mut matched, &[false; 4], r.walk(key, 1).next(), 500);
        assert_eq!(matched[order[0]], 500);
        assert_eq!(
            matched[order[1]], 300,
            "what this replica sent stays as it was"
        );
    }

    #[test]
    fn a_match_that_covers_the_history_is_left_alone() {
        let r = ring(4);
        let key = 99;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut matched = vec![0u64; 4];
        matched[order[2]] = 500;
        let before = matched.clone();
        credit_unseen_history(&mut matched, &[false; 4], r.walk(key, 1).next(), 500);
        assert_eq!(matched, before);
    }

    #[test]
    fn engine_events_or_no_history_leave_the_matches_alone() {
        let r = ring(4);
        let key = 7;
        let mut matched = vec![0u64, 100, 0, 0];
        let mut exact = [false; 4];
        exact[1] = true;
        credit_unseen_history(&mut matched, &exact, r.walk(key, 1).next(), 500);
        assert_eq!(matched, [0, 100, 0, 0]);
        credit_unseen_history(&mut matched, &[false; 4], r.walk(key, 1).next(), 0);
        assert_eq!(matched, [0, 100, 0, 0]);
    }
}
