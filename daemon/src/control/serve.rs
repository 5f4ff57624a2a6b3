//! Serving the control API's connections with bounds a client cannot hold open: at most
//! [`MAX_CONNECTIONS`] at once (one more is closed at once, told 503 where its socket takes
//! it, and counted),
//! and a request's headers must arrive within [`HEADER_READ_TIMEOUT`], the first and each
//! next one on a kept-alive connection (a client that sends them a byte at a time, or opens
//! connections and sends nothing, gives its slot back after that). `axum::serve` has neither
//! bound, so connections are accepted here and handed to hyper's HTTP/1 server. At stop each
//! connection finishes the request under way and closes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch, Semaphore};
use tokio::task::JoinSet;

/// Connections served at once: the CLI, a browser page or two and a scraper need a few.
pub const MAX_CONNECTIONS: usize = 64;

/// How long a request's headers may take to arrive, and a kept-alive connection may wait for
/// its next request.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The bounds a server keeps: [`MAX_CONNECTIONS`] and [`HEADER_READ_TIMEOUT`] but in tests.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once.
    pub max_connections: usize,
    /// How long a request's headers may take.
    pub header_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: MAX_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
        }
    }
}

/// Connections closed because [`MAX_CONNECTIONS`] were open.
#[derive(Debug, Default)]
pub struct Refused(AtomicU64);

impl Refused {
    /// How many so far.
    pub fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a connection beyond the cap is told before it is closed.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n\
Content-Length: 40\r\nConnection: close\r\n\r\ntoo many connections to the control API\r\n";

/// Serves `router` on `listener` until `stop` fires (or its sender is dropped); then every
/// open connection finishes the request under way and closes, and this returns when all
/// have (the caller bounds how long it waits).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    mut stop: oneshot::Receiver<()>,
    refused: Arc<Refused>,
    limits: Limits,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let (closing_tx, closing_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    loop {
        let stream = tokio::select! {
            _ = &mut stop => break,
            // Finished connections' tasks are reaped as they end.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!("control API: cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            let n = refused.0.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(
                    "control API: {n} connections refused, {} being open",
                    limits.max_connections
                );
            }
            // Told why, if its socket takes the few bytes at once; never waited on.
            let _ = stream.try_write(BUSY);
            continue;
        };
        let service = TowerToHyperService::new(router.clone());
        let mut closing = closing_rx.clone();
        connections.spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                () = async {
                    // The guard the wait answers is dropped here, not held across the close.
                    let _ = closing.wait_for(|closing| *closing).await;
                } => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = served {
                tracing::debug!("control API connection: {e}");
            }
            drop(slot);
        });
    }
    let _ = closing_tx.send(true);
    while connections.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Small bounds, so that the tests neither open 64 connections nor wait 10 s.
    const LIMITS: Limits = Limits {
        max_connections: 4,
        header_read_timeout: Duration::from_millis(300),
    };

    async fn started() -> (std::net::SocketAddr, oneshot::Sender<()>, Arc<Refused>) {
        started_with(LIMITS).await
    }

    async fn started_with(
        limits: Limits,
    ) -> (std::net::SocketAddr, oneshot::Sender<()>, Arc<Refused>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop_tx, stop_rx) = oneshot::channel();
        let refused = Arc::new(Refused::default());
        let router = Router::new().route("/", get(|| async { "ok" }));
        tokio::spawn(serve(listener, router, stop_rx, refused.clone(), limits));
        (addr, stop_tx, refused)
    }

    async fn get_root(addr: std::net::SocketAddr) -> Option<String> {
        let mut c = TcpStream::connect(addr).await.ok()?;
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut reply = String::new();
        c.read_to_string(&mut reply).await.ok()?;
        Some(reply)
    }

    /// Clients that open connections and send nothing take every slot: one more is closed at
    /// once (told 503 where the close does not reset it) and counted; once the silent ones are dropped the API answers
    /// again. (A long header timeout here, so that the silent ones keep their slots however
    /// loaded the box.)
    #[tokio::test]
    async fn connections_beyond_the_cap_are_closed_and_slots_come_back() {
        let (addr, _stop, refused) = started_with(Limits {
            header_read_timeout: Duration::from_secs(60),
            ..LIMITS
        })
        .await;
        let mut silent = Vec::new();
        for _ in 0..LIMITS.max_connections {
            silent.push(TcpStream::connect(addr).await.expect("connect"));
        }
        // Let the server accept them all.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let reply = get_root(addr).await.unwrap_or_default();
        // Told 503, or reset where its request came in before the close: never served.
        assert!(
            reply.is_empty() || reply.starts_with("HTTP/1.1 503"),
            "served beyond the cap: {reply}"
        );
        assert_eq!(refused.count(), 1);
        drop(silent);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let reply = get_root(addr).await.expect("served");
        assert!(
            reply.starts_with("HTTP/1.1 200") && reply.ends_with("ok"),
            "{reply}"
        );
    }

    /// At stop the server returns once its open connections have closed: a kept-alive one
    /// is closed rather than left serving a stopped node.
    #[tokio::test]
    async fn at_stop_kept_alive_connections_close_and_the_server_returns() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop_tx, stop_rx) = oneshot::channel();
        let router = Router::new().route("/", get(|| async { "ok" }));
        let server = tokio::spawn(serve(
            listener,
            router,
            stop_rx,
            Arc::default(),
            Limits {
                header_read_timeout: Duration::from_secs(60),
                ..LIMITS
            },
        ));
        let mut kept = TcpStream::connect(addr).await.expect("connect");
        kept.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let mut first = [0u8; 256];
        let n = kept.read(&mut first).await.expect("read");
        assert!(first[..n].starts_with(b"HTTP/1.1 200"));
        let _ = stop_tx.send(());
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the server returned")
            .expect("joined");
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(5), kept.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "the kept-alive connection is still open");
    }

    /// A client that sends half its headers and then nothing is cut off once the header
    /// timeout has passed, and its slot comes back.
    #[tokio::test]
    async fn a_client_that_stops_sending_its_headers_is_cut_off() {
        let (addr, _stop, refused) = started().await;
        let mut stalled = Vec::new();
        for _ in 0..LIMITS.max_connections {
            let mut c = TcpStream::connect(addr).await.expect("connect");
            c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("write");
            stalled.push(c);
        }
        let wait = LIMITS.header_read_timeout * 10;
        for c in &mut stalled {
            let mut buf = Vec::new();
            let read = tokio::time::timeout(wait, c.read_to_end(&mut buf)).await;
            assert!(
                read.is_ok(),
                "a stalled connection still open after {wait:?}"
            );
        }
        let reply = get_root(addr).await.expect("served");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert_eq!(refused.count(), 0);
    }
}
