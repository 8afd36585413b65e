//! Load progress: the loaders count what they have done (weight files
//! mapped and their bytes, dense layers loaded, experts packed) in
//! process-wide counters, and a [`Reporter`] started by a role while it
//! loads shows them: a bar on a terminal (stderr), else a `tracing` info line
//! (target `epserve_load`) every [`LOG_EVERY`] and at each 10%, and one line
//! when done with the load time. A load done within [`LOG_EVERY`] logs
//! nothing at info level (its one line is at debug), so quick loads (test
//! fixtures, a failing start's one-line error) stay quiet. Several loads at
//! once in one process (tests) share the counters; a reporter shows what
//! changed since it started.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often a reporter logs when stderr is not a terminal.
pub const LOG_EVERY: Duration = Duration::from_secs(2);

static FILES: AtomicU64 = AtomicU64::new(0);
static BYTES_MAPPED: AtomicU64 = AtomicU64::new(0);
static LAYERS_TOTAL: AtomicU64 = AtomicU64::new(0);
static LAYERS_DONE: AtomicU64 = AtomicU64::new(0);
static EXPERTS_TOTAL: AtomicU64 = AtomicU64::new(0);
static EXPERTS_DONE: AtomicU64 = AtomicU64::new(0);

/// A weight file of `bytes` was mapped.
pub fn file_mapped(bytes: u64) {
    FILES.fetch_add(1, Ordering::Relaxed);
    BYTES_MAPPED.fetch_add(bytes, Ordering::Relaxed);
}

/// `n` more dense layers are about to be loaded.
pub fn layers_planned(n: u64) {
    LAYERS_TOTAL.fetch_add(n, Ordering::Relaxed);
}

/// One dense layer was loaded.
pub fn layer_loaded() {
    LAYERS_DONE.fetch_add(1, Ordering::Relaxed);
}

/// `n` more experts are about to be packed.
pub fn experts_planned(n: u64) {
    EXPERTS_TOTAL.fetch_add(n, Ordering::Relaxed);
}

/// One expert was packed.
pub fn expert_packed() {
    EXPERTS_DONE.fetch_add(1, Ordering::Relaxed);
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub files: u64,
    pub bytes_mapped: u64,
    pub layers_total: u64,
    pub layers_done: u64,
    pub experts_total: u64,
    pub experts_done: u64,
}

impl Snapshot {
    /// The counters now.
    pub fn now() -> Self {
        Snapshot {
            files: FILES.load(Ordering::Relaxed),
            bytes_mapped: BYTES_MAPPED.load(Ordering::Relaxed),
            layers_total: LAYERS_TOTAL.load(Ordering::Relaxed),
            layers_done: LAYERS_DONE.load(Ordering::Relaxed),
            experts_total: EXPERTS_TOTAL.load(Ordering::Relaxed),
            experts_done: EXPERTS_DONE.load(Ordering::Relaxed),
        }
    }

    /// What changed since `base`.
    pub fn since(&self, base: &Snapshot) -> Snapshot {
        Snapshot {
            files: self.files.saturating_sub(base.files),
            bytes_mapped: self.bytes_mapped.saturating_sub(base.bytes_mapped),
            layers_total: self.layers_total.saturating_sub(base.layers_total),
            layers_done: self.layers_done.saturating_sub(base.layers_done),
            experts_total: self.experts_total.saturating_sub(base.experts_total),
            experts_done: self.experts_done.saturating_sub(base.experts_done),
        }
    }

    /// Units of work done and planned (layers plus experts).
    fn work(&self) -> (u64, u64) {
        (
            self.layers_done + self.experts_done,
            self.layers_total + self.experts_total,
        )
    }

    /// "1.2 GiB mapped (3 files), layers 4/48, experts 512/6144".
    pub fn describe(&self) -> String {
        let mut s = if self.files > 0 {
            format!(
                "{} mapped ({} file{})",
                human_bytes(self.bytes_mapped),
                self.files,
                if self.files == 1 { "" } else { "s" }
            )
        } else {
            "weights already mapped".to_string()
        };
        if self.layers_total > 0 {
            s.push_str(&format!(
                ", layers {}/{}",
                self.layers_done, self.layers_total
            ));
        }
        if self.experts_total > 0 {
            s.push_str(&format!(
                ", experts packed {}/{}",
                self.experts_done, self.experts_total
            ));
        }
        s
    }
}

