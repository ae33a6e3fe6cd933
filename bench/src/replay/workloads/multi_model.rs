//! A fleet of several models: ShareGPT conversations, each for one model (a base model or a
//! LoRA adapter), drawn with Zipf popularity over the `--models` list in its order, so the
//! first name is the hottest. The draw hangs on the conversation's session id and the seed
//! alone, so every policy of a comparison sees the same mix.
//!
//! Each turn carries the whole history as in `sharegpt`, and the oracle is the same: a model's
//! conversations never share a prefix with another model's, so one infinite cache per model
//! holds exactly what one infinite cache holds.

use super::sharegpt::Conversation;
use crate::replay::rng::mix;

/// Zipf weights `1 / rank^s` over `n` ranks, as cumulative shares ending at 1.
fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let weights: Vec<f64> = (1..=n).map(|r| (r as f64).powf(-s)).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect()
}

/// Gives every conversation its model: `models[rank]`, with rank drawn from Zipf(`s`).
pub fn assign(
    convs: Vec<Conversation>,
    models: &[String],
    s: f64,
    seed: u64,
) -> Result<Vec<Conversation>, String> {
    if models.is_empty() || models.iter().any(String::is_empty) {
        return Err("multi_model needs --models, a list of non-empty model names".into());
    }
    if !(s.is_finite() && s >= 0.0) {
        return Err(format!("--model-zipf must be a number >= 0, got {s}"));
    }
    let cdf = zipf_cdf(models.len(), s);
    Ok(convs
        .into_iter()
        .map(|mut c| {
            let h = c
                .session_id
                .bytes()
                .fold(mix(seed), |h, b| mix(h ^ u64::from(b)));
            let u = (h >> 11) as f64 / (1u64 << 53) as f64;
            let rank = cdf.iter().position(|&c| u < c).unwrap_or(models.len() - 1);
            c.model = Some(models[rank].clone());
            c
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::workloads::sharegpt::{Chat, Turn};

    fn convs(n: usize) -> Vec<Conversation> {
        (0..n)
            .map(|i| Conversation {
                session_id: format!("s{i}"),
                turns: vec![Turn {
                    text: format!("question {i}"),
                    output_length: 4,
                    ..Turn::default()
                }],
                model: None,
                system: None,
                agent: Default::default(),
                tenancy: Default::default(),
            })
            .collect()
    }

    #[test]
    fn popularity_follows_the_list_order_and_the_draw_is_stable() {
        let models: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
        let a = assign(convs(20_000), &models, 1.0, 7).unwrap();
        let count = |m: &str| a.iter().filter(|c| c.model.as_deref() == Some(m)).count() as f64;
        // Zipf(1) over 10 ranks: the first takes 1/H(10) = 34%, the tenth 3.4%.
        let share = count("m0") / 20_000.0;
        assert!((share - 0.341).abs() < 0.02, "{share}");
        let last = count("m9") / 20_000.0;
        assert!((last - 0.034).abs() < 0.01, "{last}");
        assert!(count("m1") > count("m4") && count("m4") > count("m9"));
        // Same ids and seed, same models; another seed, another mix.
        let b = assign(convs(20_000), &models, 1.0, 7).unwrap();
        assert!(a.iter().zip(&b).all(|(x, y)| x.model == y.model));
        let c = assign(convs(20_000), &models, 1.0, 8).unwrap();
        assert!(a.iter().zip(&c).any(|(x, y)| x.model != y.model));
        // s = 0 is uniform.
        let u = assign(convs(20_000), &models, 0.0, 7).unwrap();
        let m9 = u
            .iter()
            .filter(|c| c.model.as_deref() == Some("m9"))
            .count();
        assert!((m9 as f64 / 20_000.0 - 0.1).abs() < 0.015, "{m9}");
    }

    #[test]
    fn every_turn_names_its_conversations_model() {
        let a = assign(convs(3), &["only".to_string()], 1.0, 1).unwrap();
        let mut chat = Chat::new(a[0].clone(), 64);
        assert_eq!(chat.next_request().unwrap().model.as_deref(), Some("only"));
        assert!(assign(convs(1), &[], 1.0, 1).is_err());
        assert!(assign(convs(1), &["".to_string()], 1.0, 1).is_err());
        assert!(assign(convs(1), &["a".to_string()], -1.0, 1).is_err());
    }
}
