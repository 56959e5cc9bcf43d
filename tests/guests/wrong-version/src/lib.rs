//! Test guest: a filter built against shallot:filter@0.2.0, which this host
//! must refuse with a message naming both versions.

wit_bindgen::generate!({ path: "wit" });

struct Future;

impl exports::shallot::filter::plugin::Guest for Future {
    fn configure(_config: String) -> Result<(), String> {
        Ok(())
    }
}

export!(Future);
