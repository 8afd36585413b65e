//! `epserve up`: a whole local cluster on loopback — etcd (on free ports with
//! a temporary data dir), N expert-workers, M attention-workers (shards 0..M-1)
//! and the coordinator as child processes of this one. Every child it starts
//! is announced on stdout as `epserve up: started NAME (pid PID)` (NAME:
//! `etcd`, `expert-I`, `attention-I`, `coordinator`), restarts included.
//!
//! Supervision: etcd is restarted whenever it exits (same data dir and
//! ports, bounded backoff), and so is the coordinator once it has served
//! (same arguments, hence the same API and admin ports; `--port 0` is
//! resolved to a free port here for that reason); a coordinator that exits
//! before it ever served stops the cluster (a misconfiguration), and so does
//! a child that keeps exiting ([`MAX_RESTARTS`] times in a row). A worker that
//! exits is reported and not restarted: the coordinator copes with a lost
//! worker. Ctrl-C / SIGTERM stops them all: the coordinator first (SIGTERM),
//! then the workers with SIGINT (their fast stop; SIGTERM asks a worker to
//! drain first), then etcd. Children also get that signal if this process
//! dies (PR_SET_PDEATHSIG).
//!
//! Signals: `run` blocks SIGINT and SIGTERM in the main thread before any other
//! thread exists (so every thread inherits the mask) and resets both to their
//! default disposition (a shell starts background jobs with SIGINT ignored,
//! and an ignored signal is discarded even while blocked). One thread takes
//! them with `sigwait`, so they always reach the orderly stop that terminates
//! the children and removes the temporary etcd data dir. Children get an
//! unblocked mask before `exec`.
//!
//! Benchmarks: `--emulate-link SPEC` puts a [`LinkProxy`] (delay, rate cap)
//! in front of every worker and gives the worker `--advertise` its address,
//! so the coordinator reaches workers only through the emulated link;
//! `--coordinator-cores` pins the coordinator before `exec`
//! (`sched_setaffinity`, inherited by all its threads) and `--worker-cores`
//! becomes each worker's `--cores`.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::link::{LinkProxy, LinkSpec};

fn parse_link_spec(s: &str) -> Result<LinkSpec, String> {
    LinkSpec::parse(s).map_err(|e| format!("{e:#}"))
}

/// `epserve up`.
#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Hugging Face model folder.
    #[arg(long, env = "EPSERVE_MODEL")]
    pub model: PathBuf,
    /// Expert-worker processes.
    #[arg(long, default_value_t = 2)]
    pub expert_workers: usize,
    /// Attention-worker processes (tensor-parallel attention shards over the
    /// heads); 0 runs attention in the coordinator.
    #[arg(long, default_value_t = 0)]
    pub attention_workers: usize,
    /// Memory budget for packed experts of each expert-worker (`2GiB`,
    /// `512MiB`, bytes), passed on as its `--expert-memory`: experts beyond
    /// it stay cold in the checkpoint and are packed on first use into an
    /// LRU cache. Default: every assigned expert packed at load.
    #[arg(long, value_name = "SIZE", value_parser = epserve_core::config::parse_size)]
    pub expert_memory: Option<usize>,
    /// KV cache of each attention-worker (`2GiB`, `512MiB`, bytes).
    #[arg(long, default_value = "1GiB")]
    pub attention_kv_cache_memory: String,
    /// OpenAI API address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// OpenAI API port (0 picks a free one; the URL is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Use this etcd instead of starting one.
    #[arg(long)]
    pub etcd: Option<String>,
    /// TLS and auth of that etcd, passed on to every role.
    #[command(flatten)]
    pub etcd_security: epserve_cluster::runtime::EtcdSecurityArgs,
    /// Activation dtype on the wire (bf16, f32 or int8; see `coordinator`).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32", "int8"])]
    pub dispatch_dtype: String,
    /// Served model name(s), passed on to the coordinator (vLLM's form:
    /// `--served-model-name a b`). Default: the coordinator's (the folder's
    /// name and the --model string).
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// TTL of the workers' etcd leases, seconds, passed on to every worker as
    /// its `--lease-ttl-secs` (unset: the workers' default).
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub lease_ttl_secs: Option<i64>,
    /// Benchmarks: put a link emulator (a TCP proxy in this process) between
    /// the coordinator and each worker, adding a one-way delay in each
    /// direction and an optional rate cap: `500us`, `200us,10gbit`,
    /// `1ms,100mbit` (delay: ns, us, ms, s; rate: bit, kbit, mbit, gbit,
    /// tbit, or bps, kbps, mbps, gbps for bytes per second). Off by default.
    #[arg(long, value_name = "SPEC", value_parser = parse_link_spec)]
    pub emulate_link: Option<LinkSpec>,
    /// Pin the coordinator (all its threads) to these cores, e.g. `0` or
    /// `0-3,8`.
    #[arg(long, value_name = "LIST")]
    pub coordinator_cores: Option<String>,
    /// Pin the workers: one core list for every worker (`1`, `2-3`), or one
    /// per worker separated by `/` (`1/2/3`), in the order expert-0..N-1,
    /// then attention-0..M-1. Passed on as each worker's `--cores`.
    #[arg(long, value_name = "LIST[/LIST...]")]
    pub worker_cores: Option<String>,
    /// Secure every link: make a CA and one certificate per role (SANs
    /// 127.0.0.1 and localhost) in the run directory, removed at the end;
    /// mutual TLS on every node link (`--tls-cert --tls-key --tls-ca` to
    /// every role); the local etcd served over TLS with client-certificate
    /// auth and user auth on (a user `epserve` limited to `/epserve/`, a
    /// random password in a 0600 file), every role given `--etcd-ca
    /// --etcd-cert --etcd-key --etcd-user --etcd-password-file`. With
    /// `--etcd`, that etcd's security is yours to pass (`--etcd-*`).
    #[arg(long, conflicts_with_all = ["tls_cert", "tls_key", "tls_ca"])]
    pub secure: bool,
    /// Mutual TLS with these files instead: passed on as they are to every
    /// role (the certificate must name 127.0.0.1).
    #[command(flatten)]
    pub tls: epserve_cluster::tls::NodeTlsArgs,
    /// Extra arguments passed to the coordinator (e.g. `--max-num-seqs 8`).
    #[arg(last = true)]
    pub coordinator_args: Vec<String>,
}

