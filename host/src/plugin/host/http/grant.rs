//! The `wasi:http` grant: the origins a filter's outgoing requests may
//! reach, and their bounds; and the service as a unit.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::plugin::host::service::{GrantedServices, HOOKS, Service, Spent};
use crate::types::Call;

/// The `wasi:http` service: its grant lists origins. A request's count is
/// kept where it is sent ([`super::OutgoingHttp`]), with the grant.
pub(crate) struct Http;

impl Service for Http {
    const IMPORT: &'static str = "wasi:http/outgoing-handler";
    const CALLED: &'static str = "wasi:http/outgoing-handler";
    const CALLS: &'static [Call] = HOOKS;
    const GRANT: &'static str = "http = [\"https://host\"]";
    type Granted = Arc<HttpGrant>;
    type Spent = ();

    fn granted(services: &GrantedServices) -> Option<&Arc<HttpGrant>> {
        services.http.as_ref()
    }

    fn spent(spent: &mut Spent) -> &mut () {
        &mut spent.http
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
