//! The bodies of outgoing requests and their responses, bounded.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::time::{Instant, Sleep, timeout_at};
use wasmtime_wasi_http::{Error, WasiBody};

use super::Held;

/// Reads a request's body to its end (at most `cap` bytes, until
/// `deadline`) and drops it: a request refused or failed before it was
/// sent still takes what the filter writes, so that the filter sees why
/// the request failed, not a body it could not write.
pub(super) async fn drain(mut body: WasiBody, cap: u64, deadline: Instant) {
    let mut left = cap;
    let _ = timeout_at(deadline, async {
        while let Some(Ok(frame)) = body.frame().await {
            let size = frame.data_ref().map_or(0, |data| data.len() as u64);
            match left.checked_sub(size) {
                Some(rest) => left = rest,
                None => break,
            }
        }
    })
    .await;
}

/// A body bounded in bytes (past `cap`, the error `over` makes) and, for a
/// response, in time (its request's deadline); a response's body also
/// closes the request's wait when it ends.
pub(super) struct Bounded {
    body: WasiBody,
    left: u64,
    cap: u64,
    over: fn(Option<u64>) -> Error,
    held: Option<Held>,
    alarm: Option<Pin<Box<Sleep>>>,
}

impl Bounded {
    pub(super) fn new(
        body: WasiBody,
        cap: u64,
        over: fn(Option<u64>) -> Error,
        held: Option<Held>,
    ) -> Self {
        let alarm = held
            .as_ref()
            .map(|held| Box::pin(tokio::time::sleep_until(held.deadline)));
        Bounded {
            body,
            left: cap,
            cap,
            over,
            held,
            alarm,
        }
    }

    fn end(&mut self) {
        if let Some(held) = self.held.take() {
            held.close();
        }
    }
}

impl Drop for Bounded {
    fn drop(&mut self) {
        self.end();
    }
}

impl Body for Bounded {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = &mut *self;
        if let Some(alarm) = &mut this.alarm
            && alarm.as_mut().poll(cx).is_ready()
        {
            this.end();
            return Poll::Ready(Some(Err(Error::HttpResponseTimeout)));
        }
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        match frame {
            Some(Ok(frame)) => {
                let size = frame.data_ref().map_or(0, |data| data.len() as u64);
                if size > this.left {
                    this.end();
                    return Poll::Ready(Some(Err((this.over)(Some(this.cap)))));
                }
                this.left -= size;
                Poll::Ready(Some(Ok(frame)))
            }
            ended => {
                this.end();
                Poll::Ready(ended)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
}