/// Turns on auth in the local etcd `up --secure` started (TLS with client
/// certificates): a `root` user and a user `epserve` whose role may only
/// read and write `/epserve/`, random passwords (the user's in a 0600 file
/// in `dir`, root's nowhere: the etcd and its data go when `up` stops).
/// Returns the `--etcd-*` flags every role gets (one client certificate
/// for them all).
fn secure_local_etcd(ca: &crate::pki::Ca, dir: &Path, etcd: &str) -> Result<Vec<OsString>> {
    use epserve_cluster::store::{EtcdSecurity, EtcdStore};
    use rand::Rng;
    let client = ca.write_leaf(dir, "etcd-client", &["localhost"])?;
    let (Some(cert), Some(key), Some(ca_path)) = (
        client.tls_cert.clone(),
        client.tls_key.clone(),
        client.tls_ca.clone(),
    ) else {
        anyhow::bail!("the etcd client certificate was not written");
    };
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("cannot read {}", p.display()));
    let security = EtcdSecurity {
        ca_pem: Some(read(&ca_path)?),
        identity: Some((read(&cert)?, read(&key)?)),
        user: None,
    };
    let secret = || -> String {
        let mut rng = rand::rng();
        (0..32)
            .map(|_| char::from(b"0123456789abcdef"[rng.random_range(0..16)]))
            .collect()
    };
    let (root_pw, password) = (secret(), secret());
    let pw_file = dir.join("etcd-password");
    crate::pki::write_private(&pw_file, &password)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a runtime for etcd's auth setup")?;
    // etcd listens before it serves: retry for a while.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = rt.block_on(EtcdStore::enable_auth(
            etcd,
            &security,
            &root_pw,
            "epserve",
            &password,
            "/epserve/",
        ));
        match r {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(error = %e, "etcd auth setup: retrying");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e).context("cannot turn on etcd's auth"),
        }
    }
    println!(
        "epserve up: etcd over TLS with client certificates and auth (user epserve, password in {})",
        pw_file.display()
    );
    let mut flags = Vec::new();
    for (flag, v) in [
        ("--etcd-ca", ca_path.into_os_string()),
        ("--etcd-cert", cert.into_os_string()),
        ("--etcd-key", key.into_os_string()),
        ("--etcd-user", "epserve".into()),
        ("--etcd-password-file", pw_file.into_os_string()),
    ] {
        flags.push(OsString::from(flag));
        flags.push(v);
    }
    Ok(flags)
}

/// Restarts of etcd or of the coordinator in a row (each one exiting within
/// [`STABLE`] of its start) after which `up` stops the cluster.
pub const MAX_RESTARTS: u32 = 8;
/// A child that ran this long before it exited starts a fresh series of
/// restarts (backoff from the shortest delay again).
const STABLE: Duration = Duration::from_secs(30);

/// Delay before restart number `attempt` (0-based) of a series: 0.1 s,
/// doubling, at most 5 s (about 16 s over [`MAX_RESTARTS`]).
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(100u64 << attempt.min(6)).min(Duration::from_secs(5))
}

/// What a child is; decides how it is supervised and stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Etcd,
    ExpertWorker,
    AttentionWorker,
    Coordinator,
}

impl Role {
    fn is_worker(self) -> bool {
        matches!(self, Role::ExpertWorker | Role::AttentionWorker)
    }

    /// The signal that stops this child at once: SIGINT for workers (SIGTERM
    /// asks a worker to drain first, which takes seconds), SIGTERM otherwise.
    fn stop_signal(self) -> libc::c_int {
        if self.is_worker() {
            libc::SIGINT
        } else {
            libc::SIGTERM
        }
    }

    /// Whether `up` starts it again when it exits.
    fn restarted(self) -> bool {
        matches!(self, Role::Etcd | Role::Coordinator)
    }
}

/// One child process and how to start it again.
struct Proc {
    name: String,
    role: Role,
    program: PathBuf,
    args: Vec<OsString>,
    /// Cores it is pinned to before `exec` (the coordinator's
    /// `--coordinator-cores`; workers pin themselves with `--cores`).
    affinity: Option<libc::cpu_set_t>,
    /// None once it exited (and was reaped) and until it is started again.
    child: Option<Child>,
    started: Instant,
    /// Restarts in the current series (see [`STABLE`]).
    restarts: u32,
    /// When to start it again, while it is down.
    restart_at: Option<Instant>,
    /// This run of it is ready: etcd listens, the coordinator printed its
    /// serving line.
    ready: bool,
    /// Some run of it was ready.
    ever_ready: bool,
    /// Flags whose port `up` found free and released (the coordinator's
    /// `--port 0` and `--admin-port`): if it exits before it first serves
    /// while another process holds one of them, it is started again on
    /// fresh ones.
    free_ports: Vec<&'static str>,
    /// Such fresh starts so far.
    port_retries: u32,
}

