//! `wasi:http/outgoing-handler`, granted by `grants.http`: the standard
//! import (so a Python filter's HTTP adapter, a JavaScript filter's
//! `fetch` and a Rust filter's wasi HTTP crate work as they are), sent by
//! the host only to the origins the operator lists.
//!
//! Each request is checked before anything leaves: the filter must hold
//! the grant and be in a hook (never while it is made or configured), the
//! request must be within the call's count, and its origin (scheme, host,
//! port) must be listed. Its host is then resolved once, the addresses are
//! checked (no loopback, link-local or private address unless the origin
//! names it or is listed as private), and the connection goes to a checked
//! address, never to a name resolved again (no DNS rebinding). A redirect
//! is only a response to the filter: following it is a new request,
//! checked the same way. The request's body, its response's body and its
//! whole time, to the last byte, are bounded; while it is in flight the
//! call's wall time is not the filter's own ([`Meter::wait`]), and the
//! invoke's deadline still bounds it. Each request is one of the invoke's
//! tree, and says so as a model call does (`x-shallot-hops` one more, a
//! loan of the tree in `x-shallot-budget`; no filter writes those
//! headers), so a filter's requests back into a gateway end as a loop of
//! side calls does.

use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::task::{Poll, ready};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};
use wasmtime_wasi_http::{Error, RequestOptions, WasiBody, WasiHttpHooks};

mod body;
mod grant;
mod reach;

use body::{Bounded, drain};
pub(crate) use grant::Http;
pub use grant::{HttpGrant, HttpOrigin};
use reach::reachable;

use super::service::Service;
use crate::context::{BUDGET_HEADER, BUDGET_LEFT_HEADER, Context, HOPS, HOPS_HEADER, Tree};

use crate::sandbox::{Meter, Wait};
use crate::types::Call;

/// A filter's outgoing requests: its grant, and what the current call has
/// sent. The hooks of its `wasi:http` view.
pub(crate) struct OutgoingHttp {
    grant: Option<Arc<HttpGrant>>,
    filter: Arc<str>,
    meter: Meter,
    call: Option<Call>,
    sent: u32,
    /// The call's invoke: the gateways its request passed through, and
    /// the requests its tree may still send.
    hops: u64,
    tree: Option<Arc<Tree>>,
}

impl OutgoingHttp {
    pub(crate) fn new(grant: Option<Arc<HttpGrant>>, filter: Arc<str>, meter: Meter) -> Self {
        OutgoingHttp {
            grant,
            filter,
            meter,
            call: None,
            sent: 0,
            hops: 0,
            tree: None,
        }
    }

    /// A call of the invoke whose context is `context` starts (with
    /// `fresh`, its count of requests starts anew, as the other per-call
    /// quotas do) or ends (`None`).
    pub(crate) fn enter(&mut self, call: Option<Call>, fresh: bool, context: Option<&Context>) {
        self.call = call;
        if fresh {
            self.sent = 0;
        }
        self.hops = context
            .and_then(|c| c.get(HOPS))
            .and_then(|h| h.as_u64())
            .unwrap_or(0);
        self.tree = context.and_then(|c| c.tree().cloned());
    }

    /// The grant and the origin `request` goes to, and whether the origin
    /// may resolve to a private address; or why it may not be sent. An
    /// admitted request is one of the tree's, and says so.
    fn admit(
        &mut self,
        request: &mut http::Request<WasiBody>,
    ) -> Result<Admitted, (Error, String)> {
        let Some(grant) = self.grant.clone() else {
            let why = "the `http` grant is not given to this filter; the operator grants origins with `grants = { http = [\"https://host\"] }`";
            return Err((Error::HttpRequestDenied, why.into()));
        };
        if !self.call.is_some_and(|call| Http::CALLS.contains(&call)) {
            let here = self.call.map_or("outside any call", Call::as_str);
            let why = format!("outgoing requests are for hooks, not for {here}");
            return Err((Error::HttpRequestDenied, why));
        }
        self.sent += 1;
        if self.sent > grant.requests {
            let why = format!("more than {} requests in one call", grant.requests);
            return Err((Error::ConnectionLimitReached, why));
        }
        let uri = request.uri();
        let Some(authority) = uri.authority() else {
            return Err((
                Error::HttpRequestUriInvalid,
                "the request has no host".into(),
            ));
        };
        // An origin is a scheme, a host and a port: a user and password in
        // the URL would reach the server in its `Host` header.
        if authority.as_str().contains('@') {
            let why = "a URL with a user or password is refused; send credentials in a header";
            return Err((Error::HttpRequestUriInvalid, why.into()));
        }
        let origin = HttpOrigin::of(uri.scheme_str() == Some("https"), authority);
        let Some(private) = grant.admits(&origin) else {
            let why = format!("{origin} is not among the granted origins");
            return Err((Error::HttpRequestDenied, why));
        };
        let loan = Loan::take(self.tree.clone()).ok_or_else(|| {
            let why = "the invoke's tree has made every request it may (x-shallot-budget)";
            (Error::ConnectionLimitReached, why.to_owned())
        })?;
        let headers = request.headers_mut();
        headers.insert(HOPS_HEADER, (self.hops + 1).into());
        if let Some(lent) = loan.lent {
            headers.insert(BUDGET_HEADER, lent.into());
        }
        Ok(Admitted {
            grant,
            origin,
            private,
            loan,
        })
    }
}

