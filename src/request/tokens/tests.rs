use super::tables::tests::rank_file;
use super::*;
use std::path::PathBuf;

const LIMIT: usize = 4096;

fn limits(inline: usize, offthread: usize) -> CountLimits {
    CountLimits { inline, offthread }
}

/// A directory of this test's own, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("kvroute-tokens-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn routing(tokenizer: &str, inline: usize, offthread: usize) -> RoutingConfig {
    RoutingConfig {
        tokenizer: tokenizer.into(),
        count_tokens_max_bytes: inline,
        count_tokens_offthread_max_bytes: offthread,
        ..RoutingConfig::default()
    }
}

#[test]
fn counts_small_prompts_and_sizes_large_ones() {
    let t = TokenEstimator::default();
    // Before the tables load: by size.
    let e = t.estimate("m", Some(b"hello world"), 11, LIMIT);
    assert_eq!((e.tokens, e.counted, e.method), (3, None, Method::Sized));
    t.warm_now();
    let e = t.estimate("m", Some(b"hello world"), 11, LIMIT);
    assert_eq!(
        (e.tokens, e.counted, e.method),
        (2, Some(2), Method::Counted)
    );
    // Over the inline limit: by size even with the tables in.
    let big = vec![b'a'; 8192];
    let e = t.estimate("m", Some(&big), big.len(), LIMIT);
    assert_eq!((e.tokens, e.counted), (2048, None));
}

#[test]
fn engine_reports_correct_both_paths_per_model() {
    let t = TokenEstimator::default();
    t.warm_now();
    let text = "the quick brown fox jumps over the lazy dog ".repeat(20);
    let small = t.estimate("m", Some(text.as_bytes()), text.len(), LIMIT);
    let counted = small.counted.unwrap();
    // This engine's tokenizer gives 30% more tokens than o200k and 3 bytes a token.
    let big = t.estimate("m", None, 30_000, LIMIT);
    for _ in 0..200 {
        t.learn("m", &small, (counted as f64 * 1.3).round() as u64);
        t.learn("m", &big, 10_000);
    }
    let again = t.estimate("m", Some(text.as_bytes()), text.len(), LIMIT);
    let want = counted as f64 * 1.3;
    assert!(
        (again.tokens as f64 / want - 1.0).abs() < 0.03,
        "{again:?} vs {want}"
    );
    let big = t.estimate("m", None, 30_000, LIMIT);
    // Both kinds of report move the per-byte ratio; it ends between them, near 1/3.
    assert!((big.tokens as f64 / 10_000.0 - 1.0).abs() < 0.35, "{big:?}");
    // Another model is untouched.
    assert_eq!(t.estimate("other", None, 400, LIMIT).tokens, 100);
}

#[test]
fn nonsense_reports_change_nothing() {
    let t = TokenEstimator::default();
    t.warm_now();
    let e = t.estimate("m", Some(b"abcd"), 4, 0);
    assert_eq!(e.counted, None, "counting is off");
    t.learn("m", &e, 0);
    t.learn("m", &TokenEstimate { bytes: 0, ..e }, 10);
    assert_eq!(t.estimate("m", None, 400, LIMIT).tokens, 100);
}

#[tokio::test]
async fn long_prompts_are_counted_off_thread_and_corrected_alike() {
    let t = TokenEstimator::new(1, None);
    t.warm_now();
    let text = "Prefix caching keeps attention state across turns. ".repeat(400);
    let n = text.len();
    assert!(n > 8192);
    let inline = t.estimate("m", Some(text.as_bytes()), n, n);
    let off = t
        .count("m", text.clone().into_bytes(), n, limits(8192, 1 << 20))
        .await;
    assert_eq!(off.method, Method::CountedOffthread);
    assert_eq!(
        off.counted, inline.counted,
        "the same count, another thread"
    );
    // Past the off-thread limit: sized.
    let sized = t
        .count("m", text.clone().into_bytes(), n, limits(8192, 8192))
        .await;
    assert_eq!(
        (sized.method, sized.tokens),
        (Method::Sized, n.div_ceil(4) as u64)
    );
    // Short prompts stay inline.
    let short = t
        .count("m", b"hello world".to_vec(), 11, limits(8192, 1 << 20))
        .await;
    assert_eq!((short.method, short.counted), (Method::Counted, Some(2)));

    // Off-thread counts teach the same correction the inline ones use.
    let counted = off.counted.unwrap();
    for _ in 0..200 {
        t.learn("m", &off, counted * 2);
    }
    let again = t.estimate("m", Some(b"hello world"), 11, LIMIT);
    assert_eq!(again.tokens, 4, "{again:?}");
}

