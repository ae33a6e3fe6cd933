//! The floor of `bench/scripts/overhead.sh`: a Pingora proxy that does nothing but forward to
//! one upstream over a kept-alive connection pool, with Pingora's own HTTP/1 service. What
//! kvroute costs beyond this is kvroute's; below it is the framework's.
//!
//!   cargo run --release --example bare_pingora -- CONF.yaml LISTEN UPSTREAM
//!
//! CONF.yaml holds Pingora's server keys (`threads`, `pid_file`, ...).

use async_trait::async_trait;
use pingora::prelude::HttpPeer;
use pingora::proxy::{ProxyHttp, Session};
use pingora::server::configuration::Opt;
use pingora::server::Server;

struct Bare {
    upstream: String,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut (),
    ) -> pingora::Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(
            self.upstream.as_str(),
            false,
            String::new(),
        )))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, conf, listen, upstream] = &args[..] else {
        eprintln!("usage: bare_pingora CONF.yaml LISTEN UPSTREAM");
        std::process::exit(2);
    };
    let opt = Opt {
        conf: Some(conf.clone()),
        ..Opt::default()
    };
    let mut server = match Server::new(Some(opt)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bare_pingora: {e}");
            std::process::exit(1);
        }
    };
    server.bootstrap();
    let mut proxy = pingora::proxy::http_proxy_service(
        &server.configuration,
        Bare {
            upstream: upstream.clone(),
        },
    );
    proxy.add_tcp(listen);
    server.add_service(proxy);
    server.run_forever();
}
