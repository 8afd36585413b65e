//! `epserve up` as a child process, for the cluster tests: start it, wait for
//! "cluster ready", and stop it (SIGTERM, which stops every child) on drop.
//! The pid of every child `up` started (and restarted) is kept from its
//! `epserve up: started NAME (pid PID)` lines.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What `up` said about its children, as its stdout reader thread saw it.
#[derive(Debug, Default)]
pub struct UpLog {
    /// The latest pid of each child by name (`etcd`, `expert-0`, `coordinator`).
    pub pids: BTreeMap<String, u32>,
    /// `up`'s own lines (`epserve up: ...`), oldest first, with when they
    /// were read; the last 500.
    pub lines: Vec<(Instant, String)>,
}

/// `NAME` and `PID` of an `epserve up: started NAME (pid PID)` line.
pub fn parse_started(line: &str) -> Option<(String, u32)> {
    let rest = line.strip_prefix("epserve up: started ")?;
    let (name, rest) = rest.split_once(" (pid ")?;
    let pid = rest.strip_suffix(')')?.parse().ok()?;
    Some((name.to_string(), pid))
}

/// A running local cluster.
pub struct Up {
    pub child: Child,
    /// `http://HOST:PORT` (without `/v1`).
    pub url: String,
    /// etcd's client address.
    pub etcd: String,
    /// The temporary etcd data dir `up` created (None with `--etcd`).
    pub etcd_data_dir: Option<PathBuf>,
    /// The coordinator's admin gRPC address.
    pub admin: String,
    /// Children's pids and `up`'s lines, kept current while it runs.
    pub log: Arc<Mutex<UpLog>>,
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return; // already exited and reaped: its pid may be reused
        }
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

impl Up {
    /// The name of the cluster `up` started (its keys' prefix in etcd).
    pub async fn cluster_name(&self) -> String {
        use epserve_cluster::store::{EtcdStore, KvStore};
        let store = EtcdStore::connect(&self.etcd).await.expect("etcd");
        store
            .list("/epserve/")
            .await
            .expect("list")
            .iter()
            .find_map(|(k, _)| {
                k.strip_prefix("/epserve/")
                    .and_then(|r| r.split('/').next())
                    .map(str::to_string)
            })
            .expect("a cluster prefix")
    }

    /// That cluster's state in etcd.
    pub async fn cluster_state(&self) -> epserve_cluster::state::ClusterState {
        let store = epserve_cluster::store::EtcdStore::connect(&self.etcd)
            .await
            .expect("etcd");
        let name = self.cluster_name().await;
        epserve_cluster::state::ClusterState::new(Arc::new(store), &name)
    }

    /// Runs `BIN up ARGS...` (BIN: the test's `CARGO_BIN_EXE_epserve-it`) and
    /// waits up to 120 s for it to report the cluster ready. With `echo`, the
    /// cluster's stdout is copied to stderr.
    pub fn start(bin: &str, args: &[&str], echo: bool) -> Up {
        Up::start_with(bin, args, echo, |_| {})
    }

