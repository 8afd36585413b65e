//! A link emulator for benchmarks (`epserve up --emulate-link 500us,10gbit`):
//! a TCP proxy on loopback that adds a one-way delay in each direction and
//! caps the rate, so one machine can stand in for separate nodes.
//!
//! Each direction of each connection is a pipe of two threads: a reader
//! that reads the source as fast as the rate cap lets it, stamps each chunk
//! with its release time and queues it, and a writer that writes each chunk
//! to the destination at its release time, in order. The delay is therefore
//! a latency only, never a throughput limit: the reader keeps reading while
//! earlier chunks wait out their delay.
//!
//! The rate cap is a token bucket of (almost) no depth, kept as a virtual
//! clock: a chunk of `n` bytes occupies the link for `n / rate` from when the
//! link is free (or from when it was read, if later) and is released `delay`
//! after it is fully sent. The reader stops reading while the link is booked
//! more than [`RATE_LAG`] ahead, so the sender feels the cap through TCP's
//! own flow control. Chunks are at most one millisecond of the link's bytes.
//!
//! Threads, not tokio: tokio's timer has a granularity of one millisecond,
//! too coarse for a 200 µs delay; `thread::sleep` with the timer slack set to
//! its minimum wakes within tens of microseconds. A proxy carries a handful
//! of long-lived gRPC connections (four threads each).
//!
//! When a source closes (EOF), the pipe delivers what is queued and then
//! shuts down writing on the destination, so a close travels like data and
//! each side sees the other's; a read or write error (a reset) shuts down
//! both sockets of the connection at once.

use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How far ahead the rate cap may book the link before the reader waits.
pub const RATE_LAG: Duration = Duration::from_millis(1);
/// Largest chunk read at once (without a rate cap, or on a fast link).
const MAX_CHUNK: usize = 64 * 1024;
/// Smallest chunk read at once on a slow link.
const MIN_CHUNK: usize = 1500;
/// Chunks queued per direction (at most `QUEUE * MAX_CHUNK` bytes).
const QUEUE: usize = 1024;
/// How long a proxy tries to reach its upstream for a new connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a new connection waits for an upstream not yet known.
pub const UPSTREAM_WAIT: Duration = Duration::from_secs(30);

/// Where a proxy forwards, once known; and whether the proxy stopped (which
/// ends a wait for the address).
#[derive(Default)]
struct Upstream {
    state: Mutex<(Option<SocketAddr>, bool)>,
    changed: std::sync::Condvar,
}

impl Upstream {
    fn update(&self, f: impl FnOnce(&mut (Option<SocketAddr>, bool))) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut st);
        self.changed.notify_all();
    }

    fn set(&self, addr: SocketAddr) {
        self.update(|st| st.0 = Some(addr));
    }

    fn stop(&self) {
        self.update(|st| st.1 = true);
    }

    /// The address, waiting up to `limit` for it to be set (None on a stop).
    fn get(&self, limit: Duration) -> Option<SocketAddr> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (st, _) = self
            .changed
            .wait_timeout_while(st, limit, |st| st.0.is_none() && !st.1)
            .unwrap_or_else(|p| p.into_inner());
        st.0
    }
}

/// What `--emulate-link` asks for: a one-way delay and an optional rate cap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpec {
    /// Added to every byte, in each direction.
    pub delay: Duration,
    /// Bytes per second in each direction (None: as fast as loopback).
    pub rate: Option<f64>,
}

