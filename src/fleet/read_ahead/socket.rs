//! The read-ahead connection: a TCP socket whose reads are done by a task of its own into a
//! bounded buffer, which Pingora then reads from.
//!
//! Pingora never takes a virtual stream back out of its connection pool (it checks a pooled
//! connection's fd against the peer, and a virtual stream has none), so each [`Socket`] serves
//! one request, and the connector keeps its own pool: a socket dropped after a complete
//! response, every byte of it taken, gives its TCP connection back for the next request.

use async_trait::async_trait;
use bytes::BytesMut;
use pingora::connectors::L4Connect;
use pingora::protocols::l4::socket::SocketAddr;
use pingora::protocols::l4::stream::Stream;
use pingora::protocols::l4::virt::{VirtualSockOpt, VirtualSocket, VirtualSocketStream};
use pingora::{Error, ErrorType};
use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use super::framing::{Framing, Progress};
use super::{take_armed, Limits, OnComplete, BUFFERED};

/// The most one read off the engine's socket takes.
const READ_SIZE: usize = 16 * 1024;
/// Idle connections kept for one engine, and for how long.
const IDLE_PER_ENGINE: usize = 256;
const IDLE_FOR: Duration = Duration::from_secs(60);

/// A kept-alive connection between requests: its write half, and its pump still reading.
struct Idle {
    wr: OwnedWriteHalf,
    shared: Arc<Shared>,
    since: Instant,
}

type IdlePool = Mutex<HashMap<std::net::SocketAddr, Vec<Idle>>>;

/// Connects to plaintext engines as read-ahead connections.
pub struct ReadAhead {
    limits: Limits,
    idle: Arc<IdlePool>,
}

impl std::fmt::Debug for ReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadAhead")
            .field("limits", &self.limits)
            .finish()
    }
}

impl ReadAhead {
    pub(super) fn new(limits: Limits) -> ReadAhead {
        ReadAhead {
            limits,
            idle: Arc::default(),
        }
    }

    /// A kept connection to `addr` still open, if any.
    fn take_idle(&self, addr: std::net::SocketAddr) -> Option<(OwnedWriteHalf, Arc<Shared>)> {
        let mut pool = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let kept = pool.get_mut(&addr)?;
        while let Some(i) = kept.pop() {
            if i.since.elapsed() < IDLE_FOR && i.shared.lock().usable() {
                return Some((i.wr, i.shared));
            }
            i.shared.close();
        }
        None
    }
}

#[async_trait]
impl L4Connect for ReadAhead {
    async fn connect(&self, addr: &SocketAddr) -> pingora::Result<Stream> {
        let Some(inet) = addr.as_inet() else {
            return Error::e_explain(ErrorType::ConnectError, "read-ahead needs a TCP address");
        };
        if let Some((wr, shared)) = self.take_idle(*inet) {
            return Ok(socket(wr, shared, *inet, &self.idle));
        }
        // Pingora applies the peer's connect timeout only to its own connector.
        let tcp = match tokio::time::timeout(self.limits.connect_timeout, TcpStream::connect(*inet))
            .await
        {
            Err(_) => {
                return Error::e_explain(
                    ErrorType::ConnectTimedout,
                    format!(
                        "timeout {:?} connecting to {inet}",
                        self.limits.connect_timeout
                    ),
                )
            }
            Ok(Err(e)) => {
                let kind = match e.kind() {
                    io::ErrorKind::ConnectionRefused => ErrorType::ConnectRefused,
                    _ => ErrorType::ConnectError,
                };
                return Error::e_because(kind, format!("connecting to {inet}"), e);
            }
            Ok(Ok(tcp)) => tcp,
        };
        let (rd, wr) = tcp.into_split();
        let shared = Arc::new(Shared::default());
        tokio::spawn(pump(rd, Arc::clone(&shared), self.limits));
        Ok(socket(wr, shared, *inet, &self.idle))
    }
}

