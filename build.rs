//! Release builds of the `kvroute` binary place the functions it runs at start-up, at idle and
//! on a request side by side (`link/symbol-order.txt`, written by
//! `bench/scripts/symbol_order.sh`). The kernel maps a binary's code 64 KiB around each page
//! fault, so code touched in scattered places keeps most of the binary resident; packed
//! together it keeps a few windows (docs/results/proxy-cost.md, docs/dev/architecture.md).
//!
//! Only rust-lld, rustc's default linker on x86_64 Linux since 1.90, is asked: GNU ld has no
//! such option. A linker of the builder's choosing, or `KVROUTE_SYMBOL_ORDER=0`, links as
//! before. Names the binary no longer has are skipped, so a stale list costs memory, never a
//! build.

use std::env;
use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=KVROUTE_SYMBOL_ORDER");
    let Ok(dir) = env::var("CARGO_MANIFEST_DIR") else {
        return;
    };
    let order = Path::new(&dir).join("link/symbol-order.txt");
    println!("cargo:rerun-if-changed={}", order.display());
    if order.exists() && rust_lld_links() {
        println!(
            "cargo:rustc-link-arg-bin=kvroute=-Wl,--symbol-ordering-file={}",
            order.display()
        );
        println!("cargo:rustc-link-arg-bin=kvroute=-Wl,--no-warn-symbol-ordering");
    }
}

/// Whether this is a release build for x86_64 Linux that rustc links with its own lld.
fn rust_lld_links() -> bool {
    let var = |k: &str| env::var(k).unwrap_or_default();
    if var("KVROUTE_SYMBOL_ORDER") == "0"
        || var("PROFILE") != "release"
        || var("TARGET") != "x86_64-unknown-linux-gnu"
        || env::var_os("RUSTC_LINKER").is_some()
        // -C linker=..., -C linker-flavor=..., -C link-self-contained=-linker, ...
        || var("CARGO_ENCODED_RUSTFLAGS").contains("link")
    {
        return false;
    }
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let Ok(out) = Command::new(rustc).arg("-V").output() else {
        return false;
    };
    // "rustc 1.95.0 (59807616e 2026-04-14)"
    let version = String::from_utf8_lossy(&out.stdout);
    let minor = version
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.split('.').nth(1))
        .and_then(|m| m.parse::<u32>().ok());
    minor.is_some_and(|m| m >= 90)
}
