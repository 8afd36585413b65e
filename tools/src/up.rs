//! `epserve up`: a whole local cluster on loopback — etcd (on free ports with
//! a temporary data dir), N expert-workers, M attention-workers (shards 0..M-1)
//! and the coordinator as child
//! processes of this one. Ctrl-C / SIGTERM, or any child exiting, stops them
//! all; children also get SIGTERM if this process dies (PR_SET_PDEATHSIG).
//!
//! Signals: `run` blocks SIGINT and SIGTERM in the main thread before any other
//! thread exists (so every thread inherits the mask) and resets both to their
//! default disposition (a shell starts background jobs with SIGINT ignored,
//! and an ignored signal is discarded even while blocked). One thread takes
//! them with `sigwait`, so they always reach the orderly stop that terminates
//! the children and removes the temporary etcd data dir. Children get an
//! unblocked mask before `exec`.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;

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
    /// Activation dtype on the wire (bf16 or f32).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    pub dispatch_dtype: String,
    /// Served model name.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Extra arguments passed to the coordinator (e.g. `--max-num-seqs 8`).
    #[arg(last = true)]
    pub coordinator_args: Vec<String>,
}

struct Children {
    list: Vec<(String, Child)>,
    tmp: Vec<PathBuf>,
}

impl Drop for Children {
    fn drop(&mut self) {
        for (name, c) in self.list.iter_mut().rev() {
            // SAFETY: kill(2) on our own child's pid; at worst it already exited.
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50))
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
        for d in &self.tmp {
            let _ = std::fs::remove_dir_all(d);
        }
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

fn child_cmd(program: &std::path::Path) -> Command {
    let mut c = Command::new(program);
    let set = stop_signals();
    // SAFETY: in the forked child before exec, prctl sets its own parent death
    // signal and sigprocmask unblocks the signals `up` blocked (the mask is
    // inherited across exec); both are async-signal-safe, and nothing is
    // allocated or locked there.
    unsafe {
        c.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            if libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    c
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
    let exe = std::env::current_exe().context("cannot find the epserve binary")?;
    let mut kids = Children {
        list: Vec::new(),
        tmp: Vec::new(),
    };
    let (tx, rx) = mpsc::channel::<(String, String)>();
    let cluster = format!("local-{}", std::process::id());
    let etcd = match &args.etcd {
        Some(e) => e.clone(),
        None => {
            let etcd_bin = which("etcd").context(
                "`etcd` is not installed (Debian: apt-get install etcd-server); or pass --etcd HOST:PORT",
            )?;
            let (cport, pport) = (free_port()?, free_port()?);
            let dir = std::env::temp_dir().join(format!("epserve-etcd-{}", std::process::id()));
            kids.tmp.push(dir.clone());
            let child = child_cmd(&etcd_bin)
                .args(["--name", "epserve-up", "--data-dir"])
                .arg(&dir)
                .args([
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{cport}"),
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{cport}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{pport}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{pport}"),
                    "--initial-cluster",
                    &format!("epserve-up=http://127.0.0.1:{pport}"),
                    "--log-level",
                    "error",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("cannot start etcd")?;
            kids.list.push(("etcd".into(), child));
            let addr = format!("127.0.0.1:{cport}");
            wait_tcp(&addr, Duration::from_secs(20)).context("etcd did not start")?;
            println!("epserve up: etcd at {addr} (data in {})", dir.display());
            addr
        }
    };
    for i in 0..args.expert_workers {
        let port = free_port()?;
        let name = format!("expert-{i}");
        let mut c = child_cmd(&exe)
            .args(["expert-worker", "--model"])
            .arg(&args.model)
            .args(["--etcd", &etcd, "--cluster", &cluster, "--id", &name])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        forward(name.clone(), &mut c, tx.clone());
        kids.list.push((name, c));
    }
    for i in 0..args.attention_workers {
        let port = free_port()?;
        let name = format!("attention-{i}");
        let mut c = child_cmd(&exe)
            .args(["attention-worker", "--model"])
            .arg(&args.model)
            .args(["--etcd", &etcd, "--cluster", &cluster, "--id", &name])
            .args(["--shard", &i.to_string(), "--of"])
            .arg(args.attention_workers.to_string())
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--kv-cache-memory", &args.attention_kv_cache_memory])
            .args(
                block_size_arg(&args.coordinator_args)
                    .map(|b| vec!["--block-size".to_string(), b])
                    .unwrap_or_default(),
            )
            // The KV lives on the attention-workers: the coordinator's
            // `--kv-cache-dtype` is theirs.
            .args(
                flag_arg(&args.coordinator_args, "--kv-cache-dtype")
                    .map(|d| vec!["--kv-cache-dtype".to_string(), d])
                    .unwrap_or_default(),
            )
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        forward(name.clone(), &mut c, tx.clone());
        kids.list.push((name, c));
    }
    let served = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("model")
            .to_string()
    });
    let mut c = child_cmd(&exe)
        .args(["coordinator", "--model"])
        .arg(&args.model)
        .args(["--etcd", &etcd, "--cluster", &cluster])
        .args(["--expert-workers", &args.expert_workers.to_string()])
        .args(["--attention-workers", &args.attention_workers.to_string()])
        .args(["--host", &args.host, "--port", &args.port.to_string()])
        .args([
            "--served-model-name",
            &served,
            "--dispatch-dtype",
            &args.dispatch_dtype,
        ])
        .args(["--admin-port", &free_port()?.to_string()])
        .args(&args.coordinator_args)
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the coordinator")?;
    forward("coordinator".into(), &mut c, tx.clone());
    kids.list.push(("coordinator".into(), c));
    drop(tx);

    let stop = Arc::new(AtomicBool::new(false));
    {
        // A flag set by the sigwait thread; polled below.
        let s = stop.clone();
        std::thread::spawn(move || wait_signal(s));
    }
    let mut announced = false;
    let mut dead: Vec<String> = Vec::new();
    loop {
        while let Ok((who, line)) = rx.try_recv() {
            if who == "coordinator"
                && !announced
                && line.contains("serving")
                && line.contains("http://")
            {
                announced = true;
                if let Some(i) = line.find("http://") {
                    let url = line[i..].split_whitespace().next().unwrap_or("");
                    println!(
                        "epserve up: cluster ready at {url} ({} expert-workers, {} attention-workers, etcd {etcd})",
                        args.expert_workers, args.attention_workers
                    );
                }
            }
        }
        if stop.load(Ordering::Relaxed) {
            println!("epserve up: stopping");
            return Ok(());
        }
        for (name, c) in kids.list.iter_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                if name == "coordinator" || name == "etcd" {
                    bail!("{name} exited ({status}); stopping the cluster");
                }
                if !dead.contains(name) {
                    // The coordinator reports requests that needed it; keep serving.
                    eprintln!("epserve up: {name} exited ({status})");
                    dead.push(name.clone());
                }
            }
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

fn wait_tcp(addr: &str, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("nothing listens on {addr}")
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
    use super::{block_size_arg, flag_arg};

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
