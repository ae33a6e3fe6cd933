//! A model's pool: the backends its requests are placed among, with a ring of their own. The
//! decision runs on the pool's part of the fleet snapshot, so its load bound and candidates are
//! the pool's; the chosen backend comes back as a fleet index.

use super::decision::{Decision, Params};
use super::ring::Ring;
use super::snapshot::Snapshot;
use crate::request::RequestProfile;

/// The backends one model is placed among.
pub struct Pool {
    /// Fleet indices, ascending.
    pub members: Vec<usize>,
    /// Their ring; `None` when the pool is the whole fleet (use the fleet's ring).
    pub ring: Option<Ring>,
    /// Some backend's configured or discovered list names the model: it may be a metric label
    /// (any other name is `other`, so clients cannot grow the label set).
    pub listed: bool,
    /// The model is a LoRA adapter (listed with a `parent`).
    pub adapter: bool,
}

impl Pool {
    /// Pool-local index of fleet index `i`.
    pub fn local(&self, i: usize) -> Option<usize> {
        self.members.binary_search(&i).ok()
    }

    /// Fleet index of `key`'s owner in this pool: the first backend of the pool's ring walk
    /// (`fleet_ring`'s for a pool of the whole fleet).
    pub fn owner(&self, fleet_ring: &Ring, key: u64) -> Option<usize> {
        match &self.ring {
            Some(r) => r
                .walk(key, 1)
                .next()
                .and_then(|l| self.members.get(l).copied()),
            None => fleet_ring.walk(key, 1).next(),
        }
    }
}

/// [`super::choose`] among `pool`'s backends of the whole-fleet `snap`; `excluded` and the
/// result are fleet indices.
pub fn choose_in(
    params: &Params,
    profile: &RequestProfile,
    snap: &Snapshot,
    pool: &Pool,
    excluded: &[usize],
    ticket: u64,
) -> Option<Decision> {
    let Some(ring) = &pool.ring else {
        return super::choose(params, profile, snap, excluded, ticket);
    };
    let loads: Vec<_> = pool.members.iter().map(|&i| snap.backends[i]).collect();
    let matched: Vec<u64> = if snap.matched.is_empty() {
        Vec::new()
    } else {
        pool.members.iter().map(|&i| snap.matched[i]).collect()
    };
    let excluded: Vec<usize> = excluded.iter().filter_map(|&i| pool.local(i)).collect();
    let sub = Snapshot {
        backends: &loads,
        ring,
        matched: &matched,
        later_turns: snap.later_turns,
    };
    let mut d = super::choose(params, profile, &sub, &excluded, ticket)?;
    d.backend = pool.members[d.backend];
    Some(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{BackendLoad, PolicyKind};
    use crate::request::{Endpoint, SessionSource};
    use std::net::SocketAddr;

    fn addr(i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 9000 + i as u16))
    }

    #[test]
    fn the_owner_is_the_pools_own_ring_owner() {
        let all: Vec<_> = (0..6).map(|i| (addr(i), 1)).collect();
        let fleet_ring = Ring::new(&all);
        let members = vec![1, 3, 4];
        let own_addrs: Vec<_> = members.iter().map(|&i| (addr(i), 1)).collect();
        let own = Ring::new(&own_addrs);
        let pool = Pool {
            ring: Some(Ring::new(&own_addrs)),
            members: members.clone(),
            listed: true,
            adapter: false,
        };
        let whole = Pool {
            ring: None,
            members: (0..6).collect(),
            listed: true,
            adapter: false,
        };
        for key in 0..50u64 {
            let o = pool.owner(&fleet_ring, key).unwrap();
            assert_eq!(o, members[own.walk(key, 1).next().unwrap()]);
            assert_eq!(
                whole.owner(&fleet_ring, key),
                fleet_ring.walk(key, 1).next()
            );
        }
    }

    #[test]
    fn decisions_stay_in_the_pool_and_map_back_to_fleet_indices() {
        let n = 6;
        let all: Vec<_> = (0..n).map(|i| (addr(i), 1)).collect();
        let fleet_ring = Ring::new(&all);
        let members = vec![1, 3, 4];
        let pool = Pool {
            ring: Some(Ring::new(
                &members.iter().map(|&i| (addr(i), 1)).collect::<Vec<_>>(),
            )),
            members,
            listed: true,
            adapter: false,
        };
        let loads = vec![BackendLoad::idle(); n];
        let snap = Snapshot {
            backends: &loads,
            ring: &fleet_ring,
            matched: &[],
            later_turns: 1.0,
        };
        for policy in [
            PolicyKind::RoundRobin,
            PolicyKind::BoundedHash,
            PolicyKind::KvAware,
        ] {
            let params = Params::new(policy, 0.5, 1);
            for key in 0..200u64 {
                let p = RequestProfile {
                    endpoint: Endpoint::Chat,
                    model: "m".into(),
                    stream: false,
                    include_usage: false,
                    has_stream_options: false,
                    has_handover_fields: false,
                    session_key: key.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    session_source: SessionSource::Content,
                    has_history: false,
                    history_blocks: 0,
                    prefix_blocks: vec![],
                    tail: None,
                    prompt_bytes: 0,
                    est_prompt_tokens: 0,
                    est_output_tokens: 0,
                    cache_salt: None,
                    previous_response_id: None,
                };
                let d = choose_in(&params, &p, &snap, &pool, &[3], key).unwrap();
                assert!(
                    [1, 4].contains(&d.backend),
                    "{policy:?} chose {}",
                    d.backend
                );
            }
        }
    }
}
