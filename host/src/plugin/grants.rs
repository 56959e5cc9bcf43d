//! What an operator grants a filter beyond the default nothing.

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::conversation::StoreSpec;

/// Capabilities an operator grants a filter beyond the default nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Grants {
    /// Real wall and monotonic clocks (otherwise both read zero).
    pub clock: bool,
    /// Milliseconds one hook call may sleep through the `timer` import, in
    /// all (0, the default: none).
    pub sleep_ms: u32,
    /// Whether the filter may ask the host's approval handler (the
    /// `approval` import).
    pub approval: bool,
    /// Where the filter's `trace` events go. `None`: no tracing.
    pub trace: Option<TraceTarget>,
    /// The conversation store of the `memory` import. `None`: no store.
    pub memory: Option<StoreSpec>,
    /// The key store of the `kv` import, and the namespace its keys live
    /// in. `None`: no store.
    pub kv: Option<KvGrant>,
    /// The origins `wasi:http/outgoing-handler` may reach, and its bounds.
    /// `None`: every request is refused.
    pub http: Option<HttpGrant>,
    /// The model of the `model` import (side calls), and its bounds.
    /// `None`: no side calls.
    pub model: Option<ModelGrant>,
}

/// The `model` grant: which model a filter may call aside, by the name the
/// kernel gives it (`default`: the model behind the filter's chain, its
/// route's upstream in `shallot serve`; `embedded`: the embedded model),
/// and how much one hook call may ask of it. Written `model = "default"`
/// or `model = { name = "default", calls = 4, tokens = 8192 }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ModelForm")]
pub struct ModelGrant {
    /// The model's name.
    pub name: String,
    /// Side calls one hook call may make.
    pub calls: u32,
    /// Tokens (input and output, as the model reports them) the side calls
    /// of one hook call may spend in all.
    pub tokens: u32,
}

impl ModelGrant {
    /// Side calls per hook call unless the operator says otherwise.
    pub const CALLS: u32 = 4;
    /// Tokens per hook call unless the operator says otherwise.
    pub const TOKENS: u32 = 8192;

    /// A grant of the model `name`, with the default bounds.
    pub fn of(name: impl Into<String>) -> Self {
        ModelGrant {
            name: name.into(),
            calls: Self::CALLS,
            tokens: Self::TOKENS,
        }
    }
}

/// The two ways an operator writes a `model` grant.
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "a model's name (\"default\", \"embedded\") or a table { name = \"...\", calls = 4, tokens = 8192 }"
)]
enum ModelForm {
    Name(String),
    Table(ModelTable),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelTable {
    name: String,
    #[serde(default = "calls")]
    calls: u32,
    #[serde(default = "tokens")]
    tokens: u32,
}

fn calls() -> u32 {
    ModelGrant::CALLS
}

fn tokens() -> u32 {
    ModelGrant::TOKENS
}

impl From<ModelForm> for ModelGrant {
    fn from(form: ModelForm) -> Self {
        match form {
            ModelForm::Name(name) => ModelGrant::of(name),
            ModelForm::Table(ModelTable {
                name,
                calls,
                tokens,
            }) => ModelGrant {
                name,
                calls,
                tokens,
            },
        }
    }
}

/// The `kv` grant: a store (as for `memory`), and the namespace of the
/// filter's keys: its own name unless the operator names one, so that the
/// filters naming the same one share keys. Written `kv = "<store>"` or
/// `kv = { store = "<store>", namespace = "<name>" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "KvForm")]
pub struct KvGrant {
    /// Where the keys are kept.
    pub store: StoreSpec,
    /// The namespace; `None`: the filter's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl From<StoreSpec> for KvGrant {
    fn from(store: StoreSpec) -> Self {
        KvGrant {
            store,
            namespace: None,
        }
    }
}

/// The two ways an operator writes a `kv` grant.
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "a store (a SQLite file's path, a redis:// URL or \":memory:\") or a table { store = \"...\", namespace = \"...\" }"
)]
enum KvForm {
    Store(StoreSpec),
    Table(KvTable),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KvTable {
    store: StoreSpec,
    namespace: Option<String>,
}

impl From<KvForm> for KvGrant {
    fn from(form: KvForm) -> Self {
        match form {
            KvForm::Store(store) => store.into(),
            KvForm::Table(KvTable { store, namespace }) => KvGrant { store, namespace },
        }
    }
}

/// Where a filter's `trace` events go, parsed once from the operator's
/// text: `"stderr"`, else a file's path, appended to (created if missing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum TraceTarget {
    /// The host's standard error.
    Stderr,
    /// A file, one JSON line per event.
    File(PathBuf),
}

