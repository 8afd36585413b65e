//! Command-line interface of the one `epserve` binary: every role and tool is a
//! subcommand. Each command's `Args` lives with the command (the role or tool
//! crate); this file only names them. It is also the one place that decides
//! where the roles' status lines go: stdout, where `epserve up` and the tests
//! wait for them.

use clap::{Args, Parser, Subcommand};
use epserve_cluster::runtime::Status;

/// The whole program: parse the command line, run the subcommand, print a
/// one-line error and exit 1 on failure. (A function so that test crates can
/// build a binary with the same behaviour.)
pub fn main() {
    // Before any thread starts: a step's large transient buffers stay
    // mapped between steps (see mem::tune_malloc).
    epserve_core::mem::tune_malloc();
    // Spans (step, layer, dispatch, RPC handlers, loads) log their busy and
    // idle time when they close, so `EPSERVE_LOG=debug` shows where a step's
    // time goes.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("EPSERVE_LOG")
                // Warnings, and the load progress lines (bars on a terminal).
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,epserve_load=info")),
        )
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // Commands that run dense phases and experts in one process share one
    // pinned pool; the workers size their own from --cores.
    if matches!(
        cli.command,
        Command::Generate(_) | Command::Serve(_) | Command::Coordinator(_) | Command::Bench(_)
    ) {
        epserve_core::experts::pool::init_global_pool();
    }
    let status = Status::new(|line| println!("{line}"));
    let result = match &cli.command {
        Command::Generate(args) => epserve_tools::generate::run(args),
        Command::Serve(cmd) => epserve_coordinator::serve::run(&cmd.args(), status),
        Command::Coordinator(args) => epserve_coordinator::cluster::run(args, status),
        Command::ExpertWorker(args) => epserve_expert_worker::run(args, status),
        Command::AttentionWorker(args) => epserve_attention_worker::run(args, status),
        Command::Up(args) => epserve_tools::up::run(args),
        Command::Bench(bench) => match &bench.command {
            BenchCommand::Serve(args) => epserve_tools::bench_serve::run(args),
            BenchCommand::Moe(args) => epserve_tools::bench_moe::run(args),
            BenchCommand::Linear(args) => epserve_tools::bench_linear::run(args),
            BenchCommand::Step(args) => epserve_tools::bench_step::run(args),
            BenchCommand::Attention(args) => epserve_tools::bench_attention::run(args),
            BenchCommand::Sampling(args) => epserve_tools::bench_sampling::run(args),
        },
        Command::Plan(args) => epserve_tools::plan::run(args),
        Command::Ctl(args) => epserve_tools::ctl::run(args),
    };
    if let Err(e) = result {
        // One line: the error and its causes joined by ": ".
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// epserve: expert-parallel MoE inference on CPU clusters.
#[derive(Debug, Parser)]
#[command(name = "epserve", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// `epserve serve`: the server's flags, and `--tls-cert/--tls-key` as the
/// names of its HTTPS certificate (a single process has no node links, so
/// the short names are free; the coordinator, whose `--tls-*` are its node
/// links' mutual TLS, takes `--api-tls-*` only).
#[derive(Debug, clap::Args)]
pub struct ServeCmd {
    #[command(flatten)]
    pub serve: epserve_coordinator::serve::ServeArgs,
    /// HTTPS certificate chain of the OpenAI port (PEM), as --api-tls-cert.
    #[arg(
        long,
        value_name = "PATH",
        conflicts_with = "api_tls_cert",
        requires = "tls_key"
    )]
    pub tls_cert: Option<std::path::PathBuf>,
    /// Private key of --tls-cert (PEM), as --api-tls-key.
    #[arg(
        long,
        value_name = "PATH",
        conflicts_with = "api_tls_key",
        requires = "tls_cert"
    )]
    pub tls_key: Option<std::path::PathBuf>,
}

