//! The engine connections requests are waiting on, by backend, so that a backend found down has
//! the requests silent on it cut at once, to be retried or continued elsewhere.
//!
//! A hung engine (stopped, deadlocked, its host swapping) keeps its TCP connections open: each
//! request on it would otherwise wait for its own read deadline (`timeouts.first_byte_floor_ms`
//! and up, 30 s by default) before kvroute gives up on it, while the health check has known for
//! a second. Only requests silent for as long as the check's own timeout are cut: a stream still
//! receiving tokens is left alone, whatever the check says.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::read_ahead::Link;

/// How a request's engine connection is cut.
pub enum Conn {
    /// A socket Pingora owns, by its descriptor and the addresses that identify it.
    Socket {
        fd: RawFd,
        local: SocketAddr,
        peer: SocketAddr,
    },
    /// A read-ahead connection, once the request is written to it.
    ReadAhead(Arc<Link>),
}

impl Conn {
    fn cut(&self) -> bool {
        match self {
            Conn::Socket { fd, local, peer } => cut_socket(*fd, *local, *peer),
            Conn::ReadAhead(link) => link.cut(),
        }
    }
}

/// `shutdown(2)` on the socket, only if `fd` still is that connection: the request may have
/// let it go a moment ago, and the descriptor may since name another socket or none.
fn cut_socket(fd: RawFd, local: SocketAddr, peer: SocketAddr) -> bool {
    if fd < 0 {
        return false;
    }
    // SAFETY: nothing is read, written or closed through `fd` before the kernel has said it is
    // still the socket registered: a descriptor closed since fails `getsockname` (EBADF), one
    // reused for another socket has another address pair (a TCP connection's pair is unique
    // while it lives, and this end's port stays in TIME_WAIT after it closes). The borrow ends
    // with this call.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let sock = socket2::SockRef::from(&fd);
    let same = sock.local_addr().ok().and_then(|a| a.as_socket()) == Some(local)
        && sock.peer_addr().ok().and_then(|a| a.as_socket()) == Some(peer);
    same && sock.shutdown(std::net::Shutdown::Both).is_ok()
}

/// Marks a request's state; `DONE` once its response is whole (nothing left to wait for).
const DONE: u64 = u64::MAX;

struct Entry {
    conn: Conn,
    shared: Arc<WatchState>,
}

#[derive(Default)]
struct WatchState {
    /// Milliseconds since the registry's epoch of the request's last sign of life.
    last: AtomicU64,
    cut: AtomicBool,
}

/// Every backend's requests waiting on an engine connection. Outlives fleet generations.
pub struct InFlight {
    epoch: Instant,
    next: AtomicU64,
    by_backend: Mutex<HashMap<SocketAddr, HashMap<u64, Entry>>>,
}

impl Default for InFlight {
    fn default() -> Self {
        InFlight {
            epoch: Instant::now(),
            next: AtomicU64::new(0),
            by_backend: Mutex::default(),
        }
    }
}

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, HashMap<SocketAddr, HashMap<u64, Entry>>> {
        // A panic elsewhere while holding it leaves plain data, still consistent.
        self.by_backend.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// A request now waits on `conn` to `backend`; it is forgotten when the watch drops.
    pub fn watch(self: &Arc<Self>, backend: SocketAddr, conn: Conn) -> Watch {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(WatchState {
            last: AtomicU64::new(self.now_ms()),
            cut: AtomicBool::new(false),
        });
        self.lock().entry(backend).or_default().insert(
            id,
            Entry {
                conn,
                shared: Arc::clone(&shared),
            },
        );
        Watch {
            registry: Arc::clone(self),
            backend,
            id,
            shared,
        }
    }

    /// Cut every request on `backend` that has had nothing from it for `silent_for`: the
    /// number cut.
    pub fn cut_silent(&self, backend: SocketAddr, silent_for: Duration) -> usize {
        let now = self.now_ms();
        let quiet = silent_for.as_millis() as u64;
        let map = self.lock();
        let Some(requests) = map.get(&backend) else {
            return 0;
        };
        let mut cut = 0;
        for e in requests.values() {
            let last = e.shared.last.load(Ordering::Relaxed);
            if last == DONE || now.saturating_sub(last) < quiet {
                continue;
            }
            // Flagged first: the request's reader may see the cut before this returns.
            e.shared.cut.store(true, Ordering::Relaxed);
            if e.conn.cut() {
                cut += 1;
            } else {
                e.shared.cut.store(false, Ordering::Relaxed);
            }
        }
        cut
    }

    /// Requests registered on `backend`.
    #[cfg(test)]
    fn count(&self, backend: SocketAddr) -> usize {
        self.lock().get(&backend).map_or(0, HashMap::len)
    }
}

/// One request's registration, forgotten on drop.
pub struct Watch {
    registry: Arc<InFlight>,
    backend: SocketAddr,
    id: u64,
    shared: Arc<WatchState>,
}

