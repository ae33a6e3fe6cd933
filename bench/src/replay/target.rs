//! Loopback-only URL checks: kvbench load must never leave the machine.

use std::net::IpAddr;

use reqwest::Url;

/// Parses `url` and refuses anything but http(s) to 127.0.0.0/8, ::1 or localhost.
pub fn loopback_url(what: &str, url: &str) -> Result<Url, String> {
    let u = Url::parse(url).map_err(|e| format!("{what} {url:?} is not a URL: {e}"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!(
            "{what} {url:?}: only http:// or https:// URLs are supported"
        ));
    }
    // reqwest re-exports `Url` but not `url::Host`, so the host is checked in text form.
    let host = u.host_str().unwrap_or("");
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let ok = host.eq_ignore_ascii_case("localhost")
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !ok {
        return Err(format!(
            "{what} {url:?} is not a loopback address; kvbench only drives 127.0.0.0/8, ::1 or localhost"
        ));
    }
    Ok(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_only() {
        for ok in [
            "http://127.0.0.1:8000",
            "http://127.3.4.5/",
            "http://localhost:1",
            "http://[::1]:9/x",
        ] {
            assert!(loopback_url("--target", ok).is_ok(), "{ok}");
        }
        for bad in [
            "http://10.0.0.1:8000",
            "http://example.com",
            "ftp://127.0.0.1/",
            "127.0.0.1:80",
            "http://[::2]:1",
        ] {
            assert!(loopback_url("--target", bad).is_err(), "{bad}");
        }
    }
}
