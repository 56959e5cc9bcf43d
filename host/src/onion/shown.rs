//! An answer shown whole ([`InvokeOptions::shown`]): its text goes through
//! the token transforms within its own invoke once the chain is done, so
//! that a whole answer is admitted once, its transforms see the filters'
//! private contexts of the call that made it, and its system prompts are
//! shaped once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::{Invoke, InvokeOptions, TokenSink, TokenStream};
use crate::types::{ChainError, Content, ErrorKind, FinishReason, Message, TokenBatch};

/// What an invoke that shows its answer keeps: whether its sink (if it
/// has one) got any text yet.
#[derive(Clone)]
pub(crate) struct Shows {
    delivered: Option<Arc<AtomicBool>>,
}

impl Shows {
    /// For an invoke of `options`, if it shows its answer: its sink is
    /// then watched for text.
    pub(crate) fn watch(options: &mut InvokeOptions) -> Option<Shows> {
        if !options.shown {
            return None;
        }
        let delivered = options.sink.take().map(|sink| {
            let delivered = Arc::new(AtomicBool::new(false));
            options.sink = Some(Arc::new(Watched {
                sink,
                delivered: delivered.clone(),
            }));
            delivered
        });
        Some(Shows { delivered })
    }
}

/// A sink that notes whether text reached it.
struct Watched {
    sink: Arc<dyn TokenSink>,
    delivered: Arc<AtomicBool>,
}

impl TokenSink for Watched {
    fn deliver(&self, tokens: &TokenBatch) {
        if tokens.iter().any(|token| !token.text.is_empty()) {
            self.delivered.store(true, Ordering::Relaxed);
        }
        self.sink.deliver(tokens);
    }
}

/// Gathers what the transforms deliver.
#[derive(Default)]
struct Gathered(Mutex<String>);

impl TokenSink for Gathered {
    fn deliver(&self, tokens: &TokenBatch) {
        let mut text = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for token in tokens.iter() {
            text.push_str(token.text);
        }
    }
}

/// Shows `message`'s text, if `invoke` shows its answer: without a sink,
/// its text becomes the one the caller is shown (its parts' text, for an
/// answer of parts); with one, the text is streamed to it unless text
/// already was. `end` is why the answer ended.
pub(crate) async fn show_message(
    invoke: &Arc<Invoke>,
    message: &mut Message,
    end: FinishReason,
) -> Result<(), ChainError> {
    if invoke.extension::<Shows>().is_none() {
        return Ok(());
    }
    let Some(text) = message.take_text() else {
        return Ok(());
    };
    message.content = Some(Content::Text(show(invoke, text, end).await?));
    Ok(())
}

/// `text` as [`show_message`] shows it.
pub(crate) async fn show(
    invoke: &Arc<Invoke>,
    text: String,
    end: FinishReason,
) -> Result<String, ChainError> {
    let Some(shows) = invoke.extension::<Shows>() else {
        return Ok(text);
    };
    if let (Some(delivered), Some(sink)) = (&shows.delivered, invoke.sink()) {
        if !delivered.load(Ordering::Relaxed) && !text.is_empty() {
            through(invoke, text.clone(), end, sink.clone()).await?;
        }
        return Ok(text);
    }
    if invoke.onion().token_layers.is_empty() {
        return Ok(text);
    }
    let gathered = Arc::new(Gathered::default());
    through(invoke, text, end, gathered.clone()).await?;
    let mut shown = gathered.0.lock().unwrap_or_else(PoisonError::into_inner);
    Ok(std::mem::take(&mut *shown))
}

/// `text` through the transforms of `invoke` to `sink`, as a stream of
/// one token.
async fn through(
    invoke: &Arc<Invoke>,
    text: String,
    end: FinishReason,
    sink: Arc<dyn TokenSink>,
) -> Result<(), ChainError> {
    let end_at = u32::try_from(text.len())
        .map_err(|_| ChainError::new(ErrorKind::LimitExceeded, "a text past 4 GiB is not shown"))?;
    let mut stream = TokenStream::open(invoke, sink).await?;
    let tokens = TokenBatch {
        text,
        ends: vec![end_at],
        metas: Vec::new(),
    };
    if let Err(error) = stream.push(tokens).await {
        stream.abandon().await;
        return Err(error);
    }
    stream.finish(end).await
}
