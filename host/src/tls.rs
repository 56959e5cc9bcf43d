//! The TLS client every outgoing connection of the host uses: the web's
//! roots (webpki-roots, the same on every machine), ring's cryptography.

use std::sync::{Arc, LazyLock};

static CONFIG: LazyLock<Arc<rustls::ClientConfig>> = LazyLock::new(|| {
    let roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.into(),
    };
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports the default TLS versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    Arc::new(config)
});

/// The client configuration (ALPN unset: HTTP/1.1).
pub(crate) fn client_config() -> Arc<rustls::ClientConfig> {
    CONFIG.clone()
}
