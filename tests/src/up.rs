//! `epserve up` as a child process, for the cluster tests: start it, wait for
//! "cluster ready", and stop it (SIGTERM, which stops every child) on drop.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running local cluster.
pub struct Up {
    pub child: Child,
    /// `http://HOST:PORT` (without `/v1`).
    pub url: String,
    /// etcd's client address.
    pub etcd: String,
    /// The coordinator's admin gRPC address.
    pub admin: String,
}

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

impl Up {
    /// Runs `BIN up ARGS...` (BIN: the test's `CARGO_BIN_EXE_epserve-it`) and
    /// waits up to 120 s for it to report the cluster ready. With `echo`, the
    /// cluster's stdout is copied to stderr.
    pub fn start(bin: &str, args: &[&str], echo: bool) -> Up {
        let mut child = Command::new(bin)
            .arg("up")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn epserve up");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut etcd = String::new();
            let mut admin = String::new();
            for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                if echo {
                    eprintln!("{line}");
                }
                if let Some(i) = line.find("admin gRPC at ") {
                    admin = line[i + "admin gRPC at ".len()..].trim().to_string();
                }
                if let Some(rest) = line.strip_prefix("epserve up: etcd at ") {
                    etcd = rest.split_whitespace().next().unwrap_or("").to_string();
                }
                if let Some(i) = line.find("cluster ready at http://") {
                    let url = line[i + "cluster ready at ".len()..]
                        .split_whitespace()
                        .next()
                        .unwrap_or("")
                        .trim_end_matches("/v1")
                        .to_string();
                    let _ = tx.send((url, etcd.clone(), admin.clone()));
                }
            }
        });
        let (url, etcd, admin) = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("cluster ready");
        Up {
            child,
            url,
            etcd,
            admin,
        }
    }
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
