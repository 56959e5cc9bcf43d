//! Several upstreams behind one model: weighted balancing, failover and
//! cooldown.
//!
//! Each request goes to one upstream, chosen by weight among those not
//! cooling down (a weighted round robin, so that an upstream of weight 3
//! gets three requests of every four beside one of weight 1; one of
//! weight 0 is a standby, tried only after the others). When it
//! fails in a way another upstream may not (a transient failure, a `5xx`,
//! a `429`, a timeout, a refused connection) before the answer's first
//! token, the request goes to the next upstream, and so on; a request the
//! upstream refused for what it is (a bad request, an auth failure) is
//! not tried elsewhere. An upstream that fails `cool_after` times in a
//! row rests for `cooldown`; then the next request tries it again, and a
//! success makes it healthy. When every upstream is resting, they are
//! tried anyway, the soonest back first: resting is a preference, never a
//! reason to fail a request that one of them could answer.
//!
//! An invoke whose shared context names an upstream ([`UPSTREAM`], as
//! `model-fallback` with `upstreams` sets it) goes to that one only: the
//! filter chose it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::{self, BoxStream};

use super::{ChatModel, ModelEvent};
use crate::context::{Context, UPSTREAM};
use crate::types::{ChainError, ChatRequest, ChatResponse, ErrorKind};
use crate::types::{EmbeddingRequest, EmbeddingResponse};

/// When an upstream rests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Failures in a row after which an upstream rests (default 3).
    pub cool_after: u32,
    /// How long it rests (default 30 s).
    pub cooldown: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            cool_after: 3,
            cooldown: Duration::from_secs(30),
        }
    }
}

/// How one upstream of a pool is doing, for `/readyz` and `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamHealth {
    /// Its name (the operator's, or `<model>@<base_url>`).
    pub name: String,
    /// Its share of the requests.
    pub weight: u32,
    /// Whether its last request succeeded (or it has had none).
    pub healthy: bool,
    /// How long it still rests, if it does.
    pub resting: Option<Duration>,
    /// Requests sent to it.
    pub requests: u64,
    /// Those that failed.
    pub failures: u64,
    /// Times it was set to rest.
    pub cooldowns: u64,
}

/// Several models (upstreams) as one: see the module's documentation.
pub struct UpstreamPool {
    members: Vec<Member>,
    config: PoolConfig,
    next: AtomicU64,
}

struct Member {
    name: String,
    weight: u32,
    model: Arc<dyn ChatModel>,
    state: Mutex<State>,
    requests: AtomicU64,
    failures: AtomicU64,
    cooldowns: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Failures in a row.
    failing: u32,
    resting_until: Option<Instant>,
}

/// Whether another upstream may answer what this one failed.
fn fails_over(error: &ChainError) -> bool {
    matches!(
        error.kind,
        ErrorKind::Transient | ErrorKind::Timeout | ErrorKind::Overloaded
    )
}

impl UpstreamPool {
    /// An empty pool resting its upstreams as `config` says.
    pub fn new(config: PoolConfig) -> Self {
        UpstreamPool {
            members: Vec::new(),
            config,
            next: AtomicU64::new(0),
        }
    }

    /// The pool with `model` as one more upstream, named `name`, of
    /// `weight`: its share of the requests, or 0 for a standby that gets
    /// only those the others fail (or that name it).
    pub fn upstream(mut self, name: impl Into<String>, weight: u32, model: impl ChatModel) -> Self {
        self.members.push(Member {
            name: name.into(),
            weight,
            model: Arc::new(model),
            state: Mutex::new(State::default()),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            cooldowns: AtomicU64::new(0),
        });
        self
    }

    /// The upstreams a request tries, in order: only the one the context
    /// names under [`UPSTREAM`], if it names one; else [`Self::balanced`].
    fn order(&self, context: &Context) -> Result<Vec<usize>, ChainError> {
        let Some(named) = context.get(UPSTREAM) else {
            return Ok(self.balanced());
        };
        let named = named.as_str().unwrap_or_default();
        match self.members.iter().position(|m| m.name == named) {
            Some(i) => Ok(vec![i]),
            None => {
                let names: Vec<&str> = self.members.iter().map(|m| m.name.as_str()).collect();
                Err(ChainError::new(
                    ErrorKind::NotFound,
                    format!(
                        "no upstream is named '{named}'; this route's are {}",
                        names.join(", ")
                    ),
                ))
            }
        }
    }

