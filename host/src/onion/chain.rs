//! A chain: its kind (chat, tool, turn), its layers over a terminal, and
//! [`Next`], the rest of it as a layer sees it. Composition, `next`,
//! deadlines and attribution of errors are written once, over any kind.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

use super::cancel::said;
use super::{Branch, Cancel, Fctx, Filter, Hook, Invoke, Terminal};
use crate::context::{CANCELLED, Context};
use crate::types::{
    Call, ChainError, ChatRequest, ChatResponse, ErrorKind, Origin, ToolRequest, ToolResponse,
    TurnRequest, TurnResult,
};

/// One of the three onions: what its requests and outputs are.
pub trait ChainKind: Send + Sync + Sized + 'static {
    /// What goes in: a chat, tool or turn request.
    type Request: Clone + Send + Sync + 'static;
    /// What the chain returns: a `Result` for chat and tool, the
    /// [`TurnResult`] variant (which has its own error case) for turn.
    type Output: Send + 'static;
    /// The hook filters implement to join this chain.
    const HOOK: Hook;
    /// What its terminal is called in errors.
    const TERMINAL: &'static str;

    /// How many hook calls of one filter an invoke that starts with this
    /// chain can have on its stack at once, given which hooks it `has`
    /// (and whether the invoke streams): one per chain the invoke can
    /// nest. An invoke reserves that many instances of the filter.
    #[doc(hidden)]
    fn depth(has: &dyn Fn(Hook) -> bool, streamed: bool) -> usize;

    /// The output for a failure.
    fn fail(error: ChainError) -> Self::Output;

    /// The failure in `output`, if it is one.
    #[doc(hidden)]
    fn failure(output: &mut Self::Output) -> Option<&mut ChainError>;

    /// `filter`'s hook of this chain.
    #[doc(hidden)]
    fn around<'a>(
        filter: &'a dyn Filter,
        request: Self::Request,
        next: Next<Self>,
    ) -> BoxFuture<'a, Self::Output>;
}

/// The chat chain: around one model call.
pub enum Chat {}
/// The tool chain: around one tool execution.
pub enum Tool {}
/// The turn chain: around one whole agent turn (the tool loop).
pub enum Turn {}

impl ChainKind for Chat {
    type Request = ChatRequest;
    type Output = Result<ChatResponse, ChainError>;
    const HOOK: Hook = Hook::AroundChat;
    const TERMINAL: &'static str = "model";

    fn depth(has: &dyn Fn(Hook) -> bool, streamed: bool) -> usize {
        has(Hook::AroundChat) as usize + (streamed && has(Hook::TokenTransform)) as usize
    }

    fn fail(error: ChainError) -> Self::Output {
        Err(error)
    }

    fn failure(output: &mut Self::Output) -> Option<&mut ChainError> {
        output.as_mut().err()
    }

    fn around<'a>(f: &'a dyn Filter, r: ChatRequest, n: Next<Self>) -> BoxFuture<'a, Self::Output> {
        f.around_chat(r, n)
    }
}

impl ChainKind for Tool {
    type Request = ToolRequest;
    type Output = Result<ToolResponse, ChainError>;
    const HOOK: Hook = Hook::AroundTool;
    const TERMINAL: &'static str = "tools";

    fn depth(has: &dyn Fn(Hook) -> bool, _: bool) -> usize {
        has(Hook::AroundTool) as usize
    }

    fn fail(error: ChainError) -> Self::Output {
        Err(error)
    }

    fn failure(output: &mut Self::Output) -> Option<&mut ChainError> {
        output.as_mut().err()
    }

    fn around<'a>(f: &'a dyn Filter, r: ToolRequest, n: Next<Self>) -> BoxFuture<'a, Self::Output> {
        f.around_tool(r, n)
    }
}

impl ChainKind for Turn {
    type Request = TurnRequest;
    type Output = TurnResult;
    const HOOK: Hook = Hook::AroundTurn;
    const TERMINAL: &'static str = "turn";

    /// The tool loop calls the chat chain and the tool chain, one at a
    /// time.
    fn depth(has: &dyn Fn(Hook) -> bool, streamed: bool) -> usize {
        has(Hook::AroundTurn) as usize + Chat::depth(has, streamed).max(Tool::depth(has, streamed))
    }