fn socket(
    wr: OwnedWriteHalf,
    shared: Arc<Shared>,
    addr: std::net::SocketAddr,
    idle: &Arc<IdlePool>,
) -> Stream {
    Stream::from(VirtualSocketStream::new(Box::new(Socket {
        wr: Some(wr),
        shared,
        addr,
        idle: Arc::downgrade(idle),
        started: false,
        shut: false,
    })))
}

/// A response being followed for its end.
struct Following {
    framing: Framing,
    on_complete: Option<OnComplete>,
}

#[derive(Default)]
struct Buffered {
    data: BytesMut,
    eof: bool,
    error: Option<io::Error>,
    /// Pingora's read, waiting for bytes.
    reader: Option<Waker>,
    /// The pump waits for its buffer to drain.
    pump_waits: bool,
    /// The connection was dropped: the pump stops.
    closed: bool,
    following: Option<Following>,
    /// The response followed was complete (the connection is at a message boundary).
    complete: bool,
}

impl Buffered {
    /// Whether the connection may carry another request: its last response complete and
    /// taken, and the engine has not closed it.
    fn usable(&self) -> bool {
        !self.closed && !self.eof && self.error.is_none() && self.data.is_empty()
    }
}

#[derive(Default)]
pub(super) struct Shared {
    state: Mutex<Buffered>,
    /// Wakes the pump: room in the buffer, or the connection dropped.
    wake: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Buffered> {
        // A panic elsewhere while holding it leaves plain data, still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cut the connection while its request runs, as if the engine had reset it: its reader
    /// gets an error, the pump stops and the connection is not kept. `false` if it was already
    /// done with (closed, failed or at its end).
    pub(super) fn abort(&self) -> bool {
        let mut b = self.lock();
        if b.closed || b.eof || b.error.is_some() {
            return false;
        }
        b.error = Some(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "cut by kvroute: the engine was found down",
        ));
        b.closed = true;
        BUFFERED.fetch_sub(b.data.len(), Ordering::Relaxed);
        b.data = BytesMut::new();
        let reader = b.reader.take();
        drop(b);
        self.wake.notify_one();
        if let Some(w) = reader {
            w.wake();
        }
        true
    }

    /// Nothing will use the connection again: the pump stops and what it buffered goes.
    fn close(&self) {
        let mut b = self.lock();
        b.closed = true;
        BUFFERED.fetch_sub(b.data.len(), Ordering::Relaxed);
        b.data = BytesMut::new();
        drop(b);
        self.wake.notify_one();
    }
}

/// Whether the pump may read more: its buffer under the per-connection cap and all buffers
/// under the total, or its buffer empty (then it reads no further ahead than Pingora would).
fn has_room(b: &Buffered, limits: &Limits) -> bool {
    b.data.is_empty()
        || (b.data.len() < limits.per_connection && BUFFERED.load(Ordering::Relaxed) < limits.total)
}

/// Reads the engine's socket into the buffer until it closes, fails or the connection is
/// dropped, following armed responses to their end.
async fn pump(mut rd: OwnedReadHalf, shared: Arc<Shared>, limits: Limits) {
    loop {
        loop {
            let woken = shared.wake.notified();
            {
                let mut b = shared.lock();
                if b.closed {
                    return;
                }
                if has_room(&b, &limits) {
                    b.pump_waits = false;
                    break;
                }
                b.pump_waits = true;
            }
            woken.await;
        }
        let mut chunk = BytesMut::with_capacity(READ_SIZE);
        let read = tokio::select! {
            r = rd.read_buf(&mut chunk) => r,
            // Dropped while waiting for the engine: nothing will read what it sends.
            _ = shared.wake.notified() => {
                if shared.lock().closed {
                    return;
                }
                continue;
            }
        };
        let (done, reader) = {
            let mut b = shared.lock();
            if b.closed {
                return;
            }
            let progress = match &read {
                Ok(0) => {
                    b.eof = true;
                    b.following.as_mut().map(|f| f.framing.closed())
                }
                Ok(_) => b.following.as_mut().map(|f| f.framing.feed(&chunk)),
                Err(e) => {
                    b.error = Some(io::Error::new(e.kind(), e.to_string()));
                    None
                }
            };
            let done = match progress {
                Some(Progress::Complete) => {
                    b.complete = true;
                    b.following.take().and_then(|f| f.on_complete)
                }
                Some(Progress::Unknown) => {
                    b.following = None;
                    None
                }
                _ => None,
            };
            if !chunk.is_empty() {
                BUFFERED.fetch_add(chunk.len(), Ordering::Relaxed);
                if b.data.is_empty() {
                    b.data = chunk;
                } else {
                    b.data.extend_from_slice(&chunk);
                }
            }
            (done, b.reader.take())
        };
        if let Some(w) = reader {
            w.wake();
        }
        if let Some(on_complete) = done {
            on_complete();
        }
        if !matches!(read, Ok(n) if n > 0) {
            return;
        }
    }
}