    /// `start`, with `configure` applied to the command first (e.g. a
    /// `pre_exec` hook).
    pub fn start_with(
        bin: &str,
        args: &[&str],
        echo: bool,
        configure: impl FnOnce(&mut Command),
    ) -> Up {
        let mut cmd = Command::new(bin);
        cmd.arg("up")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        configure(&mut cmd);
        let mut child = cmd.spawn().expect("spawn epserve up");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let log = Arc::new(Mutex::new(UpLog::default()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            let mut etcd = String::new();
            let mut etcd_data_dir = None;
            let mut admin = String::new();
            for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                if echo {
                    eprintln!("{line}");
                }
                if line.starts_with("epserve up: ") {
                    let mut l = log2.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some((name, pid)) = parse_started(&line) {
                        l.pids.insert(name, pid);
                    }
                    if l.lines.len() >= 500 {
                        l.lines.remove(0);
                    }
                    l.lines.push((Instant::now(), line.clone()));
                }
                if let Some(i) = line.find("admin gRPC at ") {
                    admin = line[i + "admin gRPC at ".len()..].trim().to_string();
                }
                if let Some(rest) = line.strip_prefix("epserve up: etcd at ") {
                    etcd = rest.split_whitespace().next().unwrap_or("").to_string();
                    etcd_data_dir = rest
                        .split_once("(data in ")
                        .and_then(|(_, d)| d.strip_suffix(')'))
                        .map(PathBuf::from);
                }
                if let Some(i) = line.find("cluster ready at http://") {
                    let url = line[i + "cluster ready at ".len()..]
                        .split_whitespace()
                        .next()
                        .unwrap_or("")
                        .trim_end_matches("/v1")
                        .to_string();
                    let _ = tx.send((url, etcd.clone(), etcd_data_dir.clone(), admin.clone()));
                }
            }
        });
        let (url, etcd, etcd_data_dir, admin) = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(ready) => ready,
            Err(e) => {
                // Say why: up's exit status and its own lines (its workers'
                // logs went to this test's stderr).
                let status = child.try_wait();
                let lines = log
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .lines
                    .iter()
                    .map(|(_, l)| l.clone())
                    .collect::<Vec<_>>()
                    .join("\n");
                let _ = child.kill();
                panic!(
                    "epserve up {args:?} was not ready ({e}; exit status {status:?}); its lines:\n{lines}"
                );
            }
        };
        Up {
            child,
            url,
            etcd,
            etcd_data_dir,
            admin,
            log,
        }
    }

    /// The latest pid of child `name` (`etcd`, `expert-0`, `coordinator`).
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pids
            .get(name)
            .copied()
    }

    /// When `up` printed (the first) line containing `what` at or after
    /// `since`, if it did.
    pub fn find_line(&self, what: &str, since: Instant) -> Option<Instant> {
        let l = self.log.lock().unwrap_or_else(|e| e.into_inner());
        l.lines
            .iter()
            .find(|(t, line)| *t >= since && line.contains(what))
            .map(|(t, _)| *t)
    }

    /// Waits (blocking, up to `limit`) for `find_line`.
    pub fn wait_line(&self, what: &str, since: Instant, limit: Duration) -> Option<Instant> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(t) = self.find_line(what, since) {
                return Some(t);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Pids of the processes `up` started (its direct children), from /proc.
    pub fn children(&self) -> Vec<u32> {
        children_of(self.child.id())
    }
}

/// Pids whose parent is `pid`, from /proc/*/stat.
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.filter_map(|e| e.ok()) {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out.sort_unstable();
    out
}

/// Whether `etcd` is on PATH. Its absence is a failure under
/// `EPSERVE_REQUIRE_ETCD=1` (set by `.ci/run`), a skip otherwise.
pub fn etcd_available() -> bool {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("etcd").is_file()))
        .unwrap_or(false);
    if !found {
        assert!(
            std::env::var("EPSERVE_REQUIRE_ETCD").as_deref() != Ok("1"),
            "EPSERVE_REQUIRE_ETCD=1 but etcd is not on PATH"
        );
        eprintln!("skipping: etcd is not installed (apt-get install etcd-server)");
    }
    found
}

/// A loopback port free at the time of asking (the caller binds it later:
/// another process may take it first).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// A lone etcd on free loopback ports with a temporary data dir, for tests
/// that stop or restart it under running workers; killed and its dir
/// removed on drop.
pub struct Etcd {
    pub child: Child,
    /// Client address `127.0.0.1:PORT`.
    pub addr: String,
    peer_port: u16,
    dir: PathBuf,
    tls: Option<EtcdTls>,
}

