//! The caps on an instance's linear memory and tables.

use wasmtime::ResourceLimiter;

use super::fault::TablesExceeded;

/// Elements all tables of an instance may hold together.
pub(super) const TABLE_ELEMENTS: usize = 1 << 20;

/// Linear memory and table caps of one instance. Growing memory past the
/// cap fails the way wasm says it may (`memory.grow` returns -1), so a
/// runtime with a garbage collector (JavaScript's) collects and goes on;
/// a guest that cannot go on traps, and `denied` makes that trap a
/// memory-cap fault.
pub(super) struct GrowthCaps {
    memory_cap: usize,
    pub(super) memory: usize,
    table_elements: usize,
    /// A growth was refused during the current call.
    pub(super) denied: bool,
}

impl ResourceLimiter for GrowthCaps {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let total = self.memory - current.min(self.memory) + desired;
        if total > self.memory_cap {
            self.denied = true;
            return Ok(false);
        }
        self.memory = total;
        Ok(true)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let total = self.table_elements - current.min(self.table_elements) + desired;
        if total > TABLE_ELEMENTS {
            return Err(wasmtime::Error::new(TablesExceeded));
        }
        self.table_elements = total;
        Ok(true)
    }
}

impl GrowthCaps {
    pub(super) fn new(memory_mib: u32) -> Self {
        GrowthCaps {
            memory_cap: (memory_mib as usize) << 20,
            memory: 0,
            table_elements: 0,
            denied: false,
        }
    }
}
