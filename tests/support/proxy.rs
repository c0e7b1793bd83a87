//! A TCP proxy in front of a test server that can blackhole the
//! connections it already carries while it keeps accepting new ones — a
//! backend gone silent behind a load balancer, a half-open TCP connection.
//! It can also delay every byte, by a fixed time each way plus a random
//! jitter, to stand in for a network round trip on loopback: bytes keep
//! their order on each connection (TCP does not reorder), so a chunk is
//! never delivered before the one read ahead of it.

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
        Proxy::start_with(upstream, Delay::fixed(one_way), Delay::fixed(one_way)).await
    }

    /// As [`start`](Proxy::start), bytes to the server delayed by `up`
    /// and bytes back by `down`.
    pub async fn start_with(upstream: u16, up: Delay, down: Delay) -> Proxy {
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
                // Each delayed chunk is written on its own: Nagle's algorithm
                // would hold it back until the last one was acknowledged.
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let id = g.fetch_add(1, Ordering::Relaxed);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, id, c.clone(), up));
                tokio::spawn(pipe(sr, cw, id, c.clone(), down));
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

/// One direction's delay: `fixed` plus a uniformly drawn part of up to
/// `jitter`, per chunk read.
#[derive(Debug, Clone, Copy)]
pub struct Delay {
    pub fixed: Duration,
    pub jitter: Duration,
}

impl Delay {
    pub fn fixed(fixed: Duration) -> Delay {
        Delay {
            fixed,
            jitter: Duration::ZERO,
        }
    }

    pub fn jittered(fixed: Duration, jitter: Duration) -> Delay {
        Delay { fixed, jitter }
    }
}

/// A uniform draw in `[0, max]` (xorshift, seeded per connection).
fn draw(state: &mut u64, max: Duration) -> Duration {
    if max.is_zero() {
        return Duration::ZERO;
    }
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    let nanos = max.as_nanos().min(u128::from(u64::MAX)) as u64;
    Duration::from_nanos(*state % (nanos + 1))
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    id: u64,
    cutoff: Arc<AtomicU64>,
    delay: Delay,
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
    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ (id + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    // In order: a chunk is never due before the one ahead of it.
    let mut last_due = Instant::now();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if id < cutoff.load(Ordering::Relaxed) {
            // Blackholed: swallow, keep the socket open, answer nothing.
            continue;
        }
        let due = (Instant::now() + delay.fixed + draw(&mut seed, delay.jitter)).max(last_due);
        last_due = due;
        if tx.send((due, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}
