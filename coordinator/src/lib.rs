//! The coordinator role: the cluster's front, and the single-process server.
//!
//! - [`server`]: the OpenAI HTTP API (axum): parse and validate requests,
//!   SSE / JSON responses, errors;
//! - [`scheduler`]: one thread owns the queue and the KV pool: continuous
//!   batching, chunked prefill, preemption;
//! - [`metrics`]: the Prometheus recorder and `epserve_` series;
//! - [`serve`]: `epserve serve`, the single-process server;
//! - [`cluster`]: `epserve coordinator`: the gRPC dispatcher, remote
//!   attention, expert load statistics, the rebalance controller, the admin
//!   service.
#![deny(clippy::print_stdout)]

pub mod cluster;
pub mod metrics;
pub mod scheduler;
pub mod serve;
pub mod server;
