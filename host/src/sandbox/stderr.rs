//! A guest's stderr, captured per call.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

use crate::escape::{TEXT_CAP, printable};

/// How many bytes of a guest's stderr one call keeps (for a panic message).
const STDERR_CAPACITY: usize = 4096;

/// A guest's stderr, captured per call: cleared when a call starts, read
/// when it faults, never more than [`STDERR_CAPACITY`] bytes (the rest is
/// dropped, so writing can never fail or block).
#[derive(Clone, Default)]
pub(crate) struct Stderr(Arc<Mutex<Vec<u8>>>);

impl Stderr {
    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn append(&self, bytes: &[u8]) {
        let mut buffer = self.lock();
        let room = STDERR_CAPACITY.saturating_sub(buffer.len());
        buffer.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    pub(super) fn clear(&self) {
        self.lock().clear();
    }

    /// What the guest wrote in this call, trimmed and made printable.
    pub(super) fn text(&self) -> Option<String> {
        let bytes = self.lock();
        let text = String::from_utf8_lossy(&bytes);
        let text = text.trim();
        (!text.is_empty()).then(|| printable(text, TEXT_CAP))
    }
}

impl IsTerminal for Stderr {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Stderr {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

impl OutputStream for Stderr {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.append(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(STDERR_CAPACITY)
    }
}

#[async_trait::async_trait]
impl Pollable for Stderr {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for Stderr {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.append(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
