//! What the TLS listener keeps between handshakes, through real processes: the OCSP response it
//! staples (checked by `-t`, replaced on SIGHUP) and the session ticket keys it rotates.

mod common;

use common::certs::{write_pair, Ca, Role};
use common::*;
use openssl::ssl::{SslConnector, SslMethod, SslSession, SslVerifyMode, SslVersion};
use openssl::x509::X509;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvroute-tlss-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).expect("dir");
    d
}

/// A server certificate `serial` from `ca`, written with `ca` after it (the issuer stapling
/// needs) or alone.
fn write_leaf(ca: &Ca, dir: &Path, serial: u32, with_issuer: bool) -> X509 {
    let (leaf, key) = ca.issue(Role::Server, serial, -60, 86_000);
    let mut chain = leaf.to_pem().expect("pem");
    if with_issuer {
        chain.extend(ca.pem());
    }
    write_pair(dir, &chain, &key);
    leaf
}

fn tls_yaml(tls: SocketAddr, dir: &Path, more: &str) -> String {
    format!(
        "  tls:\n    listen: \"{tls}\"\n    cert: {d}/cert.pem\n    key: {d}/key.pem\n{more}",
        d = dir.display()
    )
}

fn tls_addr() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().expect("addr")
}

/// `kvroute -t` on the certificate in `dir` with `ocsp` as its OCSP response: exit code and
/// stderr.
fn check(dir: &Path, ocsp: &Path) -> (i32, String) {
    let conf = dir.join("check.yaml");
    let yaml = format!(
        "kvroute:\n{}  backends:\n    - addr: \"127.0.0.1:2\"\n",
        tls_yaml(
            "127.0.0.1:1".parse().expect("addr"),
            dir,
            &format!("    ocsp_response: {}\n", ocsp.display())
        )
    );
    std::fs::write(&conf, yaml).expect("write");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["-t", "-c"])
        .arg(&conf)
        .output()
        .expect("run kvroute -t");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Handshake asking for the certificate's status: the OCSP response stapled, if any.
fn stapled(tls: SocketAddr) -> Option<Vec<u8>> {
    let seen: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
    let mut c = SslConnector::builder(SslMethod::tls()).expect("connector");
    c.set_verify(SslVerifyMode::NONE);
    let keep = Arc::clone(&seen);
    c.set_status_callback(move |ssl| {
        if let Ok(mut s) = keep.lock() {
            *s = ssl.ocsp_status().map(<[u8]>::to_vec);
        }
        Ok(true)
    })
    .expect("status callback");
    let mut config = c.build().configure().expect("configure");
    config
        .set_status_type(openssl::ssl::StatusType::OCSP)
        .expect("status request");
    let tcp = TcpStream::connect(tls).expect("connect");
    let _s = config.connect("localhost", tcp).expect("handshake");
    let got = seen.lock().expect("lock").clone();
    got
}

