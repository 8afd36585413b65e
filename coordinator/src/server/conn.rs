//! The OpenAI server's connection layer: an accept loop over hyper-util's
//! auto (HTTP/1.1 + h2) connection builder, optionally behind TLS, with
//!
//! - a header read timeout (HTTP/1.1 request heads, and the TLS handshake
//!   plus the first request of every connection),
//! - an idle timeout: a connection with no request in flight and no bytes
//!   moving for that long is closed (keep-alive connections, h2 without
//!   streams, clients that connect and say nothing),
//! - a cap on open connections: at the cap the longest-idle connection is
//!   closed to make room; when every connection is busy the new one is
//!   answered 503 (plaintext) or closed, and the existing ones keep working,
//! - graceful shutdown with a bounded drain: on the signal the listener
//!   closes, idle connections close, in-flight requests get
//!   `shutdown_timeout` to finish, then the rest are dropped.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, watch};
use tower::ServiceExt;

use super::tls::{Tls, TlsFiles};

/// Connection-level settings (`epserve serve --http-*`, `--max-connections`,
/// `--api-tls-*`).
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// A request head (and a TLS handshake) must arrive within this.
    pub header_timeout: Duration,
    /// Connections with nothing in flight and no traffic for this long close.
    pub idle_timeout: Duration,
    /// Most open connections.
    pub max_connections: usize,
    /// How long in-flight requests get to finish after the shutdown signal.
    pub shutdown_timeout: Duration,
    /// HTTPS certificate and key, if any.
    pub tls: Option<TlsFiles>,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 1024,
            shutdown_timeout: Duration::from_secs(30),
            tls: None,
        }
    }
}

/// Milliseconds since the first call (a process-wide monotonic clock).
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// What the accept loop and the connection's own task share.
struct ConnState {
    opened_ms: u64,
    /// Last time bytes were read or written.
    last_ms: AtomicU64,
    /// Requests whose response body has not been dropped yet.
    active: AtomicUsize,
    /// Requests started on this connection.
    requests: AtomicU64,
    /// Asked to close (evicted to make room); set once.
    closing: AtomicBool,
    close: Notify,
}

impl ConnState {
    fn new() -> Self {
        let t = now_ms();
        ConnState {
            opened_ms: t,
            last_ms: AtomicU64::new(t),
            active: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            close: Notify::new(),
        }
    }
    fn touch(&self) {
        self.last_ms.store(now_ms(), Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Registry {
    next: AtomicU64,
    map: Mutex<HashMap<u64, Arc<ConnState>>>,
    empty: Notify,
}

impl Registry {
    fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }
    fn add(&self, st: Arc<ConnState>) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut m) = self.map.lock() {
            m.insert(id, st);
            metrics::gauge!("epserve_http_connections").set(m.len() as f64);
        }
        id
    }
    fn remove(&self, id: u64) {
        if let Ok(mut m) = self.map.lock() {
            m.remove(&id);
            metrics::gauge!("epserve_http_connections").set(m.len() as f64);
            if m.is_empty() {
                self.empty.notify_waiters();
            }
        }
    }
    /// Asks the connection idle the longest to close; false when all are busy.
    fn evict_idle(&self) -> bool {
        let Ok(m) = self.map.lock() else { return false };
        let victim = m
            .values()
            .filter(|c| c.active.load(Ordering::Relaxed) == 0 && !c.closing.load(Ordering::Relaxed))
            .min_by_key(|c| c.last_ms.load(Ordering::Relaxed));
        match victim {
            Some(c) => {
                c.closing.store(true, Ordering::Relaxed);
                c.close.notify_one();
                true
            }
            None => false,
        }
    }
    fn closing(&self) -> usize {
        self.map
            .lock()
            .map(|m| {
                m.values()
                    .filter(|c| c.closing.load(Ordering::Relaxed))
                    .count()
            })
            .unwrap_or(0)
    }
}

/// Removes the connection from the registry when its task ends.
struct Registered(Arc<Registry>, u64);

