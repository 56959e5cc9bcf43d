//! The shared context of an invoke: one key-value map per invoke, readable
//! and writable by every filter and by the terminals (conversation id,
//! tenant, user id, ...). Distinct from each filter's private FCtx.

mod asker;
mod progress;
mod spend;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::Value;

pub(crate) use asker::Asker;
pub(crate) use progress::{Progress, Report};
pub(crate) use spend::{Cost, Tokens, Tree};

/// The shared-context key naming the conversation an invoke belongs to,
/// whose history the tool loop and the `memory` filter load and extend
/// (behind client keys, the gateway sets `<tenant>/<id>`).
pub const CONVERSATION_ID: &str = "conversation_id";
/// The shared-context key naming the tenant of the client key (set by the
/// gateway).
pub const TENANT: &str = "tenant";
/// The shared-context key naming the client key a request presented (set
/// by the gateway; its name, never the key).
pub const CLIENT_KEY: &str = "key";
/// The shared-context key naming the end user (the gateway sets the
/// request's `user`).
pub const USER: &str = "user";
/// The shared-context key a limiting filter (`rate-limit`) leaves what it
/// saw under, `{"requests": {"limit", "remaining", "reset_ms"}, "tokens":
/// {...}}`: the gateway answers it as OpenAI's `x-ratelimit-*` headers,
/// and a `limit-exceeded` refusal with `Retry-After`.
pub const RATE_LIMIT: &str = "rate_limit";
/// The shared-context key the `cache` filter says what it did under
/// (`"hit"`, `"miss"`, `"skip"`): the gateway answers it as the
/// `x-shallot-cache` header.
pub const CACHE: &str = "cache";

/// The shared-context key naming the upstream of a route's pool the
/// invoke's model calls go to, and only to (`model-fallback` with
/// `upstreams` sets it); unset, the pool balances and fails over. A name
/// the pool does not have is a `not-found` naming those it has.
pub const UPSTREAM: &str = "upstream";

/// The shared-context key counting the gateways a request has passed
/// through before this one (the gateway sets it from the `x-shallot-hops`
/// header, and refuses a request that has passed through
/// [`MAX_HOPS`]); a call to an OpenAI-compatible model sends it one more,
/// so a route or a side call whose model leads back to a gateway ends
/// there instead of going round for ever.
pub const HOPS: &str = "hops";
/// The shared-context key the host sets, to the reason's message, when a
/// [`Cancel`](crate::Cancel) ends the invoke's calls (the gateway's: the
/// request's deadline passed, or the client went away), so a filter can
/// tell a cancelled turn from a failed one (`trace` writes `"outcome":
/// "cancelled"`).
pub const CANCELLED: &str = "cancelled";
/// The most gateways one request may pass through.
pub const MAX_HOPS: u64 = 8;

/// The header that counts the gateways a request passed through; a
/// shallot gateway refuses one that has passed through too many.
pub const HOPS_HEADER: &str = "x-shallot-hops";
/// The header that lends a model server (a gateway) its share of the
/// request's tree: the requests to models it may cause in all.
pub const BUDGET_HEADER: &str = "x-shallot-budget";
/// The header a gateway answers with what it did not spend of its loan
/// (`0` for a stream, which may spend on).
pub const BUDGET_LEFT_HEADER: &str = "x-shallot-budget-left";

/// Keys of the shared context that say whom an invoke is for, how far it
/// came and whether it was cancelled. The caller (or the host) sets them; a sandboxed filter may read them but
/// never set or remove one, or it could act for another tenant, read
/// another conversation, or hide a loop. Native filters, the embedder's
/// own code, may.
pub const IDENTITY_KEYS: [&str; 6] = [CONVERSATION_ID, TENANT, CLIENT_KEY, USER, HOPS, CANCELLED];

/// A handle to an invoke's shared context. Clones share the same map, so
/// the caller keeps a clone to read what filters wrote.
///
/// A tool call of the tool loop gets a view of it instead: it reads the
/// shared context, but what it writes stays in the view until the batch
/// of calls ends, when the writes of the calls that succeeded are applied
/// in call order: calls of one
/// batch do not see each other's writes, the last by call index wins, and
/// a failed call's writes are dropped. A key with a declared reducer
/// ([`Reducers`]) combines the calls' writes
/// instead.
#[derive(Debug, Clone, Default)]
pub struct Context {
    values: Arc<Mutex<BTreeMap<String, Value>>>,
    /// For a tool call's view: the shared context and the keys removed.
    view: Option<Arc<View>>,
    /// The requests to model servers the invoke's tree may still send (the
    /// gateway's; none: unbounded), shared by every view.
    tree: Option<Arc<Tree>>,
    /// A side call's tokens, on the context its side call runs with.
    tokens: Option<Arc<Tokens>>,
    /// Where the server behind a tool reports progress on the invoke's
    /// calls (the `/mcp` client that made the call), shared by every view.
    progress: Option<Progress>,
    /// Whom the server behind a tool may ask for a model's or a person's
    /// answer during the invoke's calls, shared by every view.
    asker: Option<Arc<dyn Asker>>,
}

