//! Test guest: a valid component that is not a filter (a WASI command).

fn main() {
    println!("hello from a command, not a filter");
}