impl Drop for Registered {
    fn drop(&mut self) {
        self.0.remove(self.1);
    }
}

/// The socket (plain or TLS), noting when bytes move.
enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

struct Tracked {
    io: Io,
    st: Arc<ConnState>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        };
        if buf.filled().len() > before {
            this.st.touch();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, data),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, data),
        };
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.st.touch();
        }
        r
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        };
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.st.touch();
        }
        r
    }
    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A response body that holds a value (a request counter, a concurrency
/// permit) until the body is finished or dropped.
pub struct Guarded<G: Send + 'static> {
    inner: Body,
    _guard: G,
}

impl<G: Send + Unpin + 'static> Guarded<G> {
    pub fn wrap(inner: Body, guard: G) -> Body {
        Body::new(Guarded {
            inner,
            _guard: guard,
        })
    }
}

impl<G: Send + Unpin + 'static> http_body::Body for Guarded<G> {
    type Data = axum::body::Bytes;
    type Error = axum::Error;
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Counts a request as in flight on its connection until dropped.
struct Active(Arc<ConnState>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

/// Raises the soft open-files limit to the hard one (Linux/Unix), so the
/// connection cap rather than the descriptor table is what limits clients.
/// Returns the soft limit now in force.
#[allow(clippy::unnecessary_cast)] // rlim_t is not u64 everywhere
pub fn raise_nofile_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                return None;
            }
            if lim.rlim_cur < lim.rlim_max {
                let want = libc::rlimit {
                    rlim_cur: lim.rlim_max.min(1 << 20),
                    rlim_max: lim.rlim_max,
                };
                if want.rlim_cur > lim.rlim_cur && libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0
                {
                    lim.rlim_cur = want.rlim_cur;
                }
            }
        }
        Some(lim.rlim_cur as u64)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The default connection cap: 4096, or fewer when the open-files limit is
/// low (256 descriptors are kept for the model files, links and logs).
pub fn default_max_connections() -> usize {
    match raise_nofile_limit() {
        Some(n) => (n.saturating_sub(256) as usize).clamp(64, 4096),
        None => 1024,
    }
}

const REFUSED_BODY: &str = r#"{"error":{"message":"too many open connections; retry later","type":"server_overloaded","param":null,"code":null}}"#;

