//! The `epserve` binary: see `epserve::cli::main`.

fn main() {
    epserve::cli::main()
}
