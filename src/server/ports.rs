//! The listen addresses are checked before Pingora takes them. Pingora retries a taken address
//! for 30 s and then panics the service's thread, which leaves a process that neither serves on
//! that address nor exits, even on SIGTERM, and that systemd counts as running. kvroute instead
//! exits at start with the address and the config key that names it.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

/// How long an address taken by a process that is still going away (a restart) may stay taken.
const WAIT: Duration = Duration::from_secs(5);
const STEP: Duration = Duration::from_millis(250);

/// Every `(config key, address)` can be bound, each within [`WAIT`]; else which one cannot, why.
pub(super) fn check_free(addrs: &[(&str, &str)]) -> Result<(), String> {
    for (key, addr) in addrs {
        let resolved: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| format!("{key} {addr}: {e}"))?
            .collect();
        for a in resolved {
            let deadline = Instant::now() + WAIT;
            let mut warned = false;
            loop {
                match try_bind(a) {
                    Ok(()) => break,
                    Err(e)
                        if e.kind() == std::io::ErrorKind::AddrInUse
                            && Instant::now() < deadline =>
                    {
                        if !warned {
                            warned = true;
                            log::warn!(
                                "{key} {a} is in use; trying again for up to {} s",
                                WAIT.as_secs()
                            );
                        }
                        std::thread::sleep(STEP);
                    }
                    Err(e) => {
                        let hint = match e.kind() {
                            std::io::ErrorKind::AddrInUse => {
                                " (is another kvroute running? `kvroute -u` takes over a running one's listeners)"
                            }
                            std::io::ErrorKind::PermissionDenied => {
                                " (ports below 1024 need CAP_NET_BIND_SERVICE)"
                            }
                            _ => "",
                        };
                        return Err(format!("{key}: cannot listen on {a}: {e}{hint}"));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Bind as Pingora will (address reuse on, so connections of a previous process in TIME_WAIT do
/// not count) and let go at once.
fn try_bind(a: SocketAddr) -> std::io::Result<()> {
    let socket = match a {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_address_passes_and_a_taken_one_is_named() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let taken = held.local_addr().expect("addr").to_string();
        assert_eq!(
            check_free(&[("kvroute.admin_listen", "127.0.0.1:0")]),
            Ok(())
        );
        let started = Instant::now();
        let e = check_free(&[("kvroute.listen", &taken)]).expect_err("taken");
        assert!(started.elapsed() >= WAIT, "waited for it first");
        assert!(
            e.starts_with(&format!("kvroute.listen: cannot listen on {taken}")),
            "{e}"
        );
        assert!(e.contains("another kvroute"), "{e}");
        let e = check_free(&[("kvroute.listen", "127.0.0.1")]).expect_err("no port");
        assert!(e.starts_with("kvroute.listen 127.0.0.1: "), "{e}");
    }
}
