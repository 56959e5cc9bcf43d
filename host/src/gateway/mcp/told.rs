//! Telling `/mcp`'s clients that its tools (and prompts and resources)
//! changed, and ending their
//! streams when the gateway shuts down. A client hears of a change on the
//! stream its protocol gives it: a `subscriptions/listen` request (the
//! 2026-07-28 protocol), or the session's own stream (`GET /mcp`) for a
//! session of the initialize handshake.

use std::sync::{Mutex, PoisonError, Weak};
use std::time::Duration;

use rmcp::service::{Peer, RoleServer, SubscriptionContext};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use tokio::sync::watch;

/// How long telling one session may take (its client may not read its
/// stream), and how long closing one's stream at a shutdown may.
pub(super) const NOTICE: Duration = Duration::from_secs(5);

/// The peers of the sessions opened with the initialize handshake, told
/// when the tools change; a closed session's peer is dropped at the next
/// session opened or the next change.
#[derive(Default)]
pub(super) struct Handshaken(Mutex<Vec<Peer<RoleServer>>>);

impl Handshaken {
    pub(super) fn add(&self, peer: Peer<RoleServer>) {
        self.open().push(peer);
    }

    fn open(&self) -> std::sync::MutexGuard<'_, Vec<Peer<RoleServer>>> {
        let mut peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        peers.retain(|peer| !peer.is_transport_closed());
        peers
    }
}

/// Beside the service: tells every handshaken session
/// `notifications/tools/list_changed` each time the endpoint is replaced,
/// each on its own within [`NOTICE`] (a client that does not read holds
/// back no other). When the drain starts, closes each session's own
/// stream (`GET /mcp`, which the shutdown would otherwise wait on until the
/// SDK gives up on it; the calls in flight finish), and ends; it ends too
/// with the service.
pub(super) async fn tell(
    mut menus: watch::Receiver<u64>,
    mut draining: watch::Receiver<bool>,
    handshaken: Weak<Handshaken>,
    sessions: Weak<LocalSessionManager>,
) {
    loop {
        tokio::select! {
            changed = menus.changed() => {
                let (Ok(()), Some(handshaken)) = (changed, handshaken.upgrade()) else {
                    return;
                };
                let peers = handshaken.open().clone();
                for peer in peers {
                    tokio::spawn(async move {
                        let told = async {
                            peer.notify_tool_list_changed().await?;
                            peer.notify_prompt_list_changed().await?;
                            peer.notify_resource_list_changed().await
                        };
                        let _ = tokio::time::timeout(NOTICE, told).await;
                    });
                }
            }
            () = drained(&mut draining) => {
                let Some(sessions) = sessions.upgrade() else {
                    return;
                };
                let open: Vec<_> = sessions.sessions.read().await.values().cloned().collect();
                let closing = open.iter().map(|session| {
                    tokio::time::timeout(NOTICE, session.close_standalone_sse_stream(None))
                });
                futures::future::join_all(closing).await;
                return;
            }
        }
    }
}

/// A `subscriptions/listen`: told each time the endpoint is replaced,
/// until the client ends it, or the gateway shuts down (then closed
/// gracefully at once, with its final result, rather than cut).
pub(super) async fn listen(
    context: SubscriptionContext,
    mut menus: watch::Receiver<u64>,
    mut draining: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            () = context.cancelled() => return,
            () = drained(&mut draining) => return,
            changed = menus.changed() => {
                if changed.is_err() || tell_listener(&context).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Tells a listen that the lists it asked to hear of changed.
async fn tell_listener(
    context: &SubscriptionContext,
) -> Result<(), rmcp::service::SubscriptionSendError> {
    let (sink, asked) = (context.sink(), context.accepted().clone());
    if asked.tools_list_changed == Some(true) {
        sink.notify_tool_list_changed().await?;
    }
    if asked.prompts_list_changed == Some(true) {
        sink.notify_prompt_list_changed().await?;
    }
    if asked.resources_list_changed == Some(true) {
        sink.notify_resource_list_changed().await?;
    }
    Ok(())
}

/// Resolves when the drain has started.
async fn drained(draining: &mut watch::Receiver<bool>) {
    let _ = draining.wait_for(|draining| *draining).await;
}
