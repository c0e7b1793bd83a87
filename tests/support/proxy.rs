//! A TCP proxy in front of a test server that can blackhole the
//! connections it already carries while it keeps accepting new ones — a
//! backend gone silent behind a load balancer, a half-open TCP connection.
//! It can also delay every byte by a fixed time each way, to stand in for
//! a network round trip on loopback.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Duration, Instant};

pub struct Proxy {
    port: u16,
    /// Connections with a generation below this are blackholed.
    cutoff: Arc<AtomicU64>,
    generation: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    /// Starts forwarding 127.0.0.1:<free port> to 127.0.0.1:`upstream`.
    pub async fn start(upstream: u16) -> Proxy {
        Proxy::start_delayed(upstream, Duration::ZERO).await
    }

    /// As [`start`](Proxy::start), every byte delivered `one_way` after it
    /// arrived, in order (a round trip of twice `one_way`).
    pub async fn start_delayed(upstream: u16, one_way: Duration) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().unwrap().port();
        let cutoff = Arc::new(AtomicU64::new(0));
        let generation = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, g, st) = (cutoff.clone(), generation.clone(), stop.clone());
        tokio::spawn(async move {
            while !st.load(Ordering::Relaxed) {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let id = g.fetch_add(1, Ordering::Relaxed);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, id, c.clone(), one_way));
                tokio::spawn(pipe(sr, cw, id, c.clone(), one_way));
            }
        });
        Proxy {
            port,
            cutoff,
            generation,
            stop,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Every connection open now stops carrying bytes, silently, in both
    /// directions; new connections are forwarded as before.
    pub fn blackhole_existing(&self) {
        self.cutoff
            .store(self.generation.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    id: u64,
    cutoff: Arc<AtomicU64>,
    delay: Duration,
) {
    // Reads are stamped and handed to a writer that sends each chunk at
    // its time, so a delay holds back bytes without holding back reads.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, bytes)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if id < cutoff.load(Ordering::Relaxed) {
            // Blackholed: swallow, keep the socket open, answer nothing.
            continue;
        }
        if tx
            .send((Instant::now() + delay, buf[..n].to_vec()))
            .is_err()
        {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}