impl From<&str> for TraceTarget {
    fn from(target: &str) -> Self {
        match target {
            "stderr" => TraceTarget::Stderr,
            path => TraceTarget::File(path.into()),
        }
    }
}

impl From<String> for TraceTarget {
    fn from(target: String) -> Self {
        TraceTarget::from(target.as_str())
    }
}

impl From<PathBuf> for TraceTarget {
    fn from(path: PathBuf) -> Self {
        TraceTarget::File(path)
    }
}

impl From<TraceTarget> for String {
    fn from(target: TraceTarget) -> Self {
        target.to_string()
    }
}

impl fmt::Display for TraceTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceTarget::Stderr => f.write_str("stderr"),
            TraceTarget::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// The `http` grant: the origins a filter's outgoing requests
/// (`wasi:http/outgoing-handler`) may reach, and their bounds. Written
/// `http = ["https://api.example.com", ...]` or as a table of the fields
/// below. A request to any other origin is refused, and so is one to a
/// loopback, link-local or private address, unless its origin names that
/// address (`http://127.0.0.1:9000`, `http://localhost:9000`) or is listed
/// in `private`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "HttpForm")]
pub struct HttpGrant {
    /// The origins requests may go to.
    pub origins: Vec<HttpOrigin>,
    /// Origins whose names may resolve to loopback, link-local or private
    /// addresses (a service on the operator's own network); each is
    /// reachable as if it were in `origins`.
    pub private: Vec<HttpOrigin>,
    /// Requests one hook call may send (a token transformer's steps: its
    /// stream).
    pub requests: u32,
    /// The most one request may take, from sending it to the last byte of
    /// its response, in milliseconds.
    pub timeout_ms: u32,
    /// The largest request body, in bytes.
    pub send_bytes: u64,
    /// The largest response body, in bytes.
    pub receive_bytes: u64,
}

impl HttpGrant {
    /// Requests per hook call unless the operator says otherwise.
    pub const REQUESTS: u32 = 16;
    /// Milliseconds per request unless the operator says otherwise.
    pub const TIMEOUT_MS: u32 = 5_000;
    /// Request body bytes unless the operator says otherwise.
    pub const SEND_BYTES: u64 = 1 << 20;
    /// Response body bytes unless the operator says otherwise.
    pub const RECEIVE_BYTES: u64 = 4 << 20;

    /// A grant of `origins` with the default bounds.
    pub fn to(origins: impl IntoIterator<Item = HttpOrigin>) -> Self {
        HttpTable {
            origins: origins.into_iter().collect(),
            ..HttpTable::default()
        }
        .into()
    }

    /// The listed origin `origin` is, if it is one, and whether its name
    /// may resolve to a private address.
    pub fn admits(&self, origin: &HttpOrigin) -> Option<bool> {
        if self.private.contains(origin) {
            Some(true)
        } else {
            self.origins.contains(origin).then_some(false)
        }
    }
}

/// The two ways an operator writes an `http` grant. Told apart by their
/// shape (a list or a table), so that a wrong origin inside either is
/// reported as itself.
enum HttpForm {
    Origins(Vec<HttpOrigin>),
    Table(HttpTable),
}

