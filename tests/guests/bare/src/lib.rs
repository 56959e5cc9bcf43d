//! Benchmark guest: one export that does nothing, the cost floor of a
//! component call that the filter-layer benchmarks are measured against.

wit_bindgen::generate!({
    inline: "
        package shallot-bench:bare;
        world bare {
            export noop: func();
        }
    ",
});

struct Bare;

impl Guest for Bare {
    fn noop() {}
}

export!(Bare);