/// Certificates of a TLS etcd ([`Etcd::start_tls`]): PEM files.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// CA that signed the server certificate and the clients'.
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Etcd {
    /// Starts etcd and waits for its client port (60 s; a start that fails
    /// at once is retried on fresh ports).
    pub fn start() -> Etcd {
        Self::start_opt(None)
    }

    /// Starts etcd serving clients over TLS with `tls`'s server certificate
    /// and requiring client certificates signed by its CA
    /// (`--client-cert-auth`).
    pub fn start_tls(tls: EtcdTls) -> Etcd {
        Self::start_opt(Some(tls))
    }

    fn start_opt(tls: Option<EtcdTls>) -> Etcd {
        // A port found free can be taken (by a parallel test's server or an
        // outgoing connection) before etcd binds it; etcd then exits at once.
        // Such a start is retried on fresh ports; a slow one is waited for.
        let mut failures = Vec::new();
        for _ in 0..4 {
            let (cport, pport) = (free_port(), free_port());
            let dir = std::env::temp_dir()
                .join(format!("epserve-test-etcd-{}-{cport}", std::process::id()));
            let addr = format!("127.0.0.1:{cport}");
            let child = Self::spawn(&addr, pport, &dir, tls.as_ref());
            let mut etcd = Etcd {
                child,
                addr,
                peer_port: pport,
                dir,
                tls: tls.clone(),
            };
            match etcd.wait_ready() {
                Ok(()) => return etcd,
                Err(e) => failures.push(e),
            }
        }
        panic!("etcd did not start: {}", failures.join("; "))
    }

    fn spawn(addr: &str, pport: u16, dir: &std::path::Path, tls: Option<&EtcdTls>) -> Child {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut cmd = Command::new("etcd");
        if let Some(t) = tls {
            cmd.arg("--cert-file")
                .arg(&t.cert)
                .arg("--key-file")
                .arg(&t.key)
                .arg("--trusted-ca-file")
                .arg(&t.ca)
                .arg("--client-cert-auth");
        }
        // etcd's errors go to a file beside its data dir, quoted when a
        // start fails.
        let log = std::fs::File::create(Self::log_path(dir))
            .map(Stdio::from)
            .unwrap_or_else(|_| Stdio::null());
        cmd.args(["--name", "t", "--data-dir"])
            .arg(dir)
            .args([
                "--listen-client-urls",
                &format!("{scheme}://{addr}"),
                "--advertise-client-urls",
                &format!("{scheme}://{addr}"),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{pport}"),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{pport}"),
                "--initial-cluster",
                &format!("t=http://127.0.0.1:{pport}"),
                "--log-level",
                "error",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd")
    }

    fn log_path(dir: &std::path::Path) -> PathBuf {
        let mut name = dir.as_os_str().to_owned();
        name.push(".log");
        PathBuf::from(name)
    }

    /// The last three lines etcd logged, joined.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(Self::log_path(&self.dir)).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(3).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    /// Waits up to 60 s for the client port. An etcd that exits first (a
    /// port taken since it was found free) is an error carrying the end of
    /// its log; one still silent at the deadline is killed and an error.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if std::net::TcpStream::connect(&self.addr).is_ok() {
                return Ok(());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = self.log_tail();
                return Err(format!("etcd on {} exited ({status}): {log}", self.addr));
            }
            if std::time::Instant::now() >= deadline {
                self.kill();
                let log = self.log_tail();
                return Err(format!("etcd on {} silent for 60 s: {log}", self.addr));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills etcd (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills etcd and, `down` later, starts it again on the same ports and
    /// data.
    pub fn restart_after(&mut self, down: Duration) {
        self.kill();
        std::thread::sleep(down);
        // The same ports are wanted (workers hold this address); one taken
        // meanwhile is waited out rather than moved.
        let mut failures = Vec::new();
        for _ in 0..4 {
            self.child = Self::spawn(&self.addr, self.peer_port, &self.dir, self.tls.as_ref());
            match self.wait_ready() {
                Ok(()) => return,
                Err(e) => failures.push(e),
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!("etcd did not restart: {}", failures.join("; "))
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(Self::log_path(&self.dir));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An etcd whose client port is taken exits at once; the wait reports
    /// that with etcd's own words instead of timing out.
    #[test]
    fn a_taken_port_fails_fast_with_etcds_reason() {
        if !etcd_available() {
            return;
        }
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = held.local_addr().expect("addr").to_string();
        let (pport, idle) = (free_port(), free_port());
        let dir =
            std::env::temp_dir().join(format!("epserve-test-etcd-taken-{}", std::process::id()));
        let child = Etcd::spawn(&addr, pport, &dir, None);
        let mut etcd = Etcd {
            child,
            // Connecting to `addr` would reach the holder, so wait on a port
            // nobody serves: only etcd's exit can end the wait early.
            addr: format!("127.0.0.1:{idle}"),
            peer_port: pport,
            dir,
            tls: None,
        };
        let started = std::time::Instant::now();
        let err = etcd
            .wait_ready()
            .expect_err("etcd cannot serve a taken port");
        eprintln!("{err}");
        assert!(err.contains("exited"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(30), "{err}");
        drop(held);
    }
}
