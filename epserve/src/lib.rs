//! The `epserve` binary's library half: [`cli`], the subcommands of the one
//! binary (roles from the role crates, tools from `epserve-tools`). A library
//! so that test crates can build a binary with the same behaviour
//! (`tests/src/bin/epserve-it.rs`).

pub mod cli;
