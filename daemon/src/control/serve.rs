//! Serving the control API's connections with bounds a client cannot hold open: at most
//! [`MAX_CONNECTIONS`] at once (one more is closed at once, and counted), and a request's
//! headers must arrive within [`HEADER_READ_TIMEOUT`] (a client that sends them a byte at a
//! time, or opens connections and sends nothing, gives its slot back). `axum::serve` has
//! neither bound, so connections are accepted here and handed to hyper's HTTP/1 server.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};

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

/// Serves `router` on `listener` until `stop` fires (or its sender is dropped). Connections
/// under way are served to their end on their own tasks.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    mut stop: oneshot::Receiver<()>,
    refused: Arc<Refused>,
    limits: Limits,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let stream = tokio::select! {
            _ = &mut stop => return,
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
                    "control API: {n} connections closed at once, {} being open",
                    limits.max_connections
                );
            }
            continue;
        };
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!("control API connection: {e}");
            }
            drop(slot);
        });
    }
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
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop_tx, stop_rx) = oneshot::channel();
        let refused = Arc::new(Refused::default());
        let router = Router::new().route("/", get(|| async { "ok" }));
        tokio::spawn(serve(listener, router, stop_rx, refused.clone(), LIMITS));
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

    /// Clients that open connections and send nothing take every slot: one more is closed
    /// at once and counted, and once the silent ones are dropped the API answers again.
    #[tokio::test]
    async fn connections_beyond_the_cap_are_closed_and_slots_come_back() {
        let (addr, _stop, refused) = started().await;
        let mut silent = Vec::new();
        for _ in 0..LIMITS.max_connections {
            silent.push(TcpStream::connect(addr).await.expect("connect"));
        }
        // Let the server accept them all.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let reply = get_root(addr).await.unwrap_or_default();
        assert!(!reply.contains("ok"), "served beyond the cap: {reply}");
        assert_eq!(refused.count(), 1);
        drop(silent);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let reply = get_root(addr).await.expect("served");
        assert!(
            reply.starts_with("HTTP/1.1 200") && reply.ends_with("ok"),
            "{reply}"
        );
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