impl ServeCmd {
    /// The server's arguments, `--tls-cert/--tls-key` folded into `--api-tls-*`.
    pub fn args(&self) -> epserve_coordinator::serve::ServeArgs {
        let mut a = self.serve.clone();
        if self.tls_cert.is_some() {
            a.api_tls_cert = self.tls_cert.clone();
            a.api_tls_key = self.tls_key.clone();
        }
        a
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one prompt through the single-process engine and print the completion.
    Generate(Box<epserve_tools::generate::GenerateArgs>),
    /// Single-process OpenAI-compatible server (completions, chat, models, health, metrics).
    Serve(Box<ServeCmd>),
    /// The cluster's front: OpenAI API, scheduler, attention/router/combine,
    /// experts dispatched to expert-workers over gRPC (placement in etcd).
    Coordinator(Box<epserve_coordinator::cluster::CoordinatorArgs>),
    /// An expert-worker: holds the experts the placement assigns it, serves them over gRPC.
    ExpertWorker(Box<epserve_expert_worker::ExpertWorkerArgs>),
    /// An attention-worker: shard I of N of every attention layer (its heads) and
    /// their KV cache, served over gRPC.
    AttentionWorker(Box<epserve_attention_worker::AttentionWorkerArgs>),
    /// A whole local cluster on loopback: etcd, expert-workers, attention-workers, coordinator.
    Up(Box<epserve_tools::up::UpArgs>),
    /// Benchmarks: `bench serve` (a twin of `vllm bench serve`), `bench moe`, `bench linear`,
    /// `bench step`, `bench attention`.
    Bench(BenchArgs),
    /// Capacity planner: expert-workers, attention-workers, experts per worker and
    /// expected decode throughput for a model on a Graviton instance type.
    Plan(Box<epserve_tools::plan::PlanArgs>),
    /// Admin client of a running coordinator: placement, expert load (heat map),
    /// workers, live rebalance, drain.
    Ctl(Box<epserve_tools::ctl::CtlArgs>),
}

/// `epserve bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// Benchmark subcommands.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Serving benchmark against any OpenAI-compatible server: random prompts,
    /// request rate and concurrency, TTFT / TPOT / ITL / E2EL and throughput,
    /// reported as `vllm bench serve` reports them.
    Serve(Box<epserve_tools::bench_serve::BenchServeArgs>),
    /// One MoE layer at real shapes (Qwen3-30B-A3B, Mixtral-8x7B) through the
    /// expert kernels, against the machine's measured memory bandwidth and FMA
    /// peak and the scalar twin kernels; bf16 and int8, one and all cores.
    Moe(Box<epserve_tools::bench_moe::BenchMoeArgs>),
    /// The dense projections (attention q/k/v/o, LM head) on the packed bf16
    /// panels against their scalar twin and the machine's read bandwidth.
    Linear(Box<epserve_tools::bench_linear::BenchLinearArgs>),
    /// One forward step of a model folder, per phase (attention projections,
    /// attention, router, experts, combine, LM head, sampling), each against its
    /// roofline, at decode batches and prefill lengths.
    Step(Box<epserve_tools::bench_step::BenchStepArgs>),
    /// The flash attention kernel (decode at 128 / 2k / 8k context, 512-row
    /// prefill; f32 and bf16 KV) against its scalar twin and the read bandwidth.
    Attention(Box<epserve_tools::bench_attention::BenchAttentionArgs>),
    /// The sampler per sequence at real vocabulary sizes (greedy,
    /// temperature, top-k, top-p, min-p) against one pass over the logits,
    /// and a batch serial against parallel.
    Sampling(Box<epserve_tools::bench_sampling::BenchSamplingArgs>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_takes_tls_cert_as_its_https_certificate() {
        let parse = |extra: &[&str]| {
            let mut v = vec!["epserve", "serve", "--model", "m"];
            v.extend_from_slice(extra);
            Cli::try_parse_from(v)
        };
        let Ok(Cli {
            command: Command::Serve(cmd),
        }) = parse(&["--tls-cert", "c.pem", "--tls-key", "k.pem"])
        else {
            panic!("serve --tls-cert --tls-key parses");
        };
        let a = cmd.args();
        assert_eq!(
            a.api_tls_cert.as_deref(),
            Some(std::path::Path::new("c.pem"))
        );
        assert_eq!(
            a.api_tls_key.as_deref(),
            Some(std::path::Path::new("k.pem"))
        );
        assert!(
            parse(&["--tls-cert", "c.pem"]).is_err(),
            "a cert needs its key"
        );
        assert!(
            parse(&[
                "--tls-cert",
                "c",
                "--tls-key",
                "k",
                "--api-tls-cert",
                "c",
                "--api-tls-key",
                "k"
            ])
            .is_err(),
            "one name per certificate"
        );
    }
}