#[tokio::test]
async fn busy_slots_size_the_prompt_and_are_counted() {
    let registry = Registry::new();
    let t = TokenEstimator::new(1, Some(TokenMetrics::register(&registry).unwrap()));
    t.warm_now();
    let text = vec![b'x'; 10_000];
    let held = t.offthread.clone().try_acquire_owned().unwrap();
    let e = t
        .count("m", text.clone(), text.len(), limits(8192, 1 << 20))
        .await;
    assert_eq!((e.method, e.tokens), (Method::Sized, 2500));
    drop(held);
    let e = t
        .count("m", text.clone(), text.len(), limits(8192, 1 << 20))
        .await;
    assert_eq!(e.method, Method::CountedOffthread);
    let m = t.metrics.as_ref().unwrap();
    assert_eq!((m.busy.get(), m.counted.get(), m.failed.get()), (1, 1, 0));
    assert_eq!(m.wait.get_sample_count(), 1);
    assert_eq!(m.loaded.get(), 1);
    assert_eq!(t.offthread.available_permits(), 1, "the slot came back");
}

#[tokio::test]
async fn tables_follow_the_config_across_reloads() {
    let dir = TempDir::new("reload");
    let path = dir.0.join("tiny.tiktoken");
    std::fs::write(&path, rank_file(&["he", "ll", "hell", "hello"])).unwrap();
    let file = path.display().to_string();
    let t = TokenEstimator::new(1, None);

    // Counting off: nothing loads, nothing is kept for counting.
    t.start(&routing("o200k_base", 0, 0)).unwrap();
    t.load_pending();
    assert!(t.tables.load().is_none());
    assert_eq!(t.limits(&RoutingConfig::default()).text(), 0);

    // A reload turning counting on with a rank file loads it.
    let cfg = routing(&file, 8192, 1 << 20);
    let p = t.prepare(&cfg).await.unwrap();
    assert!(t.tables.load().is_none(), "nothing changes before apply");
    t.apply(p);
    assert_eq!(t.limits(&cfg).text(), 1 << 20);
    let old = t.estimate("m", Some(b"hello"), 5, LIMIT);
    assert_eq!(old.counted, Some(1));
    for _ in 0..200 {
        t.learn("m", &old, 3);
    }
    assert_eq!(t.estimate("m", Some(b"hello"), 5, LIMIT).tokens, 3);
    // The same file again: nothing to do.
    assert!(t.prepare(&cfg).await.unwrap().0.is_none());

    // A broken file is refused and the tables in use stay.
    let broken = dir.0.join("broken.tiktoken");
    std::fs::write(&broken, "AA== 0\nnot base64! 1\n").unwrap();
    let e = t
        .prepare(&routing(&broken.display().to_string(), 8192, 0))
        .await
        .err()
        .unwrap();
    assert!(
        e.reason.contains("line 2") && e.reason.contains("broken.tiktoken"),
        "{e}"
    );
    assert_eq!(t.estimate("m", Some(b"hello"), 5, LIMIT).tokens, 3);

    // The file changes on disk: the reload reads it, and the correction learned against the
    // old tables no longer applies; a count from the old tables teaches nothing.
    std::fs::write(&path, rank_file(&["he", "ll", "hell"])).unwrap();
    let p = t.prepare(&cfg).await.unwrap();
    assert!(p.0.is_some(), "changed on disk");
    t.apply(p);
    let now = t.estimate("m", Some(b"hello"), 5, LIMIT);
    assert_eq!((now.counted, now.tokens), (Some(2), 2));
    t.learn("m", &old, 30);
    assert_eq!(t.estimate("m", Some(b"hello"), 5, LIMIT).tokens, 2);

    // Counting turned off again drops the tables.
    let p = t.prepare(&routing(&file, 0, 0)).await.unwrap();
    t.apply(p);
    assert!(t.tables.load().is_none());
    assert_eq!(
        t.estimate("m", Some(b"hello"), 5, LIMIT).method,
        Method::Sized
    );
}

#[test]
fn a_bad_rank_file_stops_the_start() {
    let dir = TempDir::new("start");
    let path = dir.0.join("short.tiktoken");
    std::fs::write(&path, "AA== 0\n").unwrap();
    let t = TokenEstimator::default();
    let e = t
        .start(&routing(&path.display().to_string(), 8192, 0))
        .unwrap_err();
    assert_eq!(e.key, "kvroute.routing.tokenizer");
    assert!(e.reason.contains("no rank for the single byte 0x01"), "{e}");
    // The same file, but counting off: it is never read.
    t.start(&routing(&path.display().to_string(), 0, 0))
        .unwrap();
}

#[test]
fn o200k_loads_once_the_process_runs_unless_a_reload_moved_on() {
    let t = TokenEstimator::default();
    t.start(&routing("o200k_base", 8192, 1 << 20)).unwrap();
    assert!(t.tables.load().is_none(), "noted, not loaded");
    t.load_pending();
    assert_eq!(
        t.estimate("m", Some(b"hello world"), 11, LIMIT).counted,
        Some(2)
    );

    // A reload turned counting off before the load ran: it loads nothing.
    let t = TokenEstimator::default();
    t.start(&routing("o200k_base", 8192, 1 << 20)).unwrap();
    t.install(None, None);
    t.load_pending();
    assert!(t.tables.load().is_none());
}