impl LinkSpec {
    /// Parses `DELAY`, `RATE` or `DELAY,RATE` (either order): a delay is a
    /// number with `ns`, `us` (`µs`), `ms` or `s`; a rate is a number with
    /// `bit`, `kbit`, `mbit`, `gbit`, `tbit` (bits per second, powers of
    /// 1000) or `bps`, `kbps`, `mbps`, `gbps` (bytes per second), as tc(8)
    /// writes them; units are case-insensitive. `500us`, `200us,10gbit`,
    /// `1.5ms,100mbit`, `1gbps`.
    pub fn parse(spec: &str) -> Result<LinkSpec> {
        let mut delay = None;
        let mut rate = None;
        let parts: Vec<&str> = spec.split(',').map(str::trim).collect();
        if parts.len() > 2 || parts.iter().any(|p| p.is_empty()) {
            bail!(
                "invalid link spec '{spec}': expected DELAY, RATE or DELAY,RATE (e.g. 500us or 200us,10gbit)"
            );
        }
        for part in parts {
            let split = part
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(part.len());
            let (num, unit) = part.split_at(split);
            let value: f64 = num
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite())
                .with_context(|| {
                    format!("invalid link spec '{spec}': '{part}' does not start with a number")
                })?;
            let unit = unit.trim().to_ascii_lowercase();
            let secs = match unit.as_str() {
                "ns" => Some(1e-9),
                "us" | "µs" => Some(1e-6),
                "ms" => Some(1e-3),
                "s" => Some(1.0),
                _ => None,
            };
            if let Some(scale) = secs {
                if delay.is_some() {
                    bail!("invalid link spec '{spec}': two delays");
                }
                let d = value * scale;
                if d > 60.0 {
                    bail!("invalid link spec '{spec}': a delay of {part} is over a minute");
                }
                delay = Some(Duration::from_secs_f64(d));
                continue;
            }
            let bytes_per_sec = match unit.as_str() {
                "bit" => value / 8.0,
                "kbit" => value * 1e3 / 8.0,
                "mbit" => value * 1e6 / 8.0,
                "gbit" => value * 1e9 / 8.0,
                "tbit" => value * 1e12 / 8.0,
                "bps" => value,
                "kbps" => value * 1e3,
                "mbps" => value * 1e6,
                "gbps" => value * 1e9,
                "" => bail!(
                    "invalid link spec '{spec}': '{part}' has no unit (delay: ns, us, ms, s; rate: bit, kbit, mbit, gbit, tbit, bps, kbps, mbps, gbps)"
                ),
                u => bail!(
                    "invalid link spec '{spec}': unknown unit '{u}' (delay: ns, us, ms, s; rate: bit, kbit, mbit, gbit, tbit, bps, kbps, mbps, gbps)"
                ),
            };
            if rate.is_some() {
                bail!("invalid link spec '{spec}': two rates");
            }
            if bytes_per_sec < 1000.0 {
                bail!(
                    "invalid link spec '{spec}': a rate of {part} is below 8 kbit (1000 bytes per second)"
                );
            }
            rate = Some(bytes_per_sec);
        }
        Ok(LinkSpec {
            delay: delay.unwrap_or(Duration::ZERO),
            rate,
        })
    }

    /// Bytes read at once: about a millisecond of the link, within
    /// [`MIN_CHUNK`]..=[`MAX_CHUNK`].
    fn chunk(&self) -> usize {
        match self.rate {
            Some(r) => ((r / 1000.0) as usize).clamp(MIN_CHUNK, MAX_CHUNK),
            None => MAX_CHUNK,
        }
    }
}

impl fmt::Display for LinkSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} one-way", self.delay)?;
        match self.rate {
            Some(r) => write!(f, ", {:.3} Gbit/s", r * 8.0 / 1e9),
            None => write!(f, ", no rate cap"),
        }
    }
}

/// Both sockets of one proxied connection, to cut it on an error.
struct Conn {
    client: TcpStream,
    upstream: TcpStream,
}

impl Conn {
    fn abort(&self) {
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.upstream.shutdown(Shutdown::Both);
    }
}

/// An open connection of a proxy, by id.
type Open = (u64, Arc<Conn>);

/// Counters of a running proxy.
#[derive(Debug, Default)]
struct Stats {
    connections: AtomicUsize,
    /// Most chunks waiting in one direction's queue at once.
    max_queued: AtomicUsize,
}

/// A running proxy: listens on [`LinkProxy::addr`] and forwards every
/// connection to its upstream through the emulated link. Dropping it stops
/// accepting and cuts the open connections.
pub struct LinkProxy {
    addr: SocketAddr,
    upstream: Arc<Upstream>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<Open>>>,
    stats: Arc<Stats>,
    accept: Option<JoinHandle<()>>,
}