/// A request that may go: its grant, its origin and whether that may
/// resolve to a private address, its share of the tree.
struct Admitted {
    grant: Arc<HttpGrant>,
    origin: HttpOrigin,
    private: bool,
    loan: Loan,
}

/// A request's share of the invoke's tree: the loan a gateway it reaches
/// may spend, settled when its answer's head comes (or it fails).
struct Loan {
    tree: Option<Arc<Tree>>,
    lent: Option<u64>,
}

impl Loan {
    /// One request of `tree` and its loan (none for an unbounded invoke);
    /// `None` when the tree has sent all it may.
    fn take(tree: Option<Arc<Tree>>) -> Option<Loan> {
        let lent = match &tree {
            Some(tree) => Some(tree.take()?),
            None => None,
        };
        Some(Loan { tree, lent })
    }

    /// Takes back what was not spent: what a gateway answers it did not
    /// (all of it from a server that says nothing), none from a request
    /// that may still be spending.
    fn settle(&self, unspent: impl FnOnce(u64) -> u64) {
        if let (Some(tree), Some(lent)) = (&self.tree, self.lent) {
            tree.give_back(unspent(lent).min(lent));
        }
    }
}

type Sent = wasmtime_wasi_http::Result<(
    http::Response<WasiBody>,
    Box<dyn Future<Output = wasmtime_wasi_http::Result<()>> + Send>,
)>;

impl WasiHttpHooks for OutgoingHttp {
    /// wasi:http's own, and the host's: a filter writes no `x-shallot-*`
    /// header (the hops and the tree's loan are the host's to say).
    fn forbidden_header_filter(&mut self) -> wasmtime_wasi_http::ForbiddenHeaderFilter {
        Arc::new(|name| {
            wasmtime_wasi_http::DEFAULT_FORBIDDEN_HEADERS.contains(name)
                || name.as_str().starts_with("x-shallot-")
        })
    }

    fn send_request(
        &mut self,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
        _sent: Box<dyn Future<Output = wasmtime_wasi_http::Result<()>> + Send>,
    ) -> Box<dyn Future<Output = Sent> + Send> {
        let mut request = request;
        match self.admit(&mut request) {
            Ok(Admitted {
                grant,
                origin,
                private,
                loan,
            }) => {
                let held = Held::open(self.meter.wait(), grant.timeout_ms);
                Box::new(async move {
                    let sent = send(grant, origin, private, request, options, held).await;
                    loan.settle(|lent| match &sent {
                        Ok((response, _)) => response
                            .headers()
                            .get(BUDGET_LEFT_HEADER)
                            .and_then(|left| left.to_str().ok()?.parse().ok())
                            .unwrap_or(lent),
                        // Never reached the server.
                        Err(
                            Error::ConnectionRefused
                            | Error::Connect(_)
                            | Error::ConnectionTimeout
                            | Error::DestinationIpProhibited
                            | Error::DnsTimeout
                            | Error::DnsError { .. },
                        ) => lent,
                        Err(_) => 0,
                    });
                    sent
                })
            }
            Err((error, why)) => {
                tracing::warn!(filter = %self.filter, "refused an outgoing request: {why}");
                let deadline = Instant::now() + Duration::from_millis(HttpGrant::TIMEOUT_MS.into());
                Box::new(async move {
                    drain(request.into_body(), HttpGrant::SEND_BYTES, deadline).await;
                    Err(error)
                })
            }
        }
    }
}

/// The wait a request keeps open, closed when its response ends, when it
/// fails, or at its deadline, whichever comes first (a response the filter
/// never reads does not stop its clock for longer than the request may
/// take).
#[derive(Clone)]
struct Held {
    wait: Arc<Mutex<Option<Wait>>>,
    deadline: Instant,
}

impl Held {
    fn open(wait: Wait, timeout_ms: u32) -> Self {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms.into());
        let held = Held {
            wait: Arc::new(Mutex::new(Some(wait))),
            deadline,
        };
        let at_deadline = held.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            at_deadline.close();
        });
        held
    }

    fn close(&self) {
        self.wait
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }
}

/// A byte stream a request goes over: TCP, or TLS over TCP.
trait Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Stream for T {}

async fn send(
    grant: Arc<HttpGrant>,
    origin: HttpOrigin,
    private: bool,
    request: http::Request<WasiBody>,
    options: Option<RequestOptions>,
    held: Held,
) -> Sent {
    let deadline = held.deadline;
    let by = |asked: Option<Duration>| asked.map_or(deadline, |d| deadline.min(Instant::now() + d));
    let connect_by = by(options.and_then(|o| o.connect_timeout));
    let (sender, conn) = match open(&origin, private, connect_by).await {
        Ok(opened) => opened,
        Err(error) => {
            drain(request.into_body(), grant.send_bytes, deadline).await;
            return Err(error);
        }
    };
    exchange(
        &grant,
        &origin,
        request,
        sender,
        conn,
        by(options.and_then(|o| o.first_byte_timeout)),
        held,
    )
    .await
}

