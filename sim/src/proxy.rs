//! A TCP proxy in front of a test server that can blackhole the
//! connections it already carries while it keeps accepting new ones — a
//! backend gone silent behind a load balancer, a half-open TCP connection.
//! It can also delay every byte, by a fixed time each way plus a random
//! jitter, to stand in for a network round trip on loopback: bytes keep
//! their order on each connection (TCP does not reorder), so a chunk is
//! never delivered before the one read ahead of it.
//!
//! Each direction of each connection is a reader thread and a writer
//! thread, with blocking sockets: a thread's sleep keeps a delay to tens
//! of microseconds, where an async runtime's timer rounds it up to the next
//! millisecond (a 0.5 ms round trip came out at 2.4 ms).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Proxy {
    port: u16,
    /// Connections with a generation below this are blackholed.
    cutoff: Arc<AtomicU64>,
    generation: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    /// Starts forwarding `127.0.0.1:<free port>` to 127.0.0.1:`upstream`.
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
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().unwrap().port();
        let cutoff = Arc::new(AtomicU64::new(0));
        let generation = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, g, st) = (cutoff.clone(), generation.clone(), stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else {
                    continue;
                };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                // Each delayed chunk is written on its own: Nagle's
                // algorithm would hold it back until the last one was
                // acknowledged.
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let id = g.fetch_add(1, Ordering::Relaxed);
                let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
                    continue;
                };
                pipe(client, server, id, c.clone(), up);
                pipe(server2, client2, id, c.clone(), down);
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
        // Wakes the accepting thread, which then sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
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

/// Forwards `from` to `to`: a reader stamps each chunk with its due time
/// and a writer sends it then, so a delay holds back bytes without
/// holding back reads.
fn pipe(mut from: TcpStream, mut to: TcpStream, id: u64, cutoff: Arc<AtomicU64>, delay: Delay) {
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        for (at, bytes) in rx {
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            if to.write_all(&bytes).is_err() {
                return;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 16 * 1024];
        let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ (id + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
        // In order: a chunk is never due before the one ahead of it.
        let mut last_due = Instant::now();
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if id < cutoff.load(Ordering::Relaxed) {
                // Blackholed: swallow, keep the socket open, answer nothing.
                continue;
            }
            let due = (Instant::now() + delay.fixed + draw(&mut seed, delay.jitter)).max(last_due);
            last_due = due;
            if tx.send((due, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    });
}