/// Serves `app` on `listener` until `shutdown` resolves, then drains.
pub async fn serve_connections<F>(
    listener: tokio::net::TcpListener,
    app: Router,
    opts: HttpOptions,
    shutdown: F,
) -> io::Result<()>
where
    F: std::future::Future<Output = ()> + Send,
{
    let tls = match &opts.tls {
        Some(files) => {
            Some(Arc::new(Tls::new(files.clone()).map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidInput, e)
            })?))
        }
        None => None,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    if let Some(t) = &tls {
        tokio::spawn(t.clone().watch(stop_rx.clone()));
    }
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_timeout)
        .max_buf_size(64 * 1024)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        // No h2 pings: they would count as traffic and keep idle
        // connections open forever; the idle watchdog closes those.
        .max_concurrent_streams(256);
    let builder = Arc::new(builder);
    let registry = Arc::new(Registry::default());
    let max = opts.max_connections.max(1);
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let open = registry.len();
        if open >= max {
            // Room is made by closing the longest-idle connection; when all
            // are busy (or enough are already closing) the newcomer is refused.
            let closing = registry.closing();
            if closing >= 64 || !registry.evict_idle() {
                metrics::counter!("epserve_http_connections_refused_total").increment(1);
                if tls.is_none() {
                    let msg = format!(
                        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{REFUSED_BODY}",
                        REFUSED_BODY.len()
                    );
                    let _ = tcp.try_write(msg.as_bytes());
                }
                drop(tcp);
                continue;
            }
        }
        let _ = tcp.set_nodelay(true);
        let st = Arc::new(ConnState::new());
        let reg = Registered(registry.clone(), registry.add(st.clone()));
        tokio::spawn(connection(
            tcp,
            peer,
            st,
            reg,
            tls.clone(),
            builder.clone(),
            app.clone(),
            opts.clone(),
            stop_rx.clone(),
        ));
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let n = registry.len();
    if n > 0 {
        tracing::info!(
            connections = n,
            "shutting down: draining in-flight requests (up to {:?})",
            opts.shutdown_timeout
        );
        let drained = tokio::time::timeout(opts.shutdown_timeout, async {
            loop {
                let notified = registry.empty.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if registry.len() == 0 {
                    break;
                }
                notified.await;
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                connections = registry.len(),
                "shutdown: drain timeout reached, closing the remaining connections"
            );
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    st: Arc<ConnState>,
    _reg: Registered,
    tls: Option<Arc<Tls>>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    app: Router,
    opts: HttpOptions,
    mut stop: watch::Receiver<bool>,
) {
    let io = match tls {
        Some(t) => match tokio::time::timeout(opts.header_timeout, t.acceptor.accept(tcp)).await {
            Ok(Ok(s)) => Io::Tls(Box::new(s)),
            Ok(Err(e)) => {
                tracing::debug!(%peer, "TLS handshake failed: {e}");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                return;
            }
        },
        None => Io::Plain(tcp),
    };
    let st2 = st.clone();
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        let st = st2.clone();
        let app = app.clone();
        async move {
            st.requests.fetch_add(1, Ordering::Relaxed);
            st.active.fetch_add(1, Ordering::Relaxed);
            let active = Active(st);
            req.extensions_mut().insert(ConnectInfo(peer));
            let resp = match app.oneshot(req.map(Body::new)).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            Ok::<_, Infallible>(resp.map(|b| Guarded::wrap(b, active)))
        }
    });
    let conn = builder.serve_connection(TokioIo::new(Tracked { io, st: st.clone() }), svc);
    tokio::pin!(conn);
    let idle_ms = opts.idle_timeout.as_millis() as u64;
    let header_ms = opts.header_timeout.as_millis() as u64;
    let tick = (opts.idle_timeout.min(opts.header_timeout) / 4)
        .clamp(Duration::from_millis(25), Duration::from_secs(5));
    let mut watchdog = tokio::time::interval(tick);
    watchdog.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Once graceful shutdown has been asked for, the connection gets this
    // long before it is dropped.
    let mut deadline: Option<tokio::time::Instant> = None;
    let mut shutting_down = *stop.borrow();
    if shutting_down {
        conn.as_mut().graceful_shutdown();
        deadline = Some(tokio::time::Instant::now() + opts.shutdown_timeout);
    }
    loop {
        let dl = deadline;
        let hard_stop = async move {
            match dl {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(%peer, "connection ended: {e}");
                }
                return;
            }
            _ = hard_stop => {
                tracing::debug!(%peer, "connection dropped after its close deadline");
                return;
            }
            _ = st.close.notified(), if deadline.is_none() => {
                conn.as_mut().graceful_shutdown();
                deadline = Some(tokio::time::Instant::now() + Duration::from_secs(1));
            }
            r = stop.changed(), if !shutting_down => {
                shutting_down = true;
                if r.is_ok() {
                    conn.as_mut().graceful_shutdown();
                    let d = tokio::time::Instant::now() + opts.shutdown_timeout;
                    deadline = Some(deadline.map_or(d, |x| x.min(d)));
                }
            }
            _ = watchdog.tick(), if deadline.is_none() => {
                if st.active.load(Ordering::Relaxed) > 0 {
                    continue;
                }
                let now = now_ms();
                let quiet = now.saturating_sub(st.last_ms.load(Ordering::Relaxed));
                let first_late = st.requests.load(Ordering::Relaxed) == 0
                    && now.saturating_sub(st.opened_ms) >= header_ms;
                if quiet >= idle_ms || first_late {
                    conn.as_mut().graceful_shutdown();
                    // Nothing is in flight: a short grace, then drop.
                    deadline = Some(tokio::time::Instant::now() + Duration::from_millis(500));
                }
            }
        }
    }
}
