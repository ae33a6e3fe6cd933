//! Where an engine's HTTP/1.1 response ends, found in its bytes as they arrive: the status
//! line and headers, then a `Content-Length` body, a chunked body and its trailers, or a body
//! that ends with the connection.
//!
//! Only ever used to *release early*: anything this does not recognise (a malformed head, a
//! `101` tunnel, a bad chunk line) makes it stop judging, and the request's charge then ends
//! with the request, as it would without read-ahead.

/// Longest response head followed; a longer one is not judged.
const MAX_HEAD: usize = 64 * 1024;
/// Longest chunk-size or trailer line followed.
const MAX_LINE: usize = 4 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// More of the response is to come.
    More,
    /// The response is complete: every byte of it has been fed.
    Complete,
    /// Not an HTTP/1.1 response this can follow.
    Unknown,
}

#[derive(Debug)]
enum State {
    Head(Vec<u8>),
    Fixed(u64),
    ChunkSize(Vec<u8>),
    ChunkData(u64),
    /// The CRLF after a chunk's data: how many of its two bytes have been seen.
    ChunkEnd(u8),
    /// Trailer lines after the last chunk, until an empty one: the current line's length.
    Trailers(usize),
    UntilClose,
    Complete,
    Unknown,
}

#[derive(Debug)]
pub struct Framing {
    state: State,
    /// The response answers a `HEAD` request: it has no body, whatever its headers say.
    head_request: bool,
}

impl Framing {
    pub fn new(head_request: bool) -> Framing {
        Framing {
            state: State::Head(Vec::new()),
            head_request,
        }
    }

    /// Follow `data`, the next bytes of the response.
    pub fn feed(&mut self, mut data: &[u8]) -> Progress {
        while !data.is_empty() {
            match &mut self.state {
                State::Head(buf) => {
                    let before = buf.len();
                    buf.extend_from_slice(data);
                    let Some(end) = find_head_end(buf, before) else {
                        if buf.len() > MAX_HEAD {
                            self.state = State::Unknown;
                        }
                        return self.progress();
                    };
                    let head = std::mem::take(buf);
                    data = &data[end - before..];
                    self.state = self.after_head(&head[..end]);
                }
                State::Fixed(left) => {
                    let n = (*left).min(data.len() as u64);
                    *left -= n;
                    data = &data[n as usize..];
                    if *left == 0 {
                        self.state = State::Complete;
                    }
                }
                State::ChunkSize(line) => {
                    let Some(nl) = data.iter().position(|&b| b == b'\n') else {
                        line.extend_from_slice(data);
                        if line.len() > MAX_LINE {
                            self.state = State::Unknown;
                        }
                        return self.progress();
                    };
                    line.extend_from_slice(&data[..nl]);
                    data = &data[nl + 1..];
                    self.state = match chunk_size(line) {
                        Some(0) => State::Trailers(0),
                        Some(n) => State::ChunkData(n),
                        None => State::Unknown,
                    };
                }
                State::ChunkData(left) => {
                    let n = (*left).min(data.len() as u64);
                    *left -= n;
                    data = &data[n as usize..];
                    if *left == 0 {
                        self.state = State::ChunkEnd(0);
                    }
                }
                State::ChunkEnd(seen) => {
                    let want = if *seen == 0 { b'\r' } else { b'\n' };
                    if data[0] != want {
                        self.state = State::Unknown;
                        return self.progress();
                    }
                    data = &data[1..];
                    *seen += 1;
                    if *seen == 2 {
                        self.state = State::ChunkSize(Vec::new());
                    }
                }
                State::Trailers(len) => {
                    let b = data[0];
                    data = &data[1..];
                    match b {
                        b'\n' if *len == 0 => self.state = State::Complete,
                        b'\n' => *len = 0,
                        b'\r' => {}
                        _ if *len >= MAX_LINE => self.state = State::Unknown,
                        _ => *len += 1,
                    }
                }
                // Bytes past the end, or past what is understood: nothing more to judge.
                State::UntilClose | State::Complete | State::Unknown => break,
            }
        }
        self.progress()
    }

    /// The connection closed: a body delimited by the close is complete.
    pub fn closed(&mut self) -> Progress {
        if matches!(self.state, State::UntilClose) {
            self.state = State::Complete;
        }
        self.progress()
    }

    fn progress(&self) -> Progress {
        match self.state {
            State::Complete => Progress::Complete,
            State::Unknown => Progress::Unknown,
            _ => Progress::More,
        }
    }