impl Proc {
    fn new(name: &str, role: Role, program: &Path, args: Vec<OsString>) -> Proc {
        Proc {
            name: name.to_string(),
            role,
            program: program.to_path_buf(),
            args,
            affinity: None,
            child: None,
            started: Instant::now(),
            restarts: 0,
            restart_at: None,
            ready: false,
            ever_ready: false,
            free_ports: Vec::new(),
            port_retries: 0,
        }
    }

    /// Starts it (again); its stdout lines go to `tx` (etcd's are dropped).
    fn spawn(&mut self, tx: &mpsc::Sender<(String, String)>) -> Result<()> {
        let mut cmd = child_cmd(&self.program, self.role.stop_signal(), self.affinity);
        cmd.args(&self.args);
        if self.role == Role::Etcd {
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
        } else {
            cmd.stdout(Stdio::piped());
        }
        let mut c = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", self.name))?;
        forward(self.name.clone(), &mut c, tx.clone());
        println!("epserve up: started {} (pid {})", self.name, c.id());
        self.child = Some(c);
        self.started = Instant::now();
        self.ready = false;
        Ok(())
    }

    /// Kills it (SIGKILL) and reaps it, for a start abandoned before it
    /// was ready.
    fn stop_now(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether a port of [`Proc::free_ports`] can no longer be bound here.
    fn lost_a_port(&self) -> bool {
        self.free_ports.iter().any(|flag| {
            flag_value(&self.args, flag)
                .and_then(|v| v.parse::<u16>().ok())
                .is_some_and(|port| TcpListener::bind(("127.0.0.1", port)).is_err())
        })
    }

    /// Marks this run ready.
    fn set_ready(&mut self) {
        self.ready = true;
        self.ever_ready = true;
    }

    /// Schedules the next restart of a series, or fails when the series is
    /// used up. `why` says what happened (`exited (signal: 9)`).
    fn schedule_restart(&mut self, why: &str) -> Result<()> {
        if self.started.elapsed() >= STABLE {
            self.restarts = 0;
        }
        if self.restarts >= MAX_RESTARTS {
            bail!(
                "{} {why}, after {MAX_RESTARTS} restarts in a row; stopping the cluster",
                self.name
            );
        }
        let d = backoff(self.restarts);
        self.restarts += 1;
        println!(
            "epserve up: {} {why}; restarting it in {:.1} s (restart {} of at most {MAX_RESTARTS} in a row)",
            self.name,
            d.as_secs_f64(),
            self.restarts
        );
        self.restart_at = Some(Instant::now() + d);
        Ok(())
    }

    /// One supervision tick: restarts it when due, notices an exit.
    /// `etcd_addr`: where a restarted etcd must listen before it is ready.
    fn poll(&mut self, tx: &mpsc::Sender<(String, String)>, etcd_addr: &str) -> Result<()> {
        if let Some(at) = self.restart_at {
            if Instant::now() >= at {
                self.restart_at = None;
                if let Err(e) = self.spawn(tx) {
                    self.schedule_restart(&format!("could not be started ({e:#})"))?;
                }
            }
            return Ok(());
        }
        let Some(c) = self.child.as_mut() else {
            return Ok(());
        };
        let status: ExitStatus = match c.try_wait() {
            Ok(Some(s)) => s,
            Ok(None) => {
                if self.role == Role::Etcd
                    && !self.ready
                    && std::net::TcpStream::connect(etcd_addr).is_ok()
                {
                    self.set_ready();
                    println!("epserve up: etcd back at {etcd_addr}");
                }
                return Ok(());
            }
            Err(e) => bail!("cannot wait for {}: {e}", self.name),
        };
        self.child = None;
        if !self.role.restarted() {
            // The coordinator reports requests that needed it; keep serving.
            println!("epserve up: {} exited ({status}); not restarted", self.name);
            return Ok(());
        }
        if self.role == Role::Coordinator && !self.ever_ready {
            if self.port_retries < 3 && self.lost_a_port() {
                self.port_retries += 1;
                let mut fresh = Vec::new();
                for flag in self.free_ports.clone() {
                    let port = free_port()?.to_string();
                    set_flag(&mut self.args, flag, &port);
                    fresh.push(format!("{flag} {port}"));
                }
                println!(
                    "epserve up: {} exited ({status}) and another process holds a port found free for it; starting it again with {}",
                    self.name,
                    fresh.join(" ")
                );
                return self.spawn(tx);
            }
            bail!(
                "{} exited ({status}) before it served; stopping the cluster",
                self.name
            );
        }
        self.schedule_restart(&format!("exited ({status})"))
    }
}

struct Children {
    list: Vec<Proc>,
    tmp: Vec<PathBuf>,
}

impl Children {
    /// Stops the running children that `which` selects: their stop signal
    /// to all of them at once (SIGCONT first, in case one was stopped), up to
    /// 5 s for all to exit, then SIGKILL.
    fn stop(&mut self, which: impl Fn(Role) -> bool) {
        let mut running: Vec<(&str, &mut Child)> = Vec::new();
        for p in self.list.iter_mut().filter(|p| which(p.role)) {
            let sig = p.role.stop_signal();
            let Proc { name, child, .. } = p;
            if let Some(c) = child.as_mut() {
                // SAFETY: kill(2) on our own child, not yet reaped (its pid
                // is still ours); at worst it already exited.
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGCONT);
                    libc::kill(c.id() as libc::pid_t, sig);
                }
                running.push((name.as_str(), c));
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (name, c) in running {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
            tracing::debug!(child = %name, "stopped");
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.stop(|r| r == Role::Coordinator);
        self.stop(Role::is_worker);
        self.stop(|r| r == Role::Etcd);
        for d in &self.tmp {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// The address a worker's serving line says it listens on (` (listening on
/// ADDR)`, printed when it advertises another).
fn listening_addr(line: &str) -> Option<std::net::SocketAddr> {
    if !line.contains(" serving ") {
        return None;
    }
    let (_, rest) = line.split_once("(listening on ")?;
    rest.split(')').next()?.parse().ok()
}

/// The value after `flag` in `args`.
fn flag_value(args: &[OsString], flag: &str) -> Option<String> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).map(|v| v.to_string_lossy().into_owned())
}

/// Sets the value after `flag` in `args` (which holds it).
fn set_flag(args: &mut [OsString], flag: &str, value: &str) {
    if let Some(i) = args.iter().position(|a| a == flag)
        && let Some(v) = args.get_mut(i + 1)
    {
        *v = value.into();
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(l.local_addr()?.port())
}

/// SIGINT and SIGTERM, the signals that stop `up`.
fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset only write the set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Blocks SIGINT and SIGTERM in the calling thread, then resets both to
/// their default disposition (they may have been inherited as ignored). Must
/// run before any other thread is started, so that all of them inherit the
/// mask and a process-directed signal can only be taken by `sigwait`.
fn block_stop_signals() -> Result<()> {
    let set = stop_signals();
    // SAFETY: pthread_sigmask changes this thread's mask only; signal() with
    // SIG_DFL installs no handler. Blocking first means neither signal can
    // take its default action (exit) between the two steps.
    unsafe {
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            bail!(
                "cannot block SIGINT/SIGTERM: {}",
                std::io::Error::from_raw_os_error(rc)
            );
        }
        for sig in [libc::SIGINT, libc::SIGTERM] {
            if libc::signal(sig, libc::SIG_DFL) == libc::SIG_ERR {
                bail!(
                    "cannot reset the disposition of signal {sig}: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
    Ok(())
}

/// A command for a child that gets `death_signal` when `up` dies, pinned to
/// `affinity` when given (every thread it starts inherits the mask; rayon
/// and tokio size their pools from it).
fn child_cmd(
    program: &Path,
    death_signal: libc::c_int,
    affinity: Option<libc::cpu_set_t>,
) -> Command {
    let mut c = Command::new(program);
    let set = stop_signals();
    // SAFETY: in the forked child before exec, prctl sets its own parent death
    // signal, sigprocmask unblocks the signals `up` blocked (the mask is
    // inherited across exec) and sched_setaffinity pins the child to a set
    // built before the fork; all are async-signal-safe, and nothing is
    // allocated or locked there.
    unsafe {
        c.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, death_signal);
            if libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(cpus) = &affinity
                && libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), cpus) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    c
}

/// Parses a core list such as `0-3,8,10-11` (the workers' `--cores` syntax).
fn parse_core_list(spec: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) else {
            bail!("invalid core list '{spec}': '{part}' is not N or N-M");
        };
        if a > b {
            bail!("invalid core list '{spec}': range {a}-{b} is reversed");
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// The cores this process may run on (its affinity mask: the machine's
/// online cores, less any a cgroup or `taskset` withholds).
fn allowed_cores() -> Result<Vec<usize>> {
    // SAFETY: sched_getaffinity writes at most size_of::<cpu_set_t>() bytes
    // into the set we own; CPU_ISSET reads it within CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            bail!(
                "cannot read this process's cores: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok((0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect())
    }
}

/// `cores` (a core list) checked against `allowed`: each must be one this
/// process may run on. `flag` names the flag in the error.
fn checked_cores(flag: &str, spec: &str, allowed: &[usize]) -> Result<Vec<usize>> {
    let cores = parse_core_list(spec).context(flag.to_string())?;
    if let Some(c) = cores.iter().find(|c| !allowed.contains(c)) {
        bail!(
            "{flag}: core {c} does not exist on this machine (cores available: {})",
            core_list(allowed)
        );
    }
    Ok(cores)
}

/// A core list written back compactly (`0-3,8`).
fn core_list(cores: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cores.len() {
        let mut j = i;
        while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cores[i].to_string()
        } else {
            format!("{}-{}", cores[i], cores[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// `--worker-cores`: one core list for all `workers`, or one per worker
/// separated by `/`; each checked against `allowed`. The lists come back in
/// the workers' `--cores` form.
fn worker_core_lists(spec: &str, workers: usize, allowed: &[usize]) -> Result<Vec<String>> {
    let groups: Vec<&str> = spec.split('/').collect();
    if groups.len() != 1 && groups.len() != workers {
        bail!(
            "--worker-cores '{spec}': {} core lists for {workers} workers (give one list for all, or one per worker: expert-workers first, then attention-workers)",
            groups.len()
        );
    }
    let lists = groups
        .iter()
        .map(|g| checked_cores("--worker-cores", g, allowed).map(|c| core_list(&c)))
        .collect::<Result<Vec<_>>>()?;
    Ok((0..workers)
        .map(|i| lists[if lists.len() == 1 { 0 } else { i }].clone())
        .collect())
}

/// A CPU set of `cores` (each below CPU_SETSIZE, as `allowed_cores` gives).
fn cpu_set(cores: &[usize]) -> libc::cpu_set_t {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes within it for ids
    // below CPU_SETSIZE (checked).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        set
    }
}

/// Forwards a child's stdout lines to ours with a prefix; sends lines to `tx`.
fn forward(name: String, child: &mut Child, tx: mpsc::Sender<(String, String)>) {
    if let Some(out) = child.stdout.take() {
        std::thread::spawn(move || {
            let r = BufReader::new(out);
            for line in r.lines().map_while(|l| l.ok()) {
                println!("[{name}] {line}");
                let _ = tx.send((name.clone(), line));
            }
        });
    }
}

/// The coordinator's `--block-size` among its extra arguments (attention-workers
/// must use the same, or a divisor).
fn block_size_arg(coordinator_args: &[String]) -> Option<String> {
    flag_arg(coordinator_args, "--block-size")
}

/// The last value of `flag` (`FLAG V` or `FLAG=V`) among the coordinator's
/// extra arguments.
fn flag_arg(coordinator_args: &[String], flag: &str) -> Option<String> {
    let mut found = None;
    let mut it = coordinator_args.iter();
    while let Some(a) = it.next() {
        if a == flag {
            found = it.next().cloned();
        } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            found = Some(v.to_string());
        }
    }
    found
}

/// `--lease-ttl-secs N` for a worker, when `up` was given one.
fn lease_ttl_arg(ttl: Option<i64>) -> Vec<OsString> {
    ttl.map(|t| os_args(["--lease-ttl-secs".to_string(), t.to_string()]))
        .unwrap_or_default()
}

/// Owned arguments from string-likes.
fn os_args<I, S>(items: I) -> Vec<OsString>
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    items.into_iter().map(Into::into).collect()
}

/// Runs the local cluster until interrupted. Called from `main` before any
/// other thread exists (no runtime is started for `up`).
pub fn run(args: &UpArgs) -> Result<()> {
    block_stop_signals()?;
    if args.expert_workers == 0 {
        bail!("--expert-workers must be at least 1");
    }
    if !args.model.join("config.json").is_file() {
        bail!(
            "{}: missing from the model folder (config.json)",
            args.model.display()
        );
    }
    // Cores first, so a typo fails before anything starts.
    let allowed = allowed_cores()?;
    let coordinator_cores = match &args.coordinator_cores {
        Some(spec) => Some(checked_cores("--coordinator-cores", spec, &allowed)?),
        None => None,
    };
    let workers = args.expert_workers + args.attention_workers;
    let worker_cores = match &args.worker_cores {
        Some(spec) => Some(worker_core_lists(spec, workers, &allowed)?),
        None => None,
    };
    // `--cores LIST` of worker `i` (expert-workers first), when pinned.
    let cores_arg = |i: usize| -> Vec<OsString> {
        worker_cores
            .as_ref()
            .map(|l| os_args(["--cores".to_string(), l[i].clone()]))
            .unwrap_or_default()
    };
    let exe = std::env::current_exe().context("cannot find the epserve binary")?;
    // Declared before the children, so they stop first and the links after.
    let mut links: Vec<LinkProxy> = Vec::new();
    // Which proxy stands in front of which worker (by name).
    let mut link_of: Vec<String> = Vec::new();
    // `--advertise ADDR` of the worker `name`: a link emulator in front of
    // it, when asked for. The worker takes a free port itself (`--listen`
    // port 0: a port found free here and released could be taken before the
    // worker binds it) and says which in its serving line; the proxy is
    // pointed there then, and holds connections that come before.
    let mut link_for = |name: &str| -> Result<Vec<OsString>> {
        let Some(spec) = args.emulate_link else {
            return Ok(Vec::new());
        };
        let proxy = LinkProxy::start_pending(std::net::SocketAddr::from(([127, 0, 0, 1], 0)), spec)
            .with_context(|| format!("cannot start the link emulator for {name}"))?;
        let addr = proxy.addr();
        println!("epserve up: link emulator for {name}: {addr} ({spec})");
        links.push(proxy);
        link_of.push(name.to_string());
        Ok(os_args(["--advertise".to_string(), addr.to_string()]))
    };
    let mut kids = Children {
        list: Vec::new(),
        tmp: Vec::new(),
    };
    // `--tls-*` of each role by name (`coordinator`, `expert-0`, `ctl`).
    let tls_dir = std::env::temp_dir().join(format!("epserve-up-{}-tls", std::process::id()));
    let ca = if args.secure {
        kids.tmp.push(tls_dir.clone());
        Some(crate::pki::Ca::new("epserve up local CA")?)
    } else {
        args.tls.load()?;
        None
    };
    let tls_for = |name: &str| -> Result<Vec<OsString>> {
        match &ca {
            Some(ca) => Ok(os_args(
                ca.write_leaf(&tls_dir, name, &["127.0.0.1", "localhost"])?
                    .to_flags(),
            )),
            None => Ok(os_args(args.tls.to_flags())),
        }
    };
    let (tx, rx) = mpsc::channel::<(String, String)>();
    let cluster = format!("local-{}", std::process::id());
    let etcd = match &args.etcd {
        Some(e) => e.clone(),
        None => {
            let etcd_bin = which("etcd").context(
                "`etcd` is not installed (Debian: apt-get install etcd-server); or pass --etcd HOST:PORT",
            )?;
            // Ports found free can be taken (by another process's server or
            // an outgoing connection) before etcd binds them; etcd then exits
            // at once, and is started again on fresh ports.
            // --secure: TLS for etcd's clients, who must show a certificate
            // from the CA (the peer URL stays on loopback, one member).
            let mut tls_args: Vec<OsString> = Vec::new();
            let scheme = match &ca {
                Some(ca) => {
                    let server = ca.write_leaf(&tls_dir, "etcd", &["127.0.0.1", "localhost"])?;
                    for (flag, path) in [
                        ("--cert-file", &server.tls_cert),
                        ("--key-file", &server.tls_key),
                        ("--trusted-ca-file", &server.tls_ca),
                    ] {
                        tls_args.push(flag.into());
                        tls_args.extend(path.clone().map(Into::into));
                    }
                    tls_args.push("--client-cert-auth".into());
                    "https"
                }
                None => "http",
            };
            let mut attempt = 0;
            let (addr, dir) = loop {
                attempt += 1;
                let (cport, pport) = (free_port()?, free_port()?);
                let dir = std::env::temp_dir()
                    .join(format!("epserve-etcd-{}-{attempt}", std::process::id()));
                kids.tmp.push(dir.clone());
                let mut etcd_args = os_args(["--name", "epserve-up", "--data-dir"]);
                etcd_args.push(dir.clone().into_os_string());
                etcd_args.extend(tls_args.iter().cloned());
                etcd_args.extend(os_args([
                    "--listen-client-urls".to_string(),
                    format!("{scheme}://127.0.0.1:{cport}"),
                    "--advertise-client-urls".to_string(),
                    format!("{scheme}://127.0.0.1:{cport}"),
                    "--listen-peer-urls".to_string(),
                    format!("http://127.0.0.1:{pport}"),
                    "--initial-advertise-peer-urls".to_string(),
                    format!("http://127.0.0.1:{pport}"),
                    "--initial-cluster".to_string(),
                    format!("epserve-up=http://127.0.0.1:{pport}"),
                    "--log-level".to_string(),
                    "error".to_string(),
                ]));
                let mut p = Proc::new("etcd", Role::Etcd, &etcd_bin, etcd_args);
                p.spawn(&tx).context("cannot start etcd")?;
                kids.list.push(p);
                let Some(p) = kids.list.last_mut() else {
                    bail!("etcd was not recorded");
                };
                let addr = format!("127.0.0.1:{cport}");
                match wait_listening(&addr, Duration::from_secs(60), p) {
                    Ok(()) => {
                        p.set_ready();
                        break (addr, dir);
                    }
                    Err(e) => {
                        p.stop_now();
                        kids.list.pop();
                        if attempt >= 3 {
                            return Err(e.context("etcd did not start"));
                        }
                        eprintln!("epserve up: etcd did not start ({e:#}); trying other ports");
                    }
                }
            };
            println!("epserve up: etcd at {addr} (data in {})", dir.display());
            addr
        }
    };
    // How every role reaches etcd's TLS and auth (none for a plain etcd).
    let etcd_security = match (&ca, &args.etcd) {
        (Some(ca), None) => secure_local_etcd(ca, &tls_dir, &etcd)?,
        _ => args.etcd_security.to_args(),
    };
    for i in 0..args.expert_workers {
        let name = format!("expert-{i}");
        let mut a = os_args(["expert-worker", "--model"]);
        a.push(args.model.clone().into_os_string());
        a.extend(os_args([
            "--etcd",
            &etcd,
            "--cluster",
            &cluster,
            "--id",
            &name,
            "--listen",
            "127.0.0.1:0",
        ]));
        a.extend(etcd_security.iter().cloned());
        a.extend(lease_ttl_arg(args.lease_ttl_secs));
        if let Some(m) = args.expert_memory {
            a.extend(os_args(["--expert-memory".to_string(), m.to_string()]));
        }
        a.extend(cores_arg(i));
        a.extend(link_for(&name)?);
        a.extend(tls_for(&name)?);
        let mut p = Proc::new(&name, Role::ExpertWorker, &exe, a);
        p.spawn(&tx)?;
        kids.list.push(p);
    }
    for i in 0..args.attention_workers {
        let name = format!("attention-{i}");
        let mut a = os_args(["attention-worker", "--model"]);
        a.push(args.model.clone().into_os_string());
        a.extend(os_args([
            "--etcd".to_string(),
            etcd.clone(),
            "--cluster".to_string(),
            cluster.clone(),
            "--id".to_string(),
            name.clone(),
            "--shard".to_string(),
            i.to_string(),
            "--of".to_string(),
            args.attention_workers.to_string(),
            "--listen".to_string(),
            "127.0.0.1:0".to_string(),
            "--kv-cache-memory".to_string(),
            args.attention_kv_cache_memory.clone(),
        ]));
        if let Some(b) = block_size_arg(&args.coordinator_args) {
            a.extend(os_args(["--block-size".to_string(), b]));
        }
        // The KV lives on the attention-workers: the coordinator's
        // `--kv-cache-dtype` is theirs.
        if let Some(d) = flag_arg(&args.coordinator_args, "--kv-cache-dtype") {
            a.extend(os_args(["--kv-cache-dtype".to_string(), d]));
        }
        // ...and so is `--dense-dtype` for their projections.
        if let Some(d) = flag_arg(&args.coordinator_args, "--dense-dtype") {
            a.extend(os_args(["--dense-dtype".to_string(), d]));
        }
        a.extend(etcd_security.iter().cloned());
        a.extend(lease_ttl_arg(args.lease_ttl_secs));
        a.extend(cores_arg(args.expert_workers + i));
        a.extend(link_for(&name)?);
        a.extend(tls_for(&name)?);
        let mut p = Proc::new(&name, Role::AttentionWorker, &exe, a);
        p.spawn(&tx)?;
        kids.list.push(p);
    }
    // A restarted coordinator must come back on the same port: resolve 0 here.
    let port = if args.port == 0 {
        free_port()?
    } else {
        args.port
    };
    let admin_port = free_port()?;
    let mut a = os_args(["coordinator", "--model"]);
    a.push(args.model.clone().into_os_string());
    a.extend(os_args([
        "--etcd".to_string(),
        etcd.clone(),
        "--cluster".to_string(),
        cluster.clone(),
        "--min-expert-workers".to_string(),
        args.expert_workers.to_string(),
        "--attention-workers".to_string(),
        args.attention_workers.to_string(),
        "--host".to_string(),
        args.host.clone(),
        "--port".to_string(),
        port.to_string(),
        "--dispatch-dtype".to_string(),
        args.dispatch_dtype.clone(),
        "--admin-port".to_string(),
        admin_port.to_string(),
    ]));
    a.extend(etcd_security.iter().cloned());
    if !args.served_model_name.is_empty() {
        a.push("--served-model-name".into());
        a.extend(args.served_model_name.iter().map(Into::into));
    }
    a.extend(tls_for("coordinator")?);
    a.extend(os_args(&args.coordinator_args));
    if args.secure || args.tls.any() {
        let ctl_tls = match &ca {
            Some(_) => {
                let f = tls_for("ctl")?;
                println!(
                    "epserve up: mutual TLS on the node links (certificates in {})",
                    tls_dir.display()
                );
                f
            }
            None => {
                println!("epserve up: mutual TLS on the node links");
                os_args(args.tls.to_flags())
            }
        };
        let flags: Vec<String> = ctl_tls
            .iter()
            .map(|f| f.to_string_lossy().into_owned())
            .collect();
        println!(
            "epserve up: admin: epserve ctl --admin 127.0.0.1:{admin_port} {} placement",
            flags.join(" ")
        );
    }
    let mut p = Proc::new("coordinator", Role::Coordinator, &exe, a);
    p.free_ports = if args.port == 0 {
        vec!["--port", "--admin-port"]
    } else {
        vec!["--admin-port"]
    };
    if let Some(c) = &coordinator_cores {
        p.affinity = Some(cpu_set(c));
        println!("epserve up: coordinator pinned to cores {}", core_list(c));
    }
    p.spawn(&tx).context("cannot start the coordinator")?;
    kids.list.push(p);

    let stop = Arc::new(AtomicBool::new(false));
    {
        // A flag set by the sigwait thread; polled below.
        let s = stop.clone();
        std::thread::spawn(move || wait_signal(s));
    }
    loop {
        while let Ok((who, line)) = rx.try_recv() {
            if let Some(bound) = listening_addr(&line)
                && let Some(i) = link_of.iter().position(|n| *n == who)
            {
                links[i].set_upstream(bound);
                println!(
                    "epserve up: link emulator for {who}: {} -> {bound}",
                    links[i].addr()
                );
                continue;
            }
            if who != "coordinator" || !line.contains("serving") {
                continue;
            }
            let Some(i) = line.find("http://") else {
                continue;
            };
            let url = line[i..].split_whitespace().next().unwrap_or("");
            let Some(p) = kids.list.iter_mut().find(|p| p.role == Role::Coordinator) else {
                continue;
            };
            if p.ready {
                continue;
            }
            if p.ever_ready {
                println!("epserve up: coordinator serving again at {url}");
            } else {
                println!(
                    "epserve up: cluster ready at {url} ({} expert-workers, {} attention-workers, etcd {etcd})",
                    args.expert_workers, args.attention_workers
                );
            }
            p.set_ready();
        }
        if stop.load(Ordering::Relaxed) {
            println!("epserve up: stopping");
            return Ok(());
        }
        for p in kids.list.iter_mut() {
            p.poll(&tx, &etcd)?;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for SIGINT or SIGTERM (blocked in every thread by
/// `block_stop_signals`) and sets `flag`.
fn wait_signal(flag: Arc<AtomicBool>) {
    let set = stop_signals();
    let mut got: libc::c_int = 0;
    // SAFETY: sigwait on signals blocked in this thread, writing to `got`.
    let rc = unsafe { libc::sigwait(&set, &mut got) };
    if rc == 0 {
        tracing::debug!(signal = got, "stop signal");
    } else {
        eprintln!(
            "epserve up: sigwait failed ({}); stopping",
            std::io::Error::from_raw_os_error(rc)
        );
    }
    flag.store(true, Ordering::Relaxed);
}

/// Waits up to `limit` for `addr` to accept connections while `p` runs; its
/// exit ends the wait with an error.
fn wait_listening(addr: &str, limit: Duration, p: &mut Proc) -> Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        if let Some(Ok(Some(status))) = p.child.as_mut().map(|c| c.try_wait()) {
            bail!("{} exited ({status}) before listening on {addr}", p.name);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("nothing listens on {addr} after {} s", limit.as_secs())
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    })
}

#[cfg(test)]
mod tests {
    use super::{
        MAX_RESTARTS, Role, UpArgs, allowed_cores, backoff, block_size_arg, checked_cores,
        core_list, flag_arg, flag_value, lease_ttl_arg, listening_addr, parse_core_list, set_flag,
        worker_core_lists,
    };
    use clap::Parser;
    use std::time::Duration;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    #[test]
    fn core_lists_parse_check_and_print() {
        assert_eq!(parse_core_list("0-3").ok(), Some(vec![0, 1, 2, 3]));
        assert_eq!(parse_core_list("4, 0-1,1").ok(), Some(vec![0, 1, 4]));
        for bad in ["", "3-1", "a", "1,", "-1", "1-"] {
            assert!(parse_core_list(bad).is_err(), "{bad:?}");
        }
        assert_eq!(core_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(core_list(&[5]), "5");
        let allowed = [0, 1, 2, 3];
        assert_eq!(checked_cores("--x", "1-2", &allowed).ok(), Some(vec![1, 2]));
        let e = format!(
            "{:#}",
            checked_cores("--coordinator-cores", "3-4", &allowed).expect_err("4")
        );
        assert!(
            e.contains("core 4 does not exist") && e.contains("0-3"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            checked_cores("--coordinator-cores", "x", &allowed).expect_err("x")
        );
        assert!(
            e.starts_with("--coordinator-cores: invalid core list 'x'"),
            "{e}"
        );
        // The machine's own cores pass.
        let mine = allowed_cores().expect("affinity");
        assert!(!mine.is_empty());
        assert!(checked_cores("--x", &core_list(&mine), &mine).is_ok());
    }

    #[test]
    fn worker_cores_are_one_list_for_all_or_one_per_worker() {
        let allowed = [0, 1, 2, 3];
        assert_eq!(
            worker_core_lists("1", 3, &allowed).ok(),
            Some(vec!["1".to_string(), "1".into(), "1".into()])
        );
        assert_eq!(
            worker_core_lists("1/2-3", 2, &allowed).ok(),
            Some(vec!["1".to_string(), "2-3".into()])
        );
        let e = format!(
            "{:#}",
            worker_core_lists("1/2", 3, &allowed).expect_err("count")
        );
        assert!(e.contains("2 core lists for 3 workers"), "{e}");
        assert!(worker_core_lists("1/9", 2, &allowed).is_err());
        assert!(worker_core_lists("1//2", 3, &allowed).is_err());
    }

    #[test]
    fn emulate_link_and_pinning_are_off_by_default_and_checked() {
        let a = Cli::try_parse_from(["up", "--model", "m"]).expect("defaults");
        assert!(a.up.emulate_link.is_none());
        assert!(a.up.coordinator_cores.is_none() && a.up.worker_cores.is_none());
        let a = Cli::try_parse_from(["up", "--model", "m", "--emulate-link", "200us,10gbit"])
            .expect("spec");
        let spec = a.up.emulate_link.expect("set");
        assert_eq!(spec.delay, Duration::from_micros(200));
        assert_eq!(spec.rate, Some(1.25e9));
        let e = Cli::try_parse_from(["up", "--model", "m", "--emulate-link", "200xs"])
            .expect_err("refused")
            .to_string();
        assert!(e.contains("unknown unit 'xs'"), "{e}");
    }

    #[test]
    fn restarts_back_off_within_bounds() {
        assert_eq!(backoff(0), Duration::from_millis(100));
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert!((0..100).all(|a| backoff(a) <= Duration::from_secs(5)));
        let series: Duration = (0..MAX_RESTARTS).map(backoff).sum();
        assert!(series <= Duration::from_secs(20), "{series:?}");
    }

    #[test]
    fn workers_stop_fast_and_only_etcd_and_the_coordinator_restart() {
        assert_eq!(Role::ExpertWorker.stop_signal(), libc::SIGINT);
        assert_eq!(Role::AttentionWorker.stop_signal(), libc::SIGINT);
        assert_eq!(Role::Coordinator.stop_signal(), libc::SIGTERM);
        assert_eq!(Role::Etcd.stop_signal(), libc::SIGTERM);
        assert!(Role::Etcd.restarted() && Role::Coordinator.restarted());
        assert!(!Role::ExpertWorker.restarted() && !Role::AttentionWorker.restarted());
    }

    #[test]
    fn a_workers_bound_port_is_read_from_its_serving_line() {
        let line = "epserve expert-worker 'expert-0' serving ExpertService at 127.0.0.1:4000 (listening on 127.0.0.1:36001) (cores [0])";
        assert_eq!(
            listening_addr(line),
            Some(std::net::SocketAddr::from(([127, 0, 0, 1], 36001)))
        );
        let line = "epserve attention-worker 'attention-0' serving AttentionService at 127.0.0.1:4001 (listening on 127.0.0.1:36002): shard 0 of 1 (...)";
        assert_eq!(listening_addr(line).map(|a| a.port()), Some(36002));
        assert_eq!(
            listening_addr(
                "epserve expert-worker 'e' serving ExpertService at 127.0.0.1:4000 (cores [0])"
            ),
            None
        );
        assert_eq!(listening_addr("loading (listening on 127.0.0.1:1)"), None);
    }

    #[test]
    fn a_port_flag_is_read_and_replaced() {
        let mut a: Vec<std::ffi::OsString> = ["coordinator", "--port", "80", "--admin-port", "81"]
            .iter()
            .map(Into::into)
            .collect();
        assert_eq!(flag_value(&a, "--port").as_deref(), Some("80"));
        set_flag(&mut a, "--admin-port", "9");
        assert_eq!(flag_value(&a, "--admin-port").as_deref(), Some("9"));
        assert_eq!(flag_value(&a, "--port").as_deref(), Some("80"));
        assert_eq!(flag_value(&a, "--host"), None);
    }

    #[test]
    fn a_lease_ttl_is_passed_on_only_when_given() {
        assert!(lease_ttl_arg(None).is_empty());
        assert_eq!(lease_ttl_arg(Some(3)), ["--lease-ttl-secs", "3"]);
    }

    #[test]
    fn block_size_reaches_the_attention_workers() {
        let v = |a: &[&str]| block_size_arg(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(v(&["--max-num-seqs", "4"]), None);
        assert_eq!(v(&["--block-size", "8"]), Some("8".into()));
        assert_eq!(v(&["--x", "1", "--block-size=32"]), Some("32".into()));
        assert_eq!(
            v(&["--block-size", "8", "--block-size", "4"]),
            Some("4".into())
        );
        let d = |a: &[&str]| {
            flag_arg(
                &a.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                "--kv-cache-dtype",
            )
        };
        assert_eq!(d(&["--kv-cache-dtype", "bf16"]), Some("bf16".into()));
        assert_eq!(d(&["--kv-cache-dtype=f32"]), Some("f32".into()));
        assert_eq!(d(&["--kv-cache-dtypex=f32"]), None);
    }
}
