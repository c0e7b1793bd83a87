//! An LLM gateway's token budget: an axum service in front of a fake model
//! that streams tokens, limited per tenant in tokens per minute by
//! slicelimit-tower's `CostLayer`. Each request reserves its prompt's
//! tokens plus its `max_tokens` (denied with 429 and `Retry-After` when
//! the tenant's budget cannot hold it); the response is charged its
//! prompt's tokens and one token per streamed frame, and settles when the
//! stream ends, or when the client goes away (it pays for what was sent).
//!
//! ```text
//! cargo run --release -p slicelimit-examples --features gateway --example llm_gateway
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --release -p slicelimit-examples --features gateway --example llm_gateway
//! ```
//!
//! It starts the gateway on a free port, then plays a tenant against it:
//! completions until the budget says no, and one client that hangs up
//! mid-answer.

use std::net::SocketAddr;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use slicelimit::{nonzero, HybridConfig, Limiter, MemoryStore, Quota, RedisStore, Store};
use slicelimit_tower::{CostLayer, KeyExtractor, RequestView};

/// Tokens per tenant per minute.
const BUDGET: u32 = 2_000;

/// A number in a request header.
fn header(request: &RequestView<'_>, name: &str) -> Option<u64> {
    request
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// The prompt's tokens: about four bytes each.
fn prompt_tokens(request: &RequestView<'_>) -> u64 {
    header(request, "content-length").unwrap_or(0) / 4
}

/// The estimate: the prompt's tokens plus the `max-tokens` the client
/// asks for (256 if it does not say).
fn estimate(request: &RequestView<'_>) -> u64 {
    prompt_tokens(request) + header(request, "max-tokens").unwrap_or(256)
}

/// The fake model: answers with `max-tokens` words at most (fewer when the
/// prompt asks for "short"), one frame per word, 5 ms apart.
async fn complete(headers: axum::http::HeaderMap, prompt: String) -> axum::body::Body {
    let max: u64 = headers
        .get("max-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let words = if prompt.contains("short") {
        max / 4
    } else {
        max
    };
    let stream = futures_util::stream::unfold(0u64, move |n| async move {
        if n == words {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        Some((
            Ok::<_, std::io::Error>(Bytes::from(format!("tok{n} "))),
            n + 1,
        ))
    });
    axum::body::Body::from_stream(stream)
}

async fn gateway(limiter: Limiter) -> SocketAddr {
    // The prompt's tokens, then one per streamed word.
    let layer = CostLayer::new(limiter, KeyExtractor::header("x-tenant"), estimate)
        .base_cost(prompt_tokens)
        .per_frame(|_frame| 1);
    let app = Router::new()
        .route("/v1/completions", post(complete))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serves") });
    addr
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store: Store = match std::env::var("REDIS_URL") {
        Ok(url) => RedisStore::connect(&url).await?.into(),
        Err(_) => MemoryStore::new().into(),
    };
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(BUDGET)))
        .store(store)
        .namespace(&format!("llm-gateway-{}", std::process::id()))
        .hybrid(HybridConfig::strict())
        .build()?;
    let addr = gateway(limiter.clone()).await;
    println!("gateway on http://{addr}: {BUDGET} tokens per tenant per minute");

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let ask = |tenant: &str, prompt: &'static str, max_tokens: u64| {
        let request = axum::http::Request::post(format!("http://{addr}/v1/completions"))
            .header("x-tenant", tenant)
            .header("max-tokens", max_tokens.to_string())
            .header("content-length", prompt.len().to_string())
            .body(Full::new(Bytes::from_static(prompt.as_bytes())))
            .expect("a request");
        client.request(request)
    };
    // Completions of up to 300 tokens until the budget says no.
    for i in 1.. {
        let response = ask("acme", "write something short about rate limits", 300).await?;
        let status = response.status();
        if !status.is_success() {
            let retry = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("?")
                .to_owned();
            println!("request {i}: {status}, retry after {retry} s");
            break;
        }
        let body = response.into_body().collect().await?.to_bytes();
        let tokens = body.split(|&b| b == b' ').filter(|w| !w.is_empty()).count();
        // The settlement runs as the body ends.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let left = limiter.check("acme", 0).await.remaining();
        println!("request {i}: 200, {tokens} tokens streamed, {left} left this minute");
    }
    // Another tenant asks for a long answer and hangs up after 20 tokens.
    let response = ask("globex", "write at length", 1_000).await?;
    let mut body = response.into_body();
    let mut read = 0;
    while read < 20 {
        if let Some(frame) = body.frame().await {
            read += frame?.data_ref().map_or(0, |d| {
                d.split(|&b| b == b' ').filter(|w| !w.is_empty()).count()
            });
        }
    }
    drop(body);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let left = limiter.check("globex", 0).await.remaining();
    println!(
        "globex hung up after {read} tokens of 1,000: charged {} with its prompt's (the rest of its reservation went back)",
        u64::from(BUDGET) - left
    );
    limiter.shutdown().await;
    Ok(())
}
