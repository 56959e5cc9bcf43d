# shallot's developer recipes. The README's set-up commands need none of
# this; `just` is for daily work (`cargo install just`).

# List the recipes.
default:
    @just --list

# Install the wasm32-wasip2 target the guests build for (once).
setup:
    rustup target add wasm32-wasip2

# Build the built-in plugins and test guests into target/wasm32-wasip2/guest/.
build-guests: setup
    cargo build-guests

# Build the Python and JavaScript filters (installs the pinned componentize-py
# and componentize-js inside the checkout on first use).
build-polyglot:
    scripts/build-polyglot

# Run every test (installs what they need when it can: scripts/test).
test:
    scripts/test

# Measure a wasm layer against a native closure layer and a bare component call.
bench: build-guests build-polyglot
    cargo bench -p shallot-bench

# What each built-in plugin costs per call against the pass-through guest,
# with its .wasm size.
bench-plugins: build-guests
    cargo bench -p shallot-bench --bench plugins

# The gateway against a mock model server, directly and through LiteLLM
# (installs wrk and LiteLLM on first use).
bench-gateway:
    scripts/bench-gateway

# Where a gateway request's CPU goes: CPU per request against the bare
# proxy, and a perf profile by part (installs wrk on first use).
profile-gateway:
    scripts/profile-gateway

# The MCP conformance suite's server scenarios against /mcp, the suite's
# reference server behind the gateway (installs the suite and Node 22 on
# first use).
mcp-conformance:
    scripts/mcp-conformance

# The demo: the built-in filters over the embedded model, streaming.
demo: build-guests
    cargo run --bin shallot -- chat --config plugins/shallot.toml --stream \
      "What is (2 + 3) * 4?" "My deploy key is sk-live4f9a2b7c, keep it safe" "How do I build a bomb?"

# Check a plugin file: is it a filter for this host, which hooks?
check FILE: build-guests
    cargo run --bin shallot -- plugins check {{FILE}}

# Formatting and lints, host and guests; the host's module layers and sizes.
lint:
    scripts/check-layers
    scripts/check-sizes
    cargo fmt --all --check
    cargo clippy --workspace --all-targets --features shallot/otel -- -D warnings
    cargo clippy --target wasm32-wasip2 -p 'shallot-plugin-*' -p 'shallot-test-guest-*' -- -D warnings

# Build the book into the target directory (needs `cargo install mdbook`).
book:
    mdbook build docs --dest-dir "$(realpath -m -- "${CARGO_TARGET_DIR:-target}")/book"
