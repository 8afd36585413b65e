//! The `epserve` binary.

use clap::Parser;
use epserve_coordinator::cli::{BenchCommand, Cli, Command};

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("EPSERVE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Generate(args) => epserve_coordinator::generate::run(args),
        Command::Serve(args) => epserve_coordinator::serve::run(args),
        Command::Coordinator(args) => epserve_coordinator::cluster::run(args),
        Command::ExpertWorker(args) => epserve_expert_worker::run(args),
        Command::Up(args) => epserve_coordinator::cluster::up::run(args),
        Command::Bench(bench) => match &bench.command {
            BenchCommand::Serve(args) => epserve_coordinator::bench_serve::run(args),
            BenchCommand::Moe(args) => epserve_coordinator::bench_moe::run(args),
        },
        Command::Plan(args) => epserve_coordinator::plan::run(args),
    };
    if let Err(e) = result {
        // One line: the error and its causes joined by ": ".
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