#[test]
fn config_test_refuses_an_ocsp_response_that_cannot_be_stapled() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("check");
    let leaf = write_leaf(&ca, &dir, 31, true);
    let good = ca.write_ocsp_response(&dir, "good.der", &leaf, false, 60);
    assert_eq!(check(&dir, &good).0, 0, "{}", check(&dir, &good).1);

    let (other, _) = ca.issue(Role::Server, 32, -60, 86_000);
    let foreign = ca.write_ocsp_response(&dir, "foreign.der", &other, false, 60);
    let (code, err) = check(&dir, &foreign);
    assert_ne!(code, 0);
    assert!(
        err.contains("foreign.der") && err.contains("not about the certificate"),
        "{err}"
    );

    let revoked = ca.write_ocsp_response(&dir, "revoked.der", &leaf, true, 60);
    let (code, err) = check(&dir, &revoked);
    assert_ne!(code, 0);
    assert!(err.contains("revoked"), "{err}");

    std::fs::write(dir.join("garbage.der"), b"not DER").expect("write");
    let (code, err) = check(&dir, &dir.join("garbage.der"));
    assert_ne!(code, 0);
    assert!(err.contains("not a DER OCSP response"), "{err}");

    // Without the issuer in the chain file, the response cannot be matched to the leaf.
    write_leaf(&ca, &dir, 31, false);
    let (code, err) = check(&dir, &good);
    assert_ne!(code, 0);
    assert!(err.contains("issuer"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_ocsp_response_is_stapled_and_replaced_on_reload() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("staple");
    let leaf = write_leaf(&ca, &dir, 41, true);
    let ocsp = ca.write_ocsp_response(&dir, "ocsp.der", &leaf, false, 120);
    let first = std::fs::read(&ocsp).expect("read");
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let tls = tls_addr();
    let k = Kvroute::start(
        &[sim.addr],
        &tls_yaml(
            tls,
            &dir,
            &format!("    ocsp_response: {}\n", ocsp.display()),
        ),
    );
    assert_eq!(stapled(tls).as_deref(), Some(&first[..]));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let next = k.metric_sum("kvroute_tls_ocsp_next_update_timestamp_seconds", &[]);
    assert!(
        (next - (now + 7200.0)).abs() < 120.0,
        "nextUpdate {next}, now {now}"
    );

    // A renewed certificate with its own response: new handshakes staple the new one.
    let renewed = write_leaf(&ca, &dir, 42, true);
    ca.write_ocsp_response(&dir, "ocsp.der", &renewed, false, 240);
    let second = std::fs::read(&ocsp).expect("read");
    assert_ne!(first, second);
    signal(k.pid(), "HUP");
    k.metrics_when(
        "kvroute_config_reloads_total",
        &[("result", "success")],
        1.0,
    );
    assert_eq!(stapled(tls).as_deref(), Some(&second[..]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TLS 1.2 handshake (the session, ticket included, is known when it completes) resuming
/// `session` if given: the session to resume next time, and whether this one was resumed.
fn handshake(tls: SocketAddr, session: Option<&SslSession>) -> (SslSession, bool) {
    let mut c = SslConnector::builder(SslMethod::tls()).expect("connector");
    c.set_verify(SslVerifyMode::NONE);
    c.set_max_proto_version(Some(SslVersion::TLS1_2))
        .expect("tls 1.2");
    let mut config = c.build().configure().expect("configure");
    if let Some(s) = session {
        // SAFETY: the session comes from a connector of the same settings.
        unsafe { config.set_session(s) }.expect("set session");
    }
    let tcp = TcpStream::connect(tls).expect("connect");
    let mut s = config.connect("localhost", tcp).expect("handshake");
    let session = s.ssl().session().expect("a session").to_owned();
    let resumed = s.ssl().session_reused();
    // Closed cleanly: OpenSSL marks the session of a connection dropped without close_notify
    // not resumable.
    let _ = s.shutdown();
    (session, resumed)
}

#[test]
fn sessions_resume_until_their_ticket_keys_rotate() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("tickets");
    write_leaf(&ca, &dir, 51, true);
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let tls = tls_addr();
    let k = Kvroute::start(
        &[sim.addr],
        &tls_yaml(tls, &dir, "    ticket_key_rotation_seconds: 2\n"),
    );
    let (first, resumed) = handshake(tls, None);
    assert!(!resumed);
    let (_, resumed) = handshake(tls, Some(&first));
    assert!(resumed, "a fresh session was not resumed");

    std::thread::sleep(Duration::from_millis(2_300));
    let (second, resumed) = handshake(tls, Some(&first));
    assert!(!resumed, "a session from before the rotation was resumed");
    assert_eq!(
        k.metric_sum("kvroute_tls_ticket_key_rotations_total", &[]),
        1.0
    );
    let (_, resumed) = handshake(tls, Some(&second));
    assert!(resumed, "a session under the new keys was not resumed");
    let _ = std::fs::remove_dir_all(&dir);
}