    /// The order in which a request tries the upstreams: the one the
    /// weights choose among those not resting, the others not resting
    /// after it, the standbys (weight 0) not resting, then the resting
    /// ones, the soonest back first.
    fn balanced(&self) -> Vec<usize> {
        let now = Instant::now();
        let resting: Vec<Option<Instant>> = self
            .members
            .iter()
            .map(|m| m.state().resting_until.filter(|until| *until > now))
            .collect();
        let (awake, standby): (Vec<usize>, Vec<usize>) = (0..self.members.len())
            .filter(|i| resting[*i].is_none())
            .partition(|i| self.members[*i].weight > 0);
        let mut order = Vec::with_capacity(self.members.len());
        let total: u64 = awake
            .iter()
            .map(|i| u64::from(self.members[*i].weight))
            .sum();
        if total > 0 {
            let mut tick = self.next.fetch_add(1, Ordering::Relaxed) % total;
            let first = awake
                .iter()
                .position(|i| {
                    let weight = u64::from(self.members[*i].weight);
                    if tick < weight {
                        return true;
                    }
                    tick -= weight;
                    false
                })
                .unwrap_or(0);
            order.extend(awake[first..].iter().chain(&awake[..first]));
        }
        order.extend(standby);
        let mut asleep: Vec<usize> = (0..self.members.len())
            .filter(|i| resting[*i].is_some())
            .collect();
        asleep.sort_by_key(|i| resting[*i]);
        order.extend(asleep);
        order
    }

    fn succeeded(&self, member: &Member) {
        member.requests.fetch_add(1, Ordering::Relaxed);
        *member.state() = State::default();
    }

    fn failed(&self, member: &Member, error: &ChainError) {
        member.requests.fetch_add(1, Ordering::Relaxed);
        member.failures.fetch_add(1, Ordering::Relaxed);
        let mut state = member.state();
        state.failing += 1;
        if state.failing >= self.config.cool_after {
            state.resting_until = Some(Instant::now() + self.config.cooldown);
            member.cooldowns.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                upstream = member.name,
                "the upstream failed {} times in a row ({error}); it rests for {} ms",
                state.failing,
                self.config.cooldown.as_millis()
            );
        } else {
            tracing::info!(
                upstream = member.name,
                "the upstream failed ({error}); trying the next"
            );
        }
    }

    /// What `call` answers on the first upstream, in the request's order,
    /// that does not fail in a way the next may not.
    async fn answered<'a, T, F>(
        &'a self,
        context: &Context,
        call: impl Fn(&'a Arc<dyn ChatModel>) -> F,
    ) -> Result<T, ChainError>
    where
        F: Future<Output = Result<T, ChainError>>,
    {
        let mut last = None;
        for i in self.order(context)? {
            let member = &self.members[i];
            match call(&member.model).await {
                Err(error) if fails_over(&error) => {
                    self.failed(member, &error);
                    last = Some(error);
                }
                answered => {
                    // A request refused for what it is: the upstream works.
                    self.succeeded(member);
                    return answered;
                }
            }
        }
        Err(last.unwrap_or_else(Self::empty))
    }

    fn empty() -> ChainError {
        ChainError::new(ErrorKind::Internal, "the upstream pool has no upstreams")
    }
}

impl Member {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl ChatModel for UpstreamPool {
    fn name(&self) -> &str {
        self.members.first().map_or("pool", |m| m.model.name())
    }

    async fn chat(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        self.answered(context, |model| model.chat(request, context))
            .await
    }

    /// Fails over until an upstream's stream yields its first event; from
    /// then on the answer is that upstream's (what was delivered cannot
    /// be taken back).
    async fn stream(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let mut last = None;
        for i in self.order(context)? {
            let member = &self.members[i];
            let first = match member.model.stream(request, context).await {
                Ok(mut events) => events.next().await.map(|first| (first, events)),
                Err(error) => Some((Err(error), stream::empty().boxed())),
            };
            match first {
                Some((Err(error), _)) if fails_over(&error) => {
                    self.failed(member, &error);
                    last = Some(error);
                }
                Some((first, events)) => {
                    self.succeeded(member);
                    return Ok(stream::once(async { first }).chain(events).boxed());
                }
                None => {
                    self.succeeded(member);
                    return Ok(stream::empty().boxed());
                }
            }
        }
        Err(last.unwrap_or_else(Self::empty))
    }

    async fn embed(
        &self,
        request: &EmbeddingRequest,
        context: &Context,
    ) -> Result<EmbeddingResponse, ChainError> {
        self.answered(context, |model| model.embed(request, context))
            .await
    }

    fn upstreams(&self) -> Vec<UpstreamHealth> {
        let now = Instant::now();
        self.members
            .iter()
            .map(|member| {
                let state = member.state();
                UpstreamHealth {
                    name: member.name.clone(),
                    weight: member.weight,
                    healthy: state.failing == 0,
                    resting: state
                        .resting_until
                        .and_then(|until| until.checked_duration_since(now))
                        .filter(|left| !left.is_zero()),
                    requests: member.requests.load(Ordering::Relaxed),
                    failures: member.failures.load(Ordering::Relaxed),
                    cooldowns: member.cooldowns.load(Ordering::Relaxed),
                }
            })
            .collect()
    }
}