impl<'de> Deserialize<'de> for HttpForm {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Form;
        impl<'de> serde::de::Visitor<'de> for Form {
            type Value = HttpForm;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of origins ([\"https://host[:port]\"]) or a table { origins = [...], private = [...], requests, timeout_ms, send_bytes, receive_bytes }")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<HttpForm, A::Error> {
                let origins =
                    Deserialize::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))?;
                Ok(HttpForm::Origins(origins))
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<HttpForm, A::Error> {
                let table =
                    Deserialize::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(HttpForm::Table(table))
            }
        }
        deserializer.deserialize_any(Form)
    }
}

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct HttpTable {
    origins: Vec<HttpOrigin>,
    private: Vec<HttpOrigin>,
    requests: u32,
    timeout_ms: u32,
    send_bytes: u64,
    receive_bytes: u64,
}

impl Default for HttpTable {
    fn default() -> Self {
        HttpTable {
            origins: Vec::new(),
            private: Vec::new(),
            requests: HttpGrant::REQUESTS,
            timeout_ms: HttpGrant::TIMEOUT_MS,
            send_bytes: HttpGrant::SEND_BYTES,
            receive_bytes: HttpGrant::RECEIVE_BYTES,
        }
    }
}

impl From<HttpTable> for HttpGrant {
    fn from(t: HttpTable) -> Self {
        HttpGrant {
            origins: t.origins,
            private: t.private,
            requests: t.requests,
            timeout_ms: t.timeout_ms,
            send_bytes: t.send_bytes,
            receive_bytes: t.receive_bytes,
        }
    }
}

impl From<HttpForm> for HttpGrant {
    fn from(form: HttpForm) -> Self {
        match form {
            HttpForm::Origins(origins) => HttpGrant::to(origins),
            HttpForm::Table(table) => table.into(),
        }
    }
}

/// An origin: a scheme (`http` or `https`), a host and a port (the
/// scheme's own when not written). Parsed from `"https://host[:port]"`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct HttpOrigin {
    /// Whether it is `https`.
    pub tls: bool,
    /// The host, lowercase; an IPv6 address without its brackets.
    pub host: String,
    /// The port: the one written, else 443 for https and 80 for http.
    pub port: u16,
}

impl HttpOrigin {
    /// The address the origin names, if its host is one.
    pub fn address(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }

    /// Its host and port as a request's `Host` header writes them (the
    /// port only when it is not the scheme's own).
    pub fn authority(&self) -> String {
        let host = match self.address() {
            Some(IpAddr::V6(_)) => format!("[{}]", self.host),
            _ => self.host.clone(),
        };
        if self.port == if self.tls { 443 } else { 80 } {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }

    /// Whether its host is `localhost`, which names the loopback addresses.
    pub fn is_localhost(&self) -> bool {
        self.host == "localhost"
    }

    /// The origin of a request to `scheme://authority`, if it has one.
    pub fn of(tls: bool, authority: &http::uri::Authority) -> Self {
        let host = authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        HttpOrigin {
            tls,
            host: host.to_ascii_lowercase(),
            port: authority.port_u16().unwrap_or(if tls { 443 } else { 80 }),
        }
    }
}

impl TryFrom<String> for HttpOrigin {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        let bad = |why: &str| format!("`{text}` is not an origin (\"https://host[:port]\"): {why}");
        let uri: http::Uri = text.parse().map_err(|e| bad(&format!("{e}")))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            Some(other) => return Err(bad(&format!("the scheme `{other}` is not http or https"))),
            None => return Err(bad("it has no scheme")),
        };
        let authority = uri.authority().ok_or_else(|| bad("it has no host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("it names a user"));
        }
        if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
            return Err(bad("an origin has no path"));
        }
        Ok(HttpOrigin::of(tls, authority))
    }
}

impl From<HttpOrigin> for String {
    fn from(origin: HttpOrigin) -> Self {
        origin.to_string()
    }
}

impl fmt::Display for HttpOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        match self.address() {
            Some(IpAddr::V6(_)) => write!(f, "{scheme}://[{}]:{}", self.host, self.port),
            _ => write!(f, "{scheme}://{}:{}", self.host, self.port),
        }
    }
}