    fn after_head(&self, head: &[u8]) -> State {
        let mut headers = [httparse::EMPTY_HEADER; 128];
        let mut resp = httparse::Response::new(&mut headers);
        let Ok(httparse::Status::Complete(_)) = resp.parse(head) else {
            return State::Unknown;
        };
        let Some(code) = resp.code else {
            return State::Unknown;
        };
        // An interim answer (100 Continue, 103 Early Hints): the real head follows. A 101
        // makes the connection a tunnel.
        if (100..200).contains(&code) {
            return if code == 101 {
                State::Unknown
            } else {
                State::Head(Vec::new())
            };
        }
        if self.head_request || code == 204 || code == 304 {
            return State::Complete;
        }
        let mut chunked = false;
        let mut length = None;
        for h in resp.headers.iter() {
            if h.name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = h
                    .value
                    .rsplit(|&b| b == b',')
                    .next()
                    .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            } else if h.name.eq_ignore_ascii_case("content-length") {
                let parsed = std::str::from_utf8(h.value)
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok());
                match (length, parsed) {
                    (_, None) => return State::Unknown,
                    (Some(l), Some(p)) if l != p => return State::Unknown,
                    (_, p) => length = p,
                }
            }
        }
        match (chunked, length) {
            (true, _) => State::ChunkSize(Vec::new()),
            (false, Some(0)) => State::Complete,
            (false, Some(n)) => State::Fixed(n),
            (false, None) => State::UntilClose,
        }
    }
}

/// The end of a response head (just past its blank line) in `buf`, searching from a little
/// before `from` (the terminator may straddle two reads).
fn find_head_end(buf: &[u8], from: usize) -> Option<usize> {
    let start = from.saturating_sub(3);
    memchr::memmem::find(&buf[start..], b"\r\n\r\n").map(|i| start + i + 4)
}

/// A chunk-size line's size (hex, optionally followed by `;extensions`), without its LF.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits = line.split(|&b| b == b';').next()?.trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `wire` in pieces of `step` bytes; the progress after each piece.
    fn follow(wire: &[u8], step: usize, head_request: bool) -> Vec<Progress> {
        let mut f = Framing::new(head_request);
        wire.chunks(step).map(|c| f.feed(c)).collect()
    }

    /// Complete exactly at the last byte, whatever the pieces.
    fn completes_at_the_end(wire: &[u8]) {
        for step in [1, 2, 3, 7, 64, wire.len()] {
            let p = follow(wire, step, false);
            let (last, rest) = p.split_last().expect("fed");
            assert_eq!(*last, Progress::Complete, "step {step}");
            assert!(
                rest.iter().all(|&x| x == Progress::More),
                "step {step}: {p:?}"
            );
        }
    }

    #[test]
    fn a_content_length_body() {
        completes_at_the_end(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello");
    }

    #[test]
    fn a_chunked_stream_with_extensions_and_trailers() {
        completes_at_the_end(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n\
              c\r\ndata: {\"a\"}\n\r\n6;ext=1\r\ndata: \r\n0\r\nx-trailer: 1\r\n\r\n",
        );
        completes_at_the_end(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        );
    }

    #[test]
    fn interim_answers_are_skipped() {
        completes_at_the_end(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        );
    }

    #[test]
    fn bodiless_answers_complete_with_their_head() {
        let head = b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n";
        assert_eq!(Framing::new(true).feed(head), Progress::Complete);
        assert_eq!(Framing::new(false).feed(head), Progress::More);
        let no_content = b"HTTP/1.1 204 No Content\r\nContent-Length: 500\r\n\r\n";
        assert_eq!(Framing::new(false).feed(no_content), Progress::Complete);
    }

    #[test]
    fn a_body_until_close_completes_when_the_connection_closes() {
        let mut f = Framing::new(false);
        assert_eq!(f.feed(b"HTTP/1.1 200 OK\r\n\r\nsome body"), Progress::More);
        assert_eq!(f.closed(), Progress::Complete);
        // A close mid-body of a known length is not an end.
        let mut f = Framing::new(false);
        assert_eq!(
            f.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc"),
            Progress::More
        );
        assert_eq!(f.closed(), Progress::More);
    }

    #[test]
    fn what_it_cannot_follow_it_does_not_judge() {
        for wire in [
            &b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX",
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            b"not http at all\r\n\r\n",
        ] {
            let p = follow(wire, wire.len(), false);
            assert_eq!(
                p.last(),
                Some(&Progress::Unknown),
                "{}",
                String::from_utf8_lossy(wire)
            );
        }
        let endless = vec![b'a'; MAX_HEAD + 10];
        assert_eq!(
            follow(&endless, 4096, false).last(),
            Some(&Progress::Unknown)
        );
    }
}
