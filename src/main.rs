//! `kvroute -c FILE [-t] [-u] [-d]`: Pingora's command line, kvroute's config.

// Per-request buffers, parsed JSON and the engine tokenizer's small strings are allocation-bound:
// see Cargo.toml for what mimalloc measured against glibc's malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    kvroute::server::run(pingora::server::configuration::Opt::parse_args());
}
