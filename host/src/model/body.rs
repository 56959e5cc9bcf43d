//! A model server's bytes, read under caps: a whole answer up to a size,
//! an error body up to a smaller one, and a stream checked as it arrives
//! (UTF-8, a line's length, a leading byte-order mark) before the SSE
//! parser sees it, so that no server can make the host buffer without end
//! or stall on a byte the parser would keep waiting to complete.

use bytes::{Bytes, BytesMut};
use futures::stream::{Stream, StreamExt};

use super::ResponseLimits;
use crate::types::{ChainError, ErrorKind};

/// The most of a whole answer read: twice the answer's own cap, for the
/// JSON around its text and the escapes in it.
pub(super) fn answer_cap() -> usize {
    ResponseLimits::default().max_bytes * 2
}

/// The most of a stream's line (one `data:` field, a chunk) held while it
/// is incomplete.
pub(super) fn line_cap() -> usize {
    ResponseLimits::default().max_bytes
}

/// The most of an error answer read; its message is cut shorter still.
const ERROR_CAP: usize = 64 << 10;
const MESSAGE_CAP: usize = 1 << 10;
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Reads `response`'s body, failing once it passes `cap` bytes.
pub(super) async fn read(response: reqwest::Response, cap: usize) -> Result<Vec<u8>, ChainError> {
    let over = || {
        ChainError::new(
            ErrorKind::LimitExceeded,
            format!("the model server's answer is over {cap} bytes"),
        )
    };
    if response.content_length().is_some_and(|n| n > cap as u64) {
        return Err(over());
    }
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| {
            let e = e.without_url();
            let kind = if e.is_timeout() {
                ErrorKind::Timeout
            } else {
                ErrorKind::Transient
            };
            ChainError::new(kind, format!("the model server's answer broke off: {e}"))
        })?;
        if body.len() + chunk.len() > cap {
            return Err(over());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// An error answer's text, read up to a cap (what is cut off is lost).
pub(super) async fn error_text(response: reqwest::Response) -> String {
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    while let Some(Ok(chunk)) = chunks.next().await {
        let room = ERROR_CAP - body.len();
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() == ERROR_CAP {
            break;
        }
    }
    String::from_utf8_lossy(&body).into_owned()
}

/// `message`, cut to a length fit for an error (at a character boundary).
pub(super) fn cut(message: &str) -> String {
    if message.len() <= MESSAGE_CAP {
        return message.to_owned();
    }
    let end = (0..=MESSAGE_CAP)
        .rev()
        .find(|at| message.is_char_boundary(*at))
        .unwrap_or(0);
    format!("{}…", &message[..end])
}

/// Why a stream's bytes were refused before parsing.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    #[error("{0}")]
    Transport(reqwest::Error),
    #[error("the model stream sent bytes that are not UTF-8")]
    NotUtf8,
    #[error("the model stream sent a line over {0} bytes")]
    LineTooLong(usize),
}

/// `bytes` checked as they arrive: a leading byte-order mark dropped,
/// UTF-8 checked (a character split across reads is held until it is
/// whole), and a line longer than `cap` refused.
pub(super) fn checked(
    bytes: impl Stream<Item = reqwest::Result<Bytes>> + Send + 'static,
    cap: usize,
) -> impl Stream<Item = Result<Bytes, Refused>> + Send + 'static {
    let mut check = Check {
        start: Some(BytesMut::new()),
        partial: BytesMut::new(),
        line: 0,
        cap,
    };
    bytes
        .map(move |chunk| check.pass(chunk.map_err(|e| Refused::Transport(e.without_url()))?))
        .scan(false, |ended, checked| {
            // Nothing after a refusal: the parser sees the error last.
            if *ended {
                return futures::future::ready(None);
            }
            *ended = checked.is_err();
            futures::future::ready(Some(checked))
        })
}

struct Check {
    /// The first bytes, until they are known not to be a byte-order mark.
    start: Option<BytesMut>,
    /// An incomplete character at the end of the last read.
    partial: BytesMut,
    /// Bytes since the last line break.
    line: usize,
    cap: usize,
}

impl Check {
    fn pass(&mut self, chunk: Bytes) -> Result<Bytes, Refused> {
        let mut bytes = std::mem::take(&mut self.partial);
        match self.start.take() {
            Some(mut head) => {
                head.extend_from_slice(&chunk);
                if head.len() < BOM.len() && BOM.starts_with(&head) {
                    self.start = Some(head);
                    return Ok(Bytes::new());
                }
                let skip = if head.starts_with(BOM) { BOM.len() } else { 0 };
                bytes.extend_from_slice(&head[skip..]);
            }
            None => bytes.extend_from_slice(&chunk),
        }
        match std::str::from_utf8(&bytes) {
            Ok(_) => {}
            Err(e) if e.error_len().is_none() => self.partial = bytes.split_off(e.valid_up_to()),
            Err(_) => return Err(Refused::NotUtf8),
        }
        match bytes.iter().rposition(|b| matches!(b, b'\n' | b'\r')) {
            Some(at) => self.line = bytes.len() - at - 1,
            None => self.line += bytes.len(),
        }
        if self.line > self.cap {
            return Err(Refused::LineTooLong(self.cap));
        }
        Ok(bytes.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(cap: usize) -> Check {
        Check {
            start: Some(BytesMut::new()),
            partial: BytesMut::new(),
            line: 0,
            cap,
        }
    }

    fn passed(check: &mut Check, reads: &[&[u8]]) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        for read in reads {
            let bytes = check
                .pass(Bytes::copy_from_slice(read))
                .map_err(|e| e.to_string())?;
            out.extend_from_slice(&bytes);
        }
        Ok(out)
    }

    #[test]
    fn a_byte_order_mark_is_dropped_even_split_across_reads() {
        let body: &[u8] = b"\xEF\xBB\xBFdata: {}\n\n";
        assert_eq!(passed(&mut check(64), &[body]).unwrap(), b"data: {}\n\n");
        let split: [&[u8]; 3] = [b"\xEF", b"\xBB", b"\xBFdata: {}\n\n"];
        assert_eq!(passed(&mut check(64), &split).unwrap(), b"data: {}\n\n");
        let short: [&[u8]; 2] = [b"d", b"ata: {}\n\n"];
        assert_eq!(passed(&mut check(64), &short).unwrap(), b"data: {}\n\n");
    }

    #[test]
    fn a_character_split_across_reads_waits_and_a_bad_byte_is_refused() {
        let euro = "data: €\n\n".as_bytes();
        let (a, b) = euro.split_at(7);
        assert_eq!(passed(&mut check(64), &[a, b]).unwrap(), euro);
        let bad: [&[u8]; 1] = [b"data: a\xFF\n\n"];
        assert!(passed(&mut check(64), &bad).unwrap_err().contains("UTF-8"));
    }

    #[test]
    fn a_line_over_the_cap_is_refused_across_reads_and_line_breaks_reset_it() {
        let mut fine = check(8);
        assert!(passed(&mut fine, &[b"data: 1\n", b"data: 2\r\n", b"\n"]).is_ok());
        let long: [&[u8]; 2] = [b"data: ", b"1234"];
        assert!(
            passed(&mut check(8), &long)
                .unwrap_err()
                .contains("over 8 bytes")
        );
    }

    #[test]
    fn a_long_message_is_cut_at_a_character() {
        let long = "é".repeat(MESSAGE_CAP);
        let cut = cut(&long);
        assert!(cut.len() <= MESSAGE_CAP + '…'.len_utf8(), "{}", cut.len());
        assert!(cut.ends_with('…'));
        assert_eq!(super::cut("short"), "short");
    }
}
