//! Free loopback ports for the processes of a run.

use std::net::{SocketAddr, TcpListener};

/// A loopback address no one listens on now (the OS's choice of an ephemeral port).
pub fn free_addr() -> Result<SocketAddr, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))
}
