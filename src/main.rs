//! `kvroute -c FILE [-t] [-u] [-d]`: Pingora's command line, kvroute's config.

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    kvroute::server::run(pingora::server::configuration::Opt::parse_args());
}