/// Pingora's side of a read-ahead connection, for one request.
struct Socket {
    /// Taken back into the pool on drop.
    wr: Option<OwnedWriteHalf>,
    shared: Arc<Shared>,
    addr: std::net::SocketAddr,
    idle: Weak<IdlePool>,
    /// Its request has started to be written.
    started: bool,
    /// Pingora shut the connection down.
    shut: bool,
}

impl Socket {
    fn wr(&mut self) -> io::Result<&mut OwnedWriteHalf> {
        self.wr
            .as_mut()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "connection returned"))
    }
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadAheadSocket")
            .field("peer", &self.addr)
            .finish()
    }
}

impl VirtualSocket for Socket {
    fn set_socket_option(&self, opt: VirtualSockOpt) -> io::Result<()> {
        match (opt, &self.wr) {
            (VirtualSockOpt::NoDelay, Some(wr)) => wr.as_ref().set_nodelay(true),
            // kvroute sets no keepalive on engine connections.
            _ => Ok(()),
        }
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut b = self.shared.lock();
        if !b.data.is_empty() {
            let n = buf.remaining().min(b.data.len());
            buf.put_slice(&b.data.split_to(n));
            BUFFERED.fetch_sub(n, Ordering::Relaxed);
            let wake_pump = std::mem::take(&mut b.pump_waits);
            drop(b);
            if wake_pump {
                self.shared.wake.notify_one();
            }
            return Poll::Ready(Ok(()));
        }
        if let Some(e) = b.error.take() {
            return Poll::Ready(Err(e));
        }
        // Its response is complete and taken: Pingora's next read is its check of a connection
        // before pooling it, which this answers "closed", so the socket is dropped (and its
        // connection kept in the connector's pool) rather than left in Pingora's pool, where
        // taking it would fail and cost the request a new connection.
        if b.eof || (self.started && b.complete) {
            return Poll::Ready(Ok(()));
        }
        b.reader = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        // Its request starts: follow the response, for the proxy's hook if it armed one.
        if !this.started {
            this.started = true;
            let mut b = this.shared.lock();
            b.complete = false;
            let on_complete = take_armed().map(|armed| {
                armed.link.attach(&this.shared);
                armed.on_complete
            });
            b.following = Some(Following {
                framing: Framing::new(data.starts_with(b"HEAD ")),
                on_complete,
            });
        }
        Pin::new(this.wr()?).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.get_mut().wr()?).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.shut = true;
        Pin::new(this.wr()?).poll_shutdown(cx)
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        let reusable = {
            let mut b = self.shared.lock();
            let ok = self.started && !self.shut && b.complete && b.usable();
            b.following = None;
            b.reader = None;
            ok
        };
        if let (true, Some(wr), Some(pool)) = (reusable, self.wr.take(), self.idle.upgrade()) {
            let mut pool = pool.lock().unwrap_or_else(|p| p.into_inner());
            let kept = pool.entry(self.addr).or_default();
            if kept.len() < IDLE_PER_ENGINE {
                kept.push(Idle {
                    wr,
                    shared: Arc::clone(&self.shared),
                    since: Instant::now(),
                });
                return;
            }
        }
        self.shared.close();
    }
}