/// `1536` → "1.5 KiB".
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Shows the progress of one load until [`finish`](Reporter::finish)ed (or
/// dropped, which stops it without the final line).
pub struct Reporter {
    what: String,
    base: Snapshot,
    started: Instant,
    every: Duration,
    stop: Arc<AtomicBool>,
    /// A progress line was logged.
    shown: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Reporter {
    /// Starts reporting `what` ("loading model /m/Qwen3-30B-A3B"): a bar when
    /// stderr is a terminal, else info lines every [`LOG_EVERY`].
    pub fn start(what: impl Into<String>) -> Self {
        Self::start_with(what, std::io::stderr().is_terminal(), LOG_EVERY)
    }

    /// [`start`](Self::start) with the display chosen: `bar`, or log lines
    /// every `every`.
    pub fn start_with(what: impl Into<String>, bar: bool, every: Duration) -> Self {
        let what = what.into();
        let base = Snapshot::now();
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let shown = Arc::new(AtomicBool::new(false));
        let (w, s, sh) = (what.clone(), stop.clone(), shown.clone());
        let thread = std::thread::Builder::new()
            .name("load-progress".into())
            .spawn(move || {
                if bar {
                    show_bar(&w, base, &s)
                } else {
                    show_lines(&w, base, started, &s, &sh, every)
                }
            })
            .ok();
        Reporter {
            what,
            base,
            started,
            every,
            stop,
            shown,
            thread,
        }
    }

    /// What this load did so far.
    pub fn progress(&self) -> Snapshot {
        Snapshot::now().since(&self.base)
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }

    /// Stops the display and logs the one "done" line: load time and what
    /// was loaded. Returns the load time and the progress.
    pub fn finish(mut self) -> (Duration, Snapshot) {
        self.halt();
        let elapsed = self.started.elapsed();
        let p = self.progress();
        let line = format!(
            "{} done in {:.1} s: {}",
            self.what,
            elapsed.as_secs_f64(),
            p.describe()
        );
        if elapsed >= self.every || self.shown.load(Ordering::Relaxed) {
            tracing::info!(
                target: "epserve_load",
                load_s = elapsed.as_secs_f64(),
                bytes_mapped = p.bytes_mapped,
                experts_packed = p.experts_done,
                "{line}"
            );
        } else {
            tracing::debug!(
                target: "epserve_load",
                load_s = elapsed.as_secs_f64(),
                bytes_mapped = p.bytes_mapped,
                experts_packed = p.experts_done,
                "{line}"
            );
        }
        (elapsed, p)
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        self.halt();
    }
}

fn show_lines(
    what: &str,
    base: Snapshot,
    started: Instant,
    stop: &AtomicBool,
    shown: &AtomicBool,
    every: Duration,
) {
    let mut last_log = Instant::now();
    let mut last_decile = 0;
    while !stop.load(Ordering::Relaxed) {
        std::thread::park_timeout(Duration::from_millis(100).min(every));
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let p = Snapshot::now().since(&base);
        let (done, total) = p.work();
        let decile = (done * 10).checked_div(total).unwrap_or(0);
        // Every `every`, and at each 10% step, once the load has taken `every`.
        if started.elapsed() >= every && (last_log.elapsed() >= every || decile > last_decile) {
            shown.store(true, Ordering::Relaxed);
            last_log = Instant::now();
            last_decile = decile;
            let pct = (done * 100)
                .checked_div(total)
                .map(|p| format!(" ({p}%)"))
                .unwrap_or_default();
            tracing::info!(
                target: "epserve_load",
                "{what}: {}{pct}, {:.0} s",
                p.describe(),
                started.elapsed().as_secs_f64()
            );
        }
    }
}

fn show_bar(what: &str, base: Snapshot, stop: &AtomicBool) {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(0),
        indicatif::ProgressDrawTarget::stderr_with_hz(8),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] [{wide_bar}] {percent:>3}% {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(what.to_string());
    while !stop.load(Ordering::Relaxed) {
        let p = Snapshot::now().since(&base);
        let (done, total) = p.work();
        bar.set_length(total.max(1));
        bar.set_position(done);
        bar.set_message(p.describe());
        std::thread::park_timeout(Duration::from_millis(125));
    }
    bar.finish_and_clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_since_the_start_and_describes_them() {
        let r = Reporter::start_with("test load", false, Duration::from_millis(10));
        file_mapped(3 << 30);
        layers_planned(2);
        layer_loaded();
        experts_planned(4);
        expert_packed();
        std::thread::sleep(Duration::from_millis(50));
        assert!(r.shown.load(Ordering::Relaxed), "a line after `every`");
        let (_, p) = r.finish();
        // Other tests may load at the same time: at least ours are counted.
        assert!(p.bytes_mapped >= 3 << 30 && p.files >= 1);
        assert!(p.layers_done >= 1 && p.experts_done >= 1);
        assert!(p.describe().contains("GiB mapped"), "{}", p.describe());
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }

    #[test]
    fn a_bar_starts_and_stops() {
        let r = Reporter::start_with("bar", true, LOG_EVERY);
        expert_packed();
        drop(r);
    }
}
