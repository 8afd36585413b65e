//! The `epserve` program built inside the test crate, so its integration tests
//! can start real clusters (`CARGO_BIN_EXE_epserve-it`); same code as `epserve`.

fn main() {
    epserve::cli::main()
}