impl Watch {
    /// The engine sent something.
    pub fn progress(&self) {
        let now = self.registry.now_ms();
        // A done request stays done.
        let _ = self
            .shared
            .last
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                (v != DONE).then_some(now)
            });
    }

    /// The engine's response is whole: the connection may go back to a pool, and is never cut.
    pub fn done(&self) {
        self.shared.last.store(DONE, Ordering::Relaxed);
    }

    /// kvroute cut the connection because its backend was found down.
    pub fn was_cut(&self) -> bool {
        self.shared.cut.load(Ordering::Relaxed)
    }

    /// A handle that cuts this request's connection from elsewhere (the other leg of a
    /// disaggregated request failed), without it being read as its backend's failure.
    pub fn cutter(&self) -> Cutter {
        Cutter {
            registry: Arc::clone(&self.registry),
            backend: self.backend,
            id: self.id,
        }
    }
}

/// Cuts one registered request's connection ([`Watch::cutter`]).
pub struct Cutter {
    registry: Arc<InFlight>,
    backend: SocketAddr,
    id: u64,
}

impl Cutter {
    /// Cut the connection unless its response is whole or it is no longer registered; true
    /// if it was cut.
    pub fn cut(&self) -> bool {
        let map = self.registry.lock();
        let Some(e) = map.get(&self.backend).and_then(|r| r.get(&self.id)) else {
            return false;
        };
        e.shared.last.load(Ordering::Relaxed) != DONE && e.conn.cut()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut map = self.registry.lock();
        if let Some(requests) = map.get_mut(&self.backend) {
            requests.remove(&self.id);
            if requests.is_empty() {
                map.remove(&self.backend);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        (c, s)
    }

    fn socket_conn(c: &TcpStream) -> Conn {
        Conn::Socket {
            fd: c.as_raw_fd(),
            local: c.local_addr().expect("local"),
            peer: c.peer_addr().expect("peer"),
        }
    }

    #[test]
    fn a_silent_request_on_a_backend_found_down_is_cut_and_a_live_one_is_not() {
        let reg = Arc::new(InFlight::default());
        let (mut silent, _s1) = pair();
        let (live, _s2) = pair();
        let backend: SocketAddr = "127.0.0.1:9".parse().expect("addr");
        let w_silent = reg.watch(backend, socket_conn(&silent));
        let w_live = reg.watch(backend, socket_conn(&live));
        std::thread::sleep(Duration::from_millis(30));
        w_live.progress();
        assert_eq!(reg.cut_silent(backend, Duration::from_millis(20)), 1);
        assert!(w_silent.was_cut() && !w_live.was_cut());
        // The reader of the cut connection sees it end.
        let mut buf = [0u8; 8];
        assert_eq!(silent.read(&mut buf).expect("read after cut"), 0);
        // Another backend's requests are not touched.
        let other: SocketAddr = "127.0.0.1:10".parse().expect("addr");
        assert_eq!(reg.cut_silent(other, Duration::ZERO), 0);
    }

    #[test]
    fn a_finished_or_dropped_request_is_never_cut() {
        let reg = Arc::new(InFlight::default());
        let (mut c, mut s) = pair();
        let backend: SocketAddr = "127.0.0.1:9".parse().expect("addr");
        let w = reg.watch(backend, socket_conn(&c));
        w.done();
        w.progress();
        assert_eq!(reg.cut_silent(backend, Duration::ZERO), 0);
        drop(w);
        assert_eq!(reg.count(backend), 0);
        // The connection still works both ways.
        s.write_all(b"ok").expect("write");
        let mut buf = [0u8; 2];
        c.read_exact(&mut buf).expect("read");
        assert_eq!(&buf, b"ok");
    }

    #[test]
    fn a_descriptor_that_now_names_another_socket_is_left_alone() {
        let reg = Arc::new(InFlight::default());
        let (c, _s) = pair();
        let (mut other, mut other_peer) = pair();
        let backend: SocketAddr = "127.0.0.1:9".parse().expect("addr");
        // Registered with `other`'s descriptor but `c`'s addresses: as if `c` had closed and
        // its number been reused.
        let w = reg.watch(
            backend,
            Conn::Socket {
                fd: other.as_raw_fd(),
                local: c.local_addr().expect("local"),
                peer: c.peer_addr().expect("peer"),
            },
        );
        assert_eq!(reg.cut_silent(backend, Duration::ZERO), 0);
        assert!(!w.was_cut());
        other_peer.write_all(b"ok").expect("write");
        let mut buf = [0u8; 2];
        other
            .read_exact(&mut buf)
            .expect("the other socket still reads");
        // A descriptor closed since is no socket at all.
        let w2 = reg.watch(
            backend,
            Conn::Socket {
                fd: 1_000_000,
                local: c.local_addr().expect("local"),
                peer: c.peer_addr().expect("peer"),
            },
        );
        assert_eq!(reg.cut_silent(backend, Duration::ZERO), 0);
        drop((w, w2));
    }
}
