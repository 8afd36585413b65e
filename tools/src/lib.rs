//! epserve's operator tools, apart from the serving roles: each module is one
//! subcommand of the `epserve` binary with its own `Args` and `run`.
//!
//! - [`generate`]: one prompt through the single-process engine;
//! - [`bench_serve`]: the serving benchmark (a twin of `vllm bench serve`);
//! - [`bench_moe`]: one MoE layer at real shapes against the machine's
//!   bandwidth and FMA peak and the scalar twin kernels;
//! - [`bench_linear`]: the dense projections on the packed panels against
//!   their scalar twin and the machine's bandwidth;
//! - [`bench_step`]: one forward step of a model folder, per phase, each
//!   against its roofline;
//! - [`bench_attention`]: the flash attention kernel (decode, prefill; f32
//!   and bf16 KV) against its scalar twin and the machine's bandwidth;
//! - [`plan`]: the capacity planner;
//! - [`ctl`]: the admin client of a running coordinator;
//! - [`up`]: a whole local cluster on loopback as child processes.
//! - [`pki`]: a small CA for the node links' mutual TLS (`up --secure`, tests).
//! - [`link`]: the link emulator `up --emulate-link` puts between the
//!   coordinator and each worker (delay, rate cap).
//!
//! Tools print their results on stdout; the serving roles never do.

pub mod bench_attention;
pub mod bench_linear;
pub mod bench_moe;
pub mod bench_sampling;
pub mod bench_serve;
pub mod bench_step;
pub mod ctl;
pub mod generate;
pub mod link;
pub mod pki;
pub mod plan;
pub mod up;