    fn fail(error: ChainError) -> Self::Output {
        TurnResult::Error(error)
    }

    fn failure(output: &mut Self::Output) -> Option<&mut ChainError> {
        match output {
            TurnResult::Error(error) => Some(error),
            _ => None,
        }
    }

    fn around<'a>(f: &'a dyn Filter, r: TurnRequest, n: Next<Self>) -> BoxFuture<'a, Self::Output> {
        f.around_turn(r, n)
    }
}

/// One layer of a chain; `id` is the filter's position in the kernel's
/// filter list, which keys its FCtx and its instance lease.
#[derive(Clone)]
pub(crate) struct Layer {
    pub id: usize,
    pub filter: Arc<dyn Filter>,
}

/// A composed chain: its layers, outermost first, over a terminal.
pub(crate) struct Chain<K: ChainKind> {
    pub layers: Vec<Layer>,
    pub terminal: Arc<dyn Terminal<K>>,
}

/// The rest of the chain, as seen from inside a layer; also the layer's
/// access to its private context and the invoke's shared context.
pub struct Next<K: ChainKind> {
    chain: Arc<Chain<K>>,
    index: usize,
    /// The filter whose hook holds this `Next`; `None` outside any layer.
    layer: Option<usize>,
    invoke: Arc<Invoke>,
    /// The batch branch private contexts are read and written in, for a
    /// call of a concurrent tool batch.
    branch: Option<Arc<Branch>>,
    /// The view of the shared context the terminal writes to, for a call
    /// of a tool batch; otherwise the invoke's context.
    writes_to: Option<Context>,
    /// Where the request is kept as it reaches the terminal, for a caller
    /// that asks ([`Next::call_reaching`]).
    reached: Option<Reached<K>>,
}

/// The request of a call as it last reached the terminal.
type Reached<K> = Arc<Mutex<Option<<K as ChainKind>::Request>>>;

impl<K: ChainKind> Clone for Next<K> {
    fn clone(&self) -> Self {
        Next {
            chain: self.chain.clone(),
            index: self.index,
            layer: self.layer,
            invoke: self.invoke.clone(),
            branch: self.branch.clone(),
            writes_to: self.writes_to.clone(),
            reached: self.reached.clone(),
        }
    }
}

impl<K: ChainKind> Next<K> {
    /// The whole chain, from its outermost layer.
    pub(crate) fn start(chain: Arc<Chain<K>>, invoke: Arc<Invoke>) -> Self {
        Next {
            chain,
            index: 0,
            layer: None,
            invoke,
            branch: None,
            writes_to: None,
            reached: None,
        }
    }

    /// The same, reading and writing private contexts in `branch`.
    pub(crate) fn in_branch(mut self, branch: Arc<Branch>) -> Self {
        self.branch = Some(branch);
        self
    }

    /// The same, its terminal reading and writing `view` of the shared
    /// context.
    pub(crate) fn writing_to(mut self, view: Context) -> Self {
        self.writes_to = Some(view);
        self
    }

    /// The batch branch this call runs in, if any.
    pub(crate) fn branch(&self) -> Option<&Arc<Branch>> {
        self.branch.as_ref()
    }

