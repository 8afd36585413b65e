//! The `epserve` binary: see `epserve_coordinator::cli::main`.

fn main() {
    epserve_coordinator::cli::main()
}
