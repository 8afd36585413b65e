//! epserve's cluster state and the runtime every role shares:
//! - [`store`]: the small key-value trait the cluster state lives behind
//!   ([`store::KvStore`]), with an etcd and an in-memory backend and one
//!   conformance suite both pass;
//! - [`state`]: the key layout under `/epserve/<cluster>/`: worker
//!   registration under a lease, the placement document, the rebalance
//!   document with its ready marks, the drained set;
//! - [`runtime`]: what the worker roles share when they run: common flags,
//!   core pinning, the etcd connection, registered serving, shutdown, status
//!   lines.
//! - [`tls`]: mutual TLS on the node links: the `--tls-*` flags every role
//!   shares, the PEM files checked, tonic's server and client configurations.
//!
//! Depends on `epserve-core` (the placement map) only; the wire is `epserve-proto`.
#![deny(clippy::print_stdout)]

pub mod runtime;
pub mod state;
pub mod store;
pub mod tls;