impl LinkProxy {
    /// Listens on `listen` (e.g. `127.0.0.1:0`) and forwards to `upstream`,
    /// which need not listen yet: it is dialled for each new connection.
    pub fn start(listen: SocketAddr, upstream: SocketAddr, spec: LinkSpec) -> Result<LinkProxy> {
        let proxy = LinkProxy::start_pending(listen, spec)?;
        proxy.set_upstream(upstream);
        Ok(proxy)
    }

    /// Listens on `listen` before the upstream's address is known (a server
    /// that binds port 0 and says which port it got): a connection that
    /// arrives before [`LinkProxy::set_upstream`] waits up to
    /// [`UPSTREAM_WAIT`] for it, then is closed.
    pub fn start_pending(listen: SocketAddr, spec: LinkSpec) -> Result<LinkProxy> {
        let listener = TcpListener::bind(listen)
            .with_context(|| format!("link emulator: cannot listen on {listen}"))?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<Open>>> = Arc::default();
        let stats: Arc<Stats> = Arc::default();
        let upstream: Arc<Upstream> = Arc::default();
        let accept = {
            let (stop, conns, stats, upstream) =
                (stop.clone(), conns.clone(), stats.clone(), upstream.clone());
            std::thread::Builder::new()
                .name(format!("link-{}", addr.port()))
                .spawn(move || accept_loop(listener, upstream, spec, stop, conns, stats))
                .context("link emulator: cannot start a thread")?
        };
        Ok(LinkProxy {
            addr,
            upstream,
            stop,
            conns,
            stats,
            accept: Some(accept),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets (or changes) where new connections are forwarded; open ones
    /// keep theirs.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        self.upstream.set(upstream);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.stats.connections.load(Ordering::Relaxed)
    }

    /// Most chunks that waited in one direction's queue at once (above 1:
    /// reading went on while earlier chunks waited out their delay).
    pub fn max_queued(&self) -> usize {
        self.stats.max_queued.load(Ordering::Relaxed)
    }
}

impl Drop for LinkProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.upstream.stop();
        // Wake the accept loop (it checks `stop` after each accept).
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        if let Ok(list) = self.conns.lock() {
            for (_, c) in list.iter() {
                c.abort();
            }
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    upstream: Arc<Upstream>,
    spec: LinkSpec,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<Open>>>,
    stats: Arc<Stats>,
) {
    let mut next_id = 0u64;
    for client in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = client else {
            // EMFILE and the like: do not spin.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let Some(to) = upstream.get(UPSTREAM_WAIT) else {
            tracing::debug!("link emulator: no upstream yet; closing a connection");
            continue;
        };
        let upstream = match TcpStream::connect_timeout(&to, CONNECT_TIMEOUT) {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(upstream = %to, error = %e, "link emulator: upstream unreachable");
                continue; // dropping the client closes it
            }
        };
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        let (Ok(c2), Ok(u2)) = (client.try_clone(), upstream.try_clone()) else {
            continue;
        };
        let conn = Arc::new(Conn { client, upstream });
        let id = next_id;
        next_id += 1;
        if let Ok(mut l) = conns.lock() {
            l.push((id, conn.clone()));
        }
        stats.connections.fetch_add(1, Ordering::Relaxed);
        let (conns, stats) = (conns.clone(), stats.clone());
        let spawned = std::thread::Builder::new()
            .name("link-conn".into())
            .spawn(move || {
                serve_conn(c2, u2, &conn, spec, &stats);
                if let Ok(mut l) = conns.lock() {
                    l.retain(|(i, _)| *i != id);
                }
            });
        if spawned.is_err() {
            tracing::warn!("link emulator: cannot start a thread for a connection");
        }
    }
}

/// Both directions of one connection; returns when both are done.
fn serve_conn(
    client: TcpStream,
    upstream: TcpStream,
    conn: &Arc<Conn>,
    spec: LinkSpec,
    stats: &Arc<Stats>,
) {
    let (Ok(c_read), Ok(u_read)) = (client.try_clone(), upstream.try_clone()) else {
        conn.abort();
        return;
    };
    let up = {
        let (conn, stats) = (conn.clone(), stats.clone());
        std::thread::Builder::new()
            .name("link-pipe".into())
            .spawn(move || pipe(c_read, upstream, spec, &conn, &stats))
    };
    pipe(u_read, client, spec, conn, stats);
    match up {
        Ok(h) => {
            let _ = h.join();
        }
        Err(_) => conn.abort(),
    }
}

