//! The coordinator crate: the `epserve` binary's subcommands. Today that is the
//! single-process `generate` command; the OpenAI server, scheduler, gRPC
//! dispatch and admin RPC arrive here with their issues.

pub mod bench_moe;
pub mod bench_serve;
pub mod cli;
pub mod cluster;
pub mod ctl;
pub mod generate;
pub mod metrics;
pub mod plan;
pub mod scheduler;
pub mod serve;
pub mod server;
