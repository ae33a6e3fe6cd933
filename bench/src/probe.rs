//! `kvbench probe slow-readers`: the slow-reader attack on a proxy's edge. HTTP/2 (h2c)
//! connections that advertise a zero flow-control window keep streams open whose responses
//! they never read: each is a real chat request the proxy places on a backend, whose DATA the
//! proxy can never send. A stream that ends (cut by the proxy's write timeout, or refused) is
//! replaced at once, so the attacker holds `--conns` x `--streams` streams for `--duration-s`.
//! A connection the proxy closes is opened again. Prints one JSON line: streams opened, and
//! how they ended (and `connections`: how many were opened).

use bytes::Bytes;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct ProbeArgs {
    #[command(subcommand)]
    pub probe: Probe,
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum Probe {
    /// Zero-window HTTP/2 streams held open (h2c, prior knowledge).
    SlowReaders(SlowReaders),
}

#[derive(clap::Args, Debug, Clone)]
pub struct SlowReaders {
    /// The proxy's plaintext listener with h2c on (loopback only).
    #[arg(long)]
    pub target: SocketAddr,
    #[arg(long, default_value_t = 10)]
    pub conns: usize,
    /// Streams each connection keeps open.
    #[arg(long, default_value_t = 128)]
    pub streams: usize,
    #[arg(long, default_value_t = 60)]
    pub duration_s: u64,
    #[arg(long, default_value = "sim-llama-8b")]
    pub model: String,
    /// Each request's `max_tokens` (its response is streamed).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
}

/// How the attack's streams went, by outcome.
#[derive(Default)]
struct Tally {
    opened: u64,
    outcomes: BTreeMap<String, u64>,
}

pub async fn run(args: ProbeArgs) -> Result<(), String> {
    let Probe::SlowReaders(a) = args.probe;
    if !a.target.ip().is_loopback() {
        return Err(format!("--target {} is not a loopback address", a.target));
    }
    let tally = Arc::new(Mutex::new(Tally::default()));
    let until = Instant::now() + Duration::from_secs(a.duration_s);
    let mut conns = Vec::new();
    for c in 0..a.conns {
        conns.push(tokio::spawn(hold_connection(
            a.clone(),
            c,
            until,
            Arc::clone(&tally),
        )));
    }
    for c in conns {
        if let Ok(Err(e)) = c.await {
            count(&tally, &format!("connection failed: {e}"));
        }
    }
    let t = tally.lock().map_err(|_| "tally poisoned")?;
    let out = serde_json::json!({
        "probe": "slow-readers", "conns": a.conns, "streams": a.streams,
        "duration_s": a.duration_s, "opened": t.opened, "outcomes": t.outcomes,
    });
    println!("{out}");
    Ok(())
}

fn count(tally: &Mutex<Tally>, outcome: &str) {
    if let Ok(mut t) = tally.lock() {
        *t.outcomes.entry(outcome.to_string()).or_default() += 1;
    }
}

/// Keeps one connection's streams open until `until`, reconnecting when the proxy closes it.
async fn hold_connection(
    a: SlowReaders,
    conn: usize,
    until: Instant,
    tally: Arc<Mutex<Tally>>,
) -> Result<(), String> {
    let mut next = 0usize;
    while Instant::now() < until {
        count(&tally, "connections");
        let tcp = tokio::net::TcpStream::connect(a.target)
            .await
            .map_err(|e| e.to_string())?;
        let (client, connection) = h2::client::Builder::new()
            .initial_window_size(0)
            .handshake::<_, Bytes>(tcp)
            .await
            .map_err(|e| e.to_string())?;
        let driver = tokio::spawn(connection);
        let mut streams = tokio::task::JoinSet::new();
        let mut closed = false;
        while Instant::now() < until && !closed {
            while streams.len() < a.streams {
                let body = serde_json::json!({
                    "model": a.model, "stream": true, "max_tokens": a.max_tokens,
                    "messages": [{"role": "user", "content": format!("slow reader {conn}.{next}")}],
                });
                next += 1;
                streams.spawn(hold_stream(
                    client.clone(),
                    a.target,
                    body.to_string(),
                    until,
                ));
            }
            let left = until.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, streams.join_next()).await {
                Ok(Some(Ok(ended))) => closed = record(&tally, ended),
                Ok(Some(Err(e))) => count(&tally, &format!("task failed: {e}")),
                Ok(None) | Err(_) => break,
            }
        }
        // Whatever is still open was held to the end (or is told the connection closed).
        while let Some(r) = streams.join_next().await {
            if let Ok(ended) = r {
                record(&tally, ended);
            }
        }
        drop(client);
        driver.abort();
    }
    Ok(())
}

/// Counts one stream's end; whether it says the connection is closed.
fn record(tally: &Mutex<Tally>, (opened, outcome): (bool, String)) -> bool {
    if let Ok(mut t) = tally.lock() {
        t.opened += u64::from(opened);
    }
    let closed = outcome == CLOSED;
    if !closed {
        count(tally, &outcome);
    }
    closed
}

const CLOSED: &str = "connection closed";

/// One stream: its request sent whole, its response's head read, its body never read.
/// (whether it was opened, how it ended).
async fn hold_stream(
    client: h2::client::SendRequest<Bytes>,
    target: SocketAddr,
    body: String,
    until: Instant,
) -> (bool, String) {
    let Ok(mut ready) = client.ready().await else {
        return (false, CLOSED.into());
    };
    let request = http::Request::post(format!("http://{target}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(())
        .expect("a constant request head");
    let (response, mut send) = match ready.send_request(request, false) {
        Ok(x) => x,
        Err(e) => return (false, format!("refused: {}", reason(&e))),
    };
    if let Err(e) = send.send_data(Bytes::from(body), true) {
        return (true, format!("reset while sending: {}", reason(&e)));
    }
    let left = until.saturating_duration_since(Instant::now());
    let head = match tokio::time::timeout(left, response).await {
        Err(_) => return (true, "held, no head".into()),
        Ok(Err(e)) => return (true, format!("reset before the head: {}", reason(&e))),
        Ok(Ok(h)) => h,
    };
    let status = head.status().as_u16();
    if status != 200 {
        return (true, format!("answered {status}"));
    }
    let mut recv = head.into_body();
    // Never release capacity: wait for the proxy to give up on the stream, or the end.
    let left = until.saturating_duration_since(Instant::now());
    match tokio::time::timeout(left, recv.data()).await {
        Err(_) => (true, "held to the end".into()),
        Ok(None) => (true, "ended".into()),
        Ok(Some(Ok(_))) => (true, "sent data past a zero window".into()),
        Ok(Some(Err(e))) => (true, format!("cut: {}", reason(&e))),
    }
}

fn reason(e: &h2::Error) -> String {
    e.reason()
        .map_or_else(|| e.to_string(), |r| format!("{r:?}"))
}