#[derive(Debug)]
struct View {
    shared: Context,
    removed: Mutex<BTreeSet<String>>,
}

impl View {
    fn removed(&self) -> MutexGuard<'_, BTreeSet<String>> {
        self.removed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Context {
    /// An empty context.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` and returns the context, for building one inline.
    pub fn with(self, key: &str, value: impl Into<Value>) -> Self {
        self.set(key, value);
        self
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Value>> {
        // A panicking writer cannot leave a map half-updated.
        self.values.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The value under `key`.
    pub fn get(&self, key: &str) -> Option<Value> {
        if let Some(value) = self.lock().get(key) {
            return Some(value.clone());
        }
        let view = self.view.as_ref()?;
        if view.removed().contains(key) {
            return None;
        }
        view.shared.get(key)
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: impl Into<Value>) {
        self.replace(key, value.into());
    }

    /// Removes `key`.
    pub fn remove(&self, key: &str) {
        self.take(key);
    }

    /// All keys, sorted.
    pub fn keys(&self) -> Vec<String> {
        self.snapshot().into_keys().collect()
    }

    /// A copy of every entry.
    pub fn snapshot(&self) -> BTreeMap<String, Value> {
        let own = self.lock().clone();
        let Some(view) = &self.view else {
            return own;
        };
        let mut all = view.shared.snapshot();
        for key in view.removed().iter() {
            all.remove(key);
        }
        all.extend(own);
        all
    }

    /// Sets `key` and returns the value it had.
    pub(crate) fn replace(&self, key: &str, value: Value) -> Option<Value> {
        let before = self.get(key);
        self.lock().insert(key.to_owned(), value);
        if let Some(view) = &self.view {
            view.removed().remove(key);
        }
        before
    }

    /// Removes `key` and returns its value.
    pub(crate) fn take(&self, key: &str) -> Option<Value> {
        let before = self.get(key);
        self.lock().remove(key);
        if let Some(view) = &self.view {
            view.removed().insert(key.to_owned());
        }
        before
    }

    /// The value under `key` as JSON text.
    pub(crate) fn get_json(&self, key: &str) -> Option<String> {
        self.get(key).map(|value| value.to_string())
    }

    /// A tool call's view of this context: its reads come from here, its
    /// writes stay in the view until [`Context::apply_writes`] puts them
    /// here.
    pub(crate) fn view(&self) -> Context {
        Context {
            values: Arc::default(),
            view: Some(Arc::new(View {
                shared: self.clone(),
                removed: Mutex::default(),
            })),
            tree: self.tree.clone(),
            tokens: self.tokens.clone(),
            progress: self.progress.clone(),
            asker: self.asker.clone(),
        }
    }

    /// This context, its calls to models bounded by `tree`.
    pub(crate) fn with_tree(mut self, tree: Arc<Tree>) -> Self {
        self.tree = Some(tree);
        self
    }

    /// What the invoke's tree may still send, if it is bounded.
    pub(crate) fn tree(&self) -> Option<&Arc<Tree>> {
        self.tree.as_ref()
    }

    /// The same context (the same map), for a side call whose attempts
    /// spend `tokens`.
    pub(crate) fn with_tokens(&self, tokens: Arc<Tokens>) -> Self {
        Context {
            tokens: Some(tokens),
            ..self.clone()
        }
    }

    /// A side call's tokens, on its own context.
    pub(crate) fn tokens(&self) -> Option<&Arc<Tokens>> {
        self.tokens.as_ref()
    }

    /// This context (the same map), the progress of its tool calls going
    /// to `progress`.
    pub(crate) fn with_progress(&self, progress: Progress) -> Self {
        Context {
            progress: Some(progress),
            ..self.clone()
        }
    }

    /// Where the progress of the invoke's tool calls goes, if anywhere.
    pub(crate) fn progress(&self) -> Option<&Progress> {
        self.progress.as_ref()
    }

    /// This context (the same map), the servers of its tool calls asking
    /// `asker` for the answers they need.
    pub(crate) fn with_asker(&self, asker: Arc<dyn Asker>) -> Self {
        Context {
            asker: Some(asker),
            ..self.clone()
        }
    }

    /// Whom the servers of the invoke's tool calls may ask, if anyone.
    pub(crate) fn asker(&self) -> Option<&Arc<dyn Asker>> {
        self.asker.as_ref()
    }

    /// Folds the writes of a batch's calls into this context: each `(index, written)` is a call's index in its
    /// batch and what it wrote (a context of its own, or a view of this
    /// one, whose removals count as writes too). They are applied by
    /// index, whatever their order here: the last writer of a key wins,
    /// unless `reducers` declares one for the key, which then folds every
    /// write in index order into the key's value (its `init` when the key
    /// is absent). Returns the keys more than one call wrote without a
    /// reducer (conflicts), sorted.
    pub fn apply_writes<'a>(
        &self,
        writes: impl IntoIterator<Item = (usize, &'a Context)>,
        reducers: &Reducers,
    ) -> Vec<String> {
        let mut writes: Vec<(usize, &Context)> = writes.into_iter().collect();
        writes.sort_by_key(|(index, _)| *index);
        let mut writers: BTreeMap<String, usize> = BTreeMap::new();
        for (_, written) in writes {
            let sets = written.lock().clone();
            for (key, value) in sets {
                match reducers.slots.get(&key) {
                    Some(slot) => {
                        let acc = self.get(&key).unwrap_or_else(|| slot.init.clone());
                        self.replace(&key, (slot.reduce)(acc, value));
                    }
                    None => {
                        *writers.entry(key.clone()).or_default() += 1;
                        self.replace(&key, value);
                    }
                }
            }
            if let Some(view) = &written.view {
                let removed = view.removed().clone();
                for key in removed {
                    *writers.entry(key.clone()).or_default() += 1;
                    self.take(&key);
                }
            }
        }
        writers
            .into_iter()
            .filter(|(_, n)| *n > 1)
            .map(|(key, _)| key)
            .collect()
    }
}

/// How the writes to one key combine.
type Reduce = dyn Fn(Value, Value) -> Value + Send + Sync;

#[derive(Clone)]
struct Slot {
    init: Value,
    reduce: Arc<Reduce>,
}

/// Keys of the shared context whose writes from a batch of tool calls
/// combine rather than replace each other: each write is folded into the key's value with the key's
/// reducer, in call order. Declared on the kernel
/// (`KernelBuilder::reducer`); used by [`Context::apply_writes`].
#[derive(Clone, Default)]
pub struct Reducers {
    slots: Arc<HashMap<String, Slot>>,
}

impl Reducers {
    /// No reducers: every key is last-writer-wins.
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares `key`'s reducer: its value starts as `init` when absent,
    /// and each write `w` makes it `reduce(value, w)`.
    pub fn with(
        mut self,
        key: impl Into<String>,
        init: Value,
        reduce: impl Fn(Value, Value) -> Value + Send + Sync + 'static,
    ) -> Self {
        let slot = Slot {
            init,
            reduce: Arc::new(reduce),
        };
        Arc::make_mut(&mut self.slots).insert(key.into(), slot);
        self
    }
}

impl std::fmt::Debug for Reducers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<&String> = self.slots.keys().collect();
        keys.sort();
        f.debug_struct("Reducers").field("keys", &keys).finish()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Context, Reducers};

    #[test]
    fn a_view_reads_through_and_keeps_its_writes_until_applied() {
        let shared = Context::new().with("a", 1).with("b", 2);
        let view = shared.view();
        view.set("c", 3);
        view.remove("a");
        assert_eq!(view.get("a"), None);
        assert_eq!(view.get("b"), Some(json!(2)));
        assert_eq!(view.keys(), ["b", "c"]);
        assert_eq!(
            shared.keys(),
            ["a", "b"],
            "nothing reaches the shared one yet"
        );
        shared.set("b", 20);
        assert_eq!(view.get("b"), Some(json!(20)), "reads go through");
        view.set("a", 10);
        assert_eq!(view.get("a"), Some(json!(10)), "set after remove");
        view.remove("c");
        let conflicts = shared.apply_writes([(0, &view)], &Reducers::new());
        assert!(conflicts.is_empty());
        assert_eq!(
            shared.snapshot(),
            [("a".to_owned(), json!(10)), ("b".to_owned(), json!(20))].into()
        );
    }
}
