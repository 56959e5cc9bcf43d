//! Making an instance of a filter component: a fresh store under the
//! filter's quotas, its start functions run, tried again where the host
//! (not the component) was briefly busy.

use wasmtime::Store;

use super::bindings::Filter as FilterWorld;
use super::host::HostState;
use super::instance::InstanceTemplate;
use crate::sandbox::{self, Confinement};
use crate::types::{Call, ChainError};

/// How many times making an instance is tried while the host says it is
/// busy.
const BUSY_TRIES: u32 = 3;

/// Makes an instance of the component in a fresh store: its start
/// functions run under its quotas. Where the host's kernel was briefly busy
/// (see [`host_busy`]), a fresh store tries again.
pub(super) async fn instantiate(
    template: &InstanceTemplate,
) -> Result<(Store<HostState>, Box<FilterWorld>), ChainError> {
    let mut tries = 1;
    loop {
        let confinement = Confinement::new(&template.limits, template.grants.clock);
        let state = HostState::new(
            template.identity.clone(),
            template.limits,
            confinement,
            template.declares,
            template.services.clone(),
        );
        let mut store = Store::new(template.pre.engine(), state);
        sandbox::prepare_store(&mut store, &template.limits);
        let meter = store.data().confinement.meter().clone();
        match sandbox::metered(meter, template.pre.instantiate_async(&mut store)).await {
            Ok(exports) => return Ok((store, Box::new(exports))),
            Err(e) if tries < BUSY_TRIES && host_busy(&e) => {
                tracing::debug!(
                    filter = &*template.identity.name,
                    "making an instance: the host was busy ({:#}); trying again",
                    e
                );
                tries += 1;
            }
            Err(e) => {
                let origin = template.identity.origin(Call::Instantiate);
                let state = store.data();
                return Err(sandbox::fault(e, &state.confinement, &state.limits, origin));
            }
        }
    }
}

/// Whether making an instance failed because the host was busy, not through
/// the component. The first instance of a module puts its memory image in a
/// sealed memfd, and Linux refuses the seal (`EBUSY`) while a page just
/// written is still referenced elsewhere (another CPU's LRU batch); a fresh
/// memfd a moment later takes it.
fn host_busy(error: &wasmtime::Error) -> bool {
    error
        .root_cause()
        .downcast_ref::<std::io::Error>()
        .is_some_and(|e| e.kind() == std::io::ErrorKind::ResourceBusy)
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::host_busy;

    #[test]
    fn only_a_busy_host_is_tried_again() {
        let sealed = wasmtime::Error::new(io::Error::from_raw_os_error(16))
            .context("cannot add seals to the memfd")
            .context("making the memory image");
        assert!(host_busy(&sealed));
        let denied = wasmtime::Error::new(io::Error::from(io::ErrorKind::PermissionDenied));
        assert!(!host_busy(&denied));
        assert!(!host_busy(&wasmtime::Error::msg("import not found")));
    }
}