type Connection = hyper::client::conn::http1::Connection<TokioIo<Box<dyn Stream>>, WasiBody>;

/// Resolves the origin's host once, and connects to an address the
/// grant reaches.
async fn open(
    origin: &HttpOrigin,
    private: bool,
    connect_by: Instant,
) -> Result<
    (
        hyper::client::conn::http1::SendRequest<WasiBody>,
        Connection,
    ),
    Error,
> {
    let addresses = timeout_at(
        connect_by,
        tokio::net::lookup_host((origin.host.as_str(), origin.port)),
    )
    .await
    .map_err(|_| Error::DnsTimeout)?
    .map_err(|e| Error::DnsError {
        rcode: Some(e.to_string()),
        info_code: None,
    })?;
    let checked: Vec<SocketAddr> = addresses
        .filter(|a| reachable(origin, private, a.ip()))
        .collect();
    if checked.is_empty() {
        tracing::warn!(
            "refused an outgoing request to {origin}: it resolves only to addresses the grant does not reach"
        );
        return Err(Error::DestinationIpProhibited);
    }
    let stream = timeout_at(connect_by, connect(&checked, origin))
        .await
        .map_err(|_| Error::ConnectionTimeout)??;
    let handshake = hyper::client::conn::http1::Builder::new().handshake(TokioIo::new(stream));
    Ok(timeout_at(connect_by, handshake)
        .await
        .map_err(|_| Error::ConnectionTimeout)??)
}

/// Sends the request over an open connection, its `Host` the checked
/// origin's whatever the guest wrote, and bounds its response.
async fn exchange(
    grant: &HttpGrant,
    origin: &HttpOrigin,
    mut request: http::Request<WasiBody>,
    mut sender: hyper::client::conn::http1::SendRequest<WasiBody>,
    conn: Connection,
    first_byte_by: Instant,
    held: Held,
) -> Sent {
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
    *request.uri_mut() = http::Uri::builder()
        .path_and_query(path)
        .build()
        .map_err(|_| Error::HttpRequestUriInvalid)?;
    let host = http::HeaderValue::try_from(origin.authority())
        .map_err(|_| Error::HttpRequestUriInvalid)?;
    request.headers_mut().insert(http::header::HOST, host);
    let request = request.map(|body| {
        Bounded::new(body, grant.send_bytes, Error::HttpRequestBodySize, None).boxed_unsync()
    });
    let mut response = pin!(timeout_at(first_byte_by, sender.send_request(request)));
    let mut conn = Some(conn);
    let response = poll_fn(|cx| {
        if let Poll::Ready(response) = response.as_mut().poll(cx) {
            return Poll::Ready(response);
        }
        if let Some(driving) = conn.as_mut() {
            let ended = ready!(Pin::new(driving).poll(cx));
            conn = None;
            if let Err(e) = ended {
                return Poll::Ready(Ok(Err(e)));
            }
            return response.as_mut().poll(cx);
        }
        Poll::Pending
    })
    .await
    .map_err(|_| Error::ConnectionReadTimeout)??;
    let deadline = held.deadline;
    let response = response.map(|body| {
        let body = body.map_err(Error::from).boxed_unsync();
        Bounded::new(
            body,
            grant.receive_bytes,
            Error::HttpResponseBodySize,
            Some(held),
        )
        .boxed_unsync()
    });
    // The connection closes at the request's deadline however the filter
    // holds its response, so held responses cannot pile up open sockets.
    let io = async move {
        match conn {
            Some(conn) => timeout_at(deadline, conn)
                .await
                .map_err(|_| Error::HttpResponseTimeout)?
                .map_err(Error::from),
            None => Ok(()),
        }
    };
    Ok((response, Box::new(io)))
}

/// Connects to the first of `addresses` that answers, over TLS for an
/// `https` origin (its name checked against the certificate).
async fn connect(addresses: &[SocketAddr], origin: &HttpOrigin) -> Result<Box<dyn Stream>, Error> {
    let mut refused = Error::ConnectionRefused;
    for address in addresses {
        let tcp = match TcpStream::connect(address).await {
            Ok(tcp) => tcp,
            Err(e) => {
                refused = Error::Connect(e);
                continue;
            }
        };
        if !origin.tls {
            return Ok(Box::new(tcp));
        }
        let name = rustls::pki_types::ServerName::try_from(origin.host.clone())
            .map_err(|_| Error::HttpRequestUriInvalid)?;
        let tls = TLS.connect(name, tcp).await.map_err(Error::Tls)?;
        return Ok(Box::new(tls));
    }
    Err(refused)
}

/// The TLS client: the host's (`crate::tls`).
static TLS: LazyLock<tokio_rustls::TlsConnector> =
    LazyLock::new(|| tokio_rustls::TlsConnector::from(crate::tls::client_config()));
