//! OCSP stapling: the response the operator fetched for the leaf certificate, checked before it
//! is served and sent to the clients that ask for it (`status_request`), so they need not ask
//! the CA themselves (a round trip, and a leak of which site they visit).
//!
//! kvroute does not fetch responses itself: that would make the edge a client of the CA's
//! responder on the handshake path. The operator fetches them (`openssl ocsp`, a timer unit) and
//! reloads, as HAProxy's `.ocsp` files and nginx's `ssl_stapling_file` work.

use openssl::asn1::{Asn1GeneralizedTimeRef, Asn1Time};
use openssl::hash::MessageDigest;
use openssl::ocsp::{OcspCertId, OcspCertStatus, OcspResponse, OcspResponseStatus};
use openssl::x509::X509Ref;
use std::path::Path;

use super::{read, tls_err, unix_time, TlsError};

/// Slack for clocks that disagree with the responder's.
const CLOCK_SKEW_SECONDS: u32 = 300;

/// A checked OCSP response, ready to staple.
pub(super) struct Staple {
    pub der: Vec<u8>,
    /// Unix time after which the response must no longer be sent; `None` when the responder
    /// set no `nextUpdate` (fresh until replaced).
    pub next_update: Option<i64>,
}

impl Staple {
    /// Whether the response may still be sent at `now`: a client that checks it would fail a
    /// handshake over a stale one, so past its `nextUpdate` none is sent.
    pub fn current(&self, now: i64) -> bool {
        self.next_update
            .is_none_or(|t| now <= t + i64::from(CLOCK_SKEW_SECONDS))
    }
}

/// Read the DER response at `path` and check it is one to staple for `leaf`: successful, about
/// this certificate (its issuer must follow it in the chain file `chain_path`), saying "good",
/// and current. Its signature is left to the clients, which hold the trust anchors.
pub(super) fn load(
    path: &Path,
    chain_path: &Path,
    leaf: &X509Ref,
    issuer: Option<&X509Ref>,
) -> Result<Staple, TlsError> {
    let der = read(path)?;
    let response = OcspResponse::from_der(&der)
        .map_err(|e| tls_err(path, format!("not a DER OCSP response: {e}")))?;
    if response.status() != OcspResponseStatus::SUCCESSFUL {
        return Err(tls_err(
            path,
            format!(
                "the responder refused the request (status {}), there is nothing to staple",
                response.status().as_raw()
            ),
        ));
    }
    let basic = response
        .basic()
        .map_err(|e| tls_err(path, format!("no basic OCSP response inside: {e}")))?;
    let Some(issuer) = issuer else {
        return Err(tls_err(
            path,
            format!(
                "stapling needs the issuer's certificate after the leaf in {}",
                chain_path.display()
            ),
        ));
    };
    // Responders name the certificate by SHA-1 (RFC 6960's default) or SHA-256 hashes.
    for digest in [MessageDigest::sha1(), MessageDigest::sha256()] {
        let id = OcspCertId::from_cert(digest, leaf, issuer)
            .map_err(|e| tls_err(path, format!("cannot name the certificate: {e}")))?;
        let Some(status) = basic.find_status(&id) else {
            continue;
        };
        let until = status
            .next_update()
            .map_or_else(|| "-".to_string(), |t| t.to_string());
        return match status.status {
            OcspCertStatus::GOOD => {
                if status.check_validity(CLOCK_SKEW_SECONDS, None).is_err() {
                    return Err(tls_err(
                        path,
                        format!(
                            "out of date (valid from {} to {until}): fetch a new one",
                            status.this_update
                        ),
                    ));
                }
                let next_update =
                    match status.next_update() {
                        Some(t) => Some(generalized_unix(t).ok_or_else(|| {
                            tls_err(path, format!("unreadable nextUpdate time {t}"))
                        })?),
                        None => None,
                    };
                Ok(Staple { der, next_update })
            }
            OcspCertStatus::REVOKED => Err(tls_err(
                path,
                format!(
                    "the CA says the certificate in {} is revoked",
                    chain_path.display()
                ),
            )),
            _ => Err(tls_err(
                path,
                "the responder does not know the certificate (status unknown)",
            )),
        };
    }
    Err(tls_err(
        path,
        format!(
            "the response is not about the certificate in {} (another certificate or issuer)",
            chain_path.display()
        ),
    ))
}

/// Unix time of a GeneralizedTime, through its printed form ("Dec  7 05:47:10 2026 GMT"): the
/// binding compares only `Asn1Time`s.
fn generalized_unix(t: &Asn1GeneralizedTimeRef) -> Option<i64> {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let printed = t.to_string();
    let mut parts = printed.split_whitespace();
    let name = parts.next()?;
    let month = MONTHS.iter().position(|m| *m == name)? + 1;
    let day: u32 = parts.next()?.parse().ok()?;
    let clock = parts.next()?;
    let year: u32 = parts.next()?.parse().ok()?;
    let mut hms = clock.split('.').next()?.split(':');
    let (h, m, s) = (hms.next()?, hms.next()?, hms.next()?);
    let asn1 = Asn1Time::from_str(&format!("{year:04}{month:02}{day:02}{h}{m}{s}Z")).ok()?;
    unix_time(&asn1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use openssl::asn1::Asn1GeneralizedTime;

    #[test]
    fn generalized_times_convert_to_unix_time() {
        let t = Asn1GeneralizedTime::from_str("20261207054710Z").expect("time");
        assert_eq!(generalized_unix(&t), Some(1_796_622_430));
        let epoch = Asn1GeneralizedTime::from_str("19700101000000Z").expect("time");
        assert_eq!(generalized_unix(&epoch), Some(0));
    }

    #[test]
    fn a_staple_is_sent_until_its_next_update_plus_the_skew() {
        let s = Staple {
            der: vec![],
            next_update: Some(1_000),
        };
        assert!(s.current(1_000));
        assert!(s.current(1_000 + i64::from(CLOCK_SKEW_SECONDS)));
        assert!(!s.current(1_001 + i64::from(CLOCK_SKEW_SECONDS)));
        let open = Staple {
            der: vec![],
            next_update: None,
        };
        assert!(open.current(i64::MAX));
    }
}