/// Smallest timer slack for the calling thread, so short sleeps end on time.
fn precise_timers() {
    // SAFETY: PR_SET_TIMERSLACK only changes this thread's timer slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// One direction: reads `src`, delays and paces, writes `dst` in order.
fn pipe(
    mut src: TcpStream,
    mut dst: TcpStream,
    spec: LinkSpec,
    conn: &Arc<Conn>,
    stats: &Arc<Stats>,
) {
    precise_timers();
    let (tx, rx) = mpsc::sync_channel::<(Instant, Vec<u8>)>(QUEUE);
    let queued = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (conn, queued) = (conn.clone(), queued.clone());
        std::thread::Builder::new()
            .name("link-write".into())
            .spawn(move || {
                precise_timers();
                for (at, buf) in rx {
                    sleep_until(at);
                    queued.fetch_sub(1, Ordering::Relaxed);
                    if dst.write_all(&buf).is_err() {
                        conn.abort();
                        return;
                    }
                }
                // The source closed: so does the destination, after the data.
                let _ = dst.shutdown(Shutdown::Write);
            })
    };
    let Ok(writer) = writer else {
        conn.abort();
        return;
    };
    let chunk = spec.chunk();
    // When the link is free again (rate cap only).
    let mut free_at = Instant::now();
    loop {
        if spec.rate.is_some() {
            sleep_until(free_at.checked_sub(RATE_LAG).unwrap_or(free_at));
        }
        let mut buf = vec![0u8; chunk];
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => {
                conn.abort();
                break;
            }
        };
        buf.truncate(n);
        let now = Instant::now();
        let sent = match spec.rate {
            Some(r) => {
                free_at = free_at.max(now) + Duration::from_secs_f64(n as f64 / r);
                free_at
            }
            None => now,
        };
        let q = queued.fetch_add(1, Ordering::Relaxed) + 1;
        stats.max_queued.fetch_max(q, Ordering::Relaxed);
        if tx.send((sent + spec.delay, buf)).is_err() {
            break; // the writer failed and cut the connection
        }
    }
    drop(tx);
    let _ = writer.join();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }

    /// An echo server for one connection at a time, until `conns` served.
    fn echo_server(conns: usize) -> (SocketAddr, JoinHandle<()>) {
        let l = TcpListener::bind(loopback()).expect("bind");
        let addr = l.local_addr().expect("addr");
        let h = std::thread::spawn(move || {
            for s in l.incoming().take(conns) {
                let Ok(mut s) = s else { return };
                let _ = s.set_nodelay(true);
                let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
                let mut buf = [0u8; 4096];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
            }
        });
        (addr, h)
    }

    #[test]
    fn specs_parse_and_bad_ones_are_refused() {
        let p = |s| LinkSpec::parse(s).expect(s);
        assert_eq!(p("500us").delay, Duration::from_micros(500));
        assert_eq!(p("500us").rate, None);
        assert_eq!(p("500µs").delay, Duration::from_micros(500));
        assert_eq!(p("1ms").delay, Duration::from_millis(1));
        assert_eq!(p("1.5ms").delay, Duration::from_micros(1500));
        assert_eq!(p("2s").delay, Duration::from_secs(2));
        assert_eq!(p("250ns").delay, Duration::from_nanos(250));
        let s = p("200us,10gbit");
        assert_eq!(s.delay, Duration::from_micros(200));
        assert_eq!(s.rate, Some(1.25e9));
        let s = p(" 10Gbit , 200US ");
        assert_eq!(s.delay, Duration::from_micros(200));
        assert_eq!(s.rate, Some(1.25e9));
        assert_eq!(p("100mbit").rate, Some(12.5e6));
        assert_eq!(p("100mbit").delay, Duration::ZERO);
        assert_eq!(p("64kbit").rate, Some(8000.0));
        assert_eq!(p("1gbps").rate, Some(1e9));
        assert_eq!(p("5mbps").rate, Some(5e6));
        assert_eq!(p("1tbit").rate, Some(1.25e11));
        for bad in [
            "",
            "500",
            "ms",
            "500 parsecs",
            "1ms,2ms",
            "1gbit,2gbit",
            "1ms,",
            ",1ms",
            "1ms,1gbit,1s",
            "-1ms",
            "1e3us",
            "2min",
            "100bit",
            "1..5ms",
            "61s",
        ] {
            assert!(LinkSpec::parse(bad).is_err(), "{bad:?} should be refused");
        }
        let e = format!("{:#}", LinkSpec::parse("5 furlongs").expect_err("bad unit"));
        assert!(e.contains("unknown unit 'furlongs'"), "{e}");
    }

    #[test]
    fn chunks_are_about_a_millisecond_of_the_link() {
        let c = |s| LinkSpec::parse(s).expect(s).chunk();
        assert_eq!(c("1ms"), MAX_CHUNK);
        assert_eq!(c("10gbit"), MAX_CHUNK);
        assert_eq!(c("100mbit"), 12_500);
        assert_eq!(c("64kbit"), MIN_CHUNK);
    }

    #[test]
    fn a_round_trip_takes_at_least_twice_the_delay() {
        let delay = Duration::from_millis(20);
        let (echo, server) = echo_server(1);
        let spec = LinkSpec { delay, rate: None };
        let proxy = LinkProxy::start(loopback(), echo, spec).expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).expect("connect");
        s.set_nodelay(true).expect("nodelay");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        for i in 0..5u8 {
            let t = Instant::now();
            s.write_all(&[i; 4]).expect("write");
            let mut got = [0u8; 4];
            s.read_exact(&mut got).expect("read");
            let rtt = t.elapsed();
            assert_eq!(got, [i; 4]);
            assert!(
                rtt >= 2 * delay,
                "round trip {i} took {rtt:?}, under 2 x {delay:?}"
            );
        }
        // A close travels through: the echo server sees EOF and closes, and
        // so do we.
        s.shutdown(Shutdown::Write).expect("shutdown");
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).expect("EOF");
        assert!(rest.is_empty());
        server.join().expect("echo server");
        assert_eq!(proxy.connections(), 1);
    }

    #[test]
    fn a_bulk_transfer_is_no_faster_than_the_rate_and_keeps_byte_order() {
        // 8 Mbit/s = 1 MB/s: 400 KB take at least 0.4 s.
        let rate = 1e6;
        let len = 400_000usize;
        let sink = TcpListener::bind(loopback()).expect("bind");
        let sink_addr = sink.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            // Reads everything, checks the order, answers with the count.
            let (mut s, _) = sink.accept().expect("accept");
            let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
            let mut all = Vec::new();
            s.read_to_end(&mut all).expect("read");
            let in_order = all.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8);
            s.write_all(&(all.len() as u64).to_le_bytes())
                .expect("answer");
            s.write_all(&[u8::from(in_order)]).expect("answer");
        });
        let spec = LinkSpec::parse("8mbit").expect("spec");
        assert_eq!(spec.rate, Some(rate));
        let proxy = LinkProxy::start(loopback(), sink_addr, spec).expect("proxy");
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let t = Instant::now();
        let mut s = TcpStream::connect(proxy.addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        s.write_all(&data).expect("write");
        s.shutdown(Shutdown::Write).expect("shutdown");
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).expect("answer");
        let took = t.elapsed();
        server.join().expect("sink");
        assert_eq!(answer.len(), 9);
        let mut n = [0u8; 8];
        n.copy_from_slice(&answer[..8]);
        assert_eq!(u64::from_le_bytes(n), len as u64);
        assert_eq!(answer[8], 1, "bytes out of order");
        let floor = Duration::from_secs_f64(len as f64 / rate);
        assert!(
            took >= floor,
            "{len} bytes took {took:?}, faster than {rate} B/s allows ({floor:?})"
        );
    }

    #[test]
    fn reading_goes_on_while_chunks_wait_out_their_delay() {
        // With a long delay, writes made in quick succession are all read
        // (and queued) before the first is released: the delay does not
        // hold back reading, so it does not limit throughput.
        let (echo, server) = echo_server(1);
        let spec = LinkSpec {
            delay: Duration::from_millis(300),
            rate: None,
        };
        let proxy = LinkProxy::start(loopback(), echo, spec).expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).expect("connect");
        s.set_nodelay(true).expect("nodelay");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut sent = Vec::new();
        for i in 0..20u8 {
            let chunk = [i; 1000];
            s.write_all(&chunk).expect("write");
            sent.extend_from_slice(&chunk);
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut got = vec![0u8; sent.len()];
        s.read_exact(&mut got).expect("read back");
        assert!(got == sent, "echoed bytes differ");
        assert!(
            proxy.max_queued() >= 2,
            "only {} chunk(s) queued at once",
            proxy.max_queued()
        );
        drop(s);
        server.join().expect("echo server");
    }

    /// A measurement, not a check (`cargo test -p epserve-tools --lib
    /// link_throughput -- --ignored --nocapture`): MB/s through a 500 µs,
    /// 10 Gbit link, one way, 256 MiB.
    #[test]
    #[ignore]
    fn link_throughput() {
        let sink = TcpListener::bind(loopback()).expect("bind");
        let sink_addr = sink.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            let (mut s, _) = sink.accept().expect("accept");
            let mut buf = vec![0u8; 1 << 16];
            let mut n = 0usize;
            while let Ok(k) = s.read(&mut buf) {
                if k == 0 {
                    break;
                }
                n += k;
            }
            n
        });
        let proxy = LinkProxy::start(
            loopback(),
            sink_addr,
            LinkSpec::parse("500us,10gbit").expect("spec"),
        )
        .expect("proxy");
        let block = vec![7u8; 1 << 20];
        let t = Instant::now();
        let mut s = TcpStream::connect(proxy.addr()).expect("connect");
        for _ in 0..256 {
            s.write_all(&block).expect("write");
        }
        s.shutdown(Shutdown::Write).expect("shutdown");
        let n = server.join().expect("sink");
        let secs = t.elapsed().as_secs_f64();
        println!(
            "{n} bytes in {secs:.3} s: {:.0} MB/s through a 500 us, 10 Gbit link (max {} chunks queued)",
            n as f64 / secs / 1e6,
            proxy.max_queued()
        );
    }

    #[test]
    fn an_unreachable_upstream_closes_the_client_and_drop_cuts_connections() {
        // A port nothing listens on (bound, then released).
        let dead = TcpListener::bind(loopback())
            .expect("bind")
            .local_addr()
            .expect("addr");
        let proxy = LinkProxy::start(loopback(), dead, LinkSpec::parse("1ms").expect("spec"))
            .expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut buf = [0u8; 1];
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));

        let (echo, server) = echo_server(1);
        let proxy = LinkProxy::start(loopback(), echo, LinkSpec::parse("1ms").expect("spec"))
            .expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        s.write_all(b"x").expect("write");
        s.read_exact(&mut buf).expect("echo");
        drop(proxy);
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));
        server.join().expect("echo server");
    }

    #[test]
    fn a_connection_waits_for_an_upstream_set_later() {
        let (echo, server) = echo_server(1);
        let proxy = LinkProxy::start_pending(loopback(), LinkSpec::parse("1ms").expect("spec"))
            .expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        s.write_all(b"y").expect("write");
        std::thread::sleep(Duration::from_millis(200));
        proxy.set_upstream(echo);
        let mut buf = [0u8; 1];
        s.read_exact(&mut buf).expect("echo");
        assert_eq!(&buf, b"y");
        drop(proxy);
        server.join().expect("echo server");

        // A proxy dropped while a connection waits for its upstream stops
        // at once, not after the wait.
        let proxy = LinkProxy::start_pending(loopback(), LinkSpec::parse("1ms").expect("spec"))
            .expect("proxy");
        let _s = TcpStream::connect(proxy.addr()).expect("connect");
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        drop(proxy);
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }
}