    /// Calls the inner layers and the terminal.
    pub fn call(&self, request: K::Request) -> BoxFuture<'static, K::Output> {
        let this = self.clone();
        Box::pin(async move { this.run(request).await })
    }

    /// Calls the inner layers and the terminal, and returns with the
    /// output the request as the filters left it when it last reached the
    /// terminal (`None` if a filter answered in its place): for the chat
    /// chain, the tools the model was offered.
    pub(crate) async fn call_reaching(
        &self,
        request: K::Request,
    ) -> (K::Output, Option<K::Request>) {
        let reached = Reached::<K>::default();
        let next = Next {
            reached: Some(reached.clone()),
            ..self.clone()
        };
        let output = next.call(request).await;
        let request = reached
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        (output, request)
    }

    /// Calls the inner layers, giving up with a `timeout` error after
    /// `timeout`; the inner call is cancelled.
    pub async fn call_within(&self, request: K::Request, timeout: Duration) -> K::Output {
        match tokio::time::timeout(timeout, self.call(request)).await {
            Ok(output) => output,
            Err(_) => {
                let error = ChainError::new(
                    ErrorKind::Timeout,
                    format!(
                        "the inner call did not finish within {} ms",
                        timeout.as_millis()
                    ),
                );
                // The deadline is the calling filter's.
                K::fail(match self.caller() {
                    Some(filter) => error.at(Origin {
                        filter: filter.into(),
                        plugin: None,
                        call: K::HOOK.into(),
                    }),
                    None => error,
                })
            }
        }
    }

    /// The name of the filter this is the rest of the chain of.
    fn caller(&self) -> Option<&str> {
        Some(
            self.chain
                .layers
                .get(self.index.checked_sub(1)?)?
                .filter
                .name(),
        )
    }

    /// The invoke's shared context.
    pub fn context(&self) -> &Context {
        self.invoke.context()
    }

    /// The calling filter's private context: its latest state in this
    /// invoke, or its init. `None` outside a filter.
    pub fn fctx(&self) -> Option<Fctx> {
        self.layer
            .map(|id| self.invoke.fctx(self.branch.as_deref(), id))
    }

    /// Replaces the calling filter's private context.
    pub fn set_fctx(&self, fctx: impl Into<Fctx>) {
        if let Some(id) = self.layer {
            // Charged like a guest's write (a native filter has no cap), so
            // a batch's fold gives back what each of its calls held.
            self.invoke
                .set_fctx_within(self.branch.as_deref(), id, fctx.into(), usize::MAX);
        }
    }

    /// The invoke this call belongs to.
    pub(crate) fn invoke(&self) -> &Arc<Invoke> {
        &self.invoke
    }

    /// The position of the filter whose hook holds this `Next`.
    pub(crate) fn layer(&self) -> Option<usize> {
        self.layer
    }

    async fn run(self, request: K::Request) -> K::Output {
        let Some(layer) = self.chain.layers.get(self.index) else {
            // A terminal's panic (a custom one, or a host bug) is its own
            // error, not blamed on the native filter around it.
            if let Some(reached) = &self.reached {
                *reached.lock().unwrap_or_else(PoisonError::into_inner) = Some(request.clone());
            }
            let context = self.writes_to.as_ref().unwrap_or(self.invoke.context());
            let call = self.chain.terminal.call(request, &self.invoke, context);
            let terminal = K::TERMINAL;
            let call = async {
                match AssertUnwindSafe(call).catch_unwind().await {
                    Ok(output) => output,
                    Err(panic) => {
                        let error = panicked(terminal, Call::Terminal, &*panic);
                        K::fail(ChainError {
                            kind: ErrorKind::Internal,
                            ..error
                        })
                    }
                }
            };
            // A cancelled invoke's model and tool calls end with its
            // reason; the turn's terminal, the tool loop, ends through
            // them, so the filters inside it see their calls end too.
            let cancel = self
                .invoke
                .extension::<Cancel>()
                .filter(|_| K::HOOK != Hook::AroundTurn);
            let mut output = match cancel {
                None => call.await,
                Some(cancel) => tokio::select! {
                    biased;
                    reason = cancel.cancelled() => {
                        self.invoke.context().set(CANCELLED, said(&reason));
                        K::fail(reason)
                    }
                    output = call => output,
                },
            };
            // Every error names where it came from: a terminal's own,
            // unless it says which part of it failed.
            if let Some(error) = K::failure(&mut output)
                && error.origin.is_none()
            {
                error.origin = Some(Origin::terminal(terminal));
            }
            return output;
        };
        let next = Next {
            index: self.index + 1,
            layer: Some(layer.id),
            ..self.clone()
        };
        // A filter's panic (a native filter's, or a host bug under a wasm
        // one) fails this call with an error naming it, as a guest's trap
        // does, and the layers around it see an error like any other.
        let call = K::around(layer.filter.as_ref(), request, next);
        match AssertUnwindSafe(call).catch_unwind().await {
            Ok(output) => output,
            Err(panic) => K::fail(panicked(layer.filter.name(), K::HOOK.into(), &*panic)),
        }
    }
}

/// The error a filter's (or a terminal's) panic in `call` becomes.
fn panicked(filter: &str, call: Call, panic: &(dyn std::any::Any + Send)) -> ChainError {
    let said = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic");
    let origin = Origin {
        filter: filter.into(),
        plugin: None,
        call,
    };
    ChainError::new(ErrorKind::PluginFault, format!("panicked: {said}")).at(origin)
}
