//! The tower layer in front of a real tonic server (the standard gRPC
//! health service), called by a real tonic client: denials arrive as
//! `RESOURCE_EXHAUSTED` (trailers-only, `grpc-status: 8`), not as an
//! HTTP 429 the client would report as `UNAVAILABLE`, and the client's
//! address comes from tonic's `TcpConnectInfo`.

use slicelimit_sim as support;

use std::net::SocketAddr;
use std::time::Duration;

use slicelimit::{FailurePolicy, Limiter};
use slicelimit_tower::{KeyExtractor, RateLimitLayer};
use support::http::{per_minute, sf_items, unavailable};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

async fn serve(layer: RateLimitLayer) -> SocketAddr {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    tokio::spawn(async move {
        // Keep the reporter alive as long as the server.
        let _reporter = reporter;
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(incoming)
            .await
            .unwrap()
    });
    addr
}

async fn client(addr: SocketAddr) -> HealthClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

async fn check(client: &mut HealthClient<Channel>) -> Result<(), tonic::Status> {
    client
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|_| ())
}

/// Half a minute into a window: time enough for every call of a test.
fn limiter(limit: u32) -> Limiter {
    per_minute(limit, Duration::from_secs(30), None)
}

/// The names of a Structured-Field list in the status' metadata.
fn policy_names(status: &tonic::Status, name: &str) -> Vec<String> {
    let values = status
        .metadata()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap());
    sf_items(name, values)
        .into_iter()
        .map(|(policy, _)| policy)
        .collect()
}

#[tokio::test]
async fn a_grpc_client_over_its_quota_sees_resource_exhausted() {
    // Keyed by the peer address tonic records: no closure needed.
    let layer = RateLimitLayer::new(limiter(2))
        .policy_name("health")
        .key(KeyExtractor::client_ip());
    let addr = serve(layer).await;
    let mut client = client(addr).await;
    check(&mut client).await.expect("first call admitted");
    check(&mut client).await.expect("second call admitted");
    let status = check(&mut client).await.expect_err("third call denied");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("health"), "{status:?}");
    assert_eq!(policy_names(&status, "ratelimit"), ["health"]);
    assert_eq!(policy_names(&status, "ratelimit-policy"), ["health"]);
}

#[tokio::test]
async fn a_grpc_client_without_a_key_is_unauthenticated() {
    let addr = serve(RateLimitLayer::new(limiter(2))).await;
    let status = check(&mut client(addr).await).await.expect_err("no key");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
}

#[tokio::test]
async fn a_grpc_client_of_a_fail_closed_limiter_sees_unavailable() {
    let limiter = unavailable(FailurePolicy::FailClosed);
    let layer = RateLimitLayer::new(limiter).key(KeyExtractor::client_ip());
    let addr = serve(layer).await;
    let status = check(&mut client(addr).await)
        .await
        .expect_err("fail closed");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
}
