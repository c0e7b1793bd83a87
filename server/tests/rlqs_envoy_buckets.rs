//! What slicelimit's RLQS bound assumes of Envoy's token buckets, checked
//! against a real Envoy with a scripted quota server: a bucket that
//! replaces another of the same size starts no fuller than the one it
//! replaces (Envoy 1.40 fills a replacement in proportion to how full
//! the bucket before it was; a fresh bucket, the first, starts full).

use slicelimit_sim::envoy;

use std::time::Duration;

use envoy::Envoy;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};
use futures_util::stream::BoxStream;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

/// Sends its script, (ms after the first report, tokens per second,
/// bucket size), to the first Envoy that reports.
struct Scripted(Vec<(u64, u32, u32)>);

fn token_bucket(per_second: u32, size: u32) -> Action {
    Action::QuotaAssignmentAction(QuotaAssignmentAction {
        assignment_time_to_live: Some(ProtoDuration {
            seconds: 3600,
            nanos: 0,
        }),
        rate_limit_strategy: Some(RateLimitStrategy {
            strategy: Some(Strategy::TokenBucket(TokenBucket {
                max_tokens: size,
                tokens_per_fill: Some(UInt32Value { value: per_second }),
                fill_interval: Some(ProtoDuration {
                    seconds: 1,
                    nanos: 0,
                }),
            })),
        }),
    })
}

#[tonic::async_trait]
impl RateLimitQuotaService for Scripted {
    type StreamRateLimitQuotasStream = BoxStream<'static, Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let script = self.0.clone();
        tokio::spawn(async move {
            let Ok(Some(first)) = inbound.message().await else {
                return;
            };
            let id = first.bucket_quota_usages[0].bucket_id.clone();
            let start = tokio::time::Instant::now();
            for (at, per_second, size) in script {
                tokio::time::sleep_until(start + Duration::from_millis(at)).await;
                let action = BucketAction {
                    bucket_id: id.clone(),
                    bucket_action: Some(token_bucket(per_second, size)),
                };
                let message = RateLimitQuotaResponse {
                    bucket_action: vec![action],
                };
                if tx.send(Ok(message)).await.is_err() {
                    return;
                }
            }
            while let Ok(Some(_)) = inbound.message().await {}
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

#[test]
fn a_replacement_bucket_starts_no_fuller_than_the_one_it_replaces() {
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    // 1 a second in 4, drained at 1 s; at 1.5 s, 3 a second in 4 (faster,
    // the same size); at 5 s, when that is full, 1 a second in 4 again.
    let script = vec![(0, 1, 4), (1_500, 3, 4), (5_000, 1, 4)];
    let service = RateLimitQuotaServiceServer::new(Scripted(script));
    let addr = format!("127.0.0.1:{port}").parse().expect("an address");
    runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve(addr),
    );
    std::thread::sleep(Duration::from_millis(300));
    let envoy = Envoy::start_rlqs(&[port]);
    let burst = || (0..10).filter(|_| envoy.get("probe").status == 200).count();
    // The first request reports the bucket and passes (no assignment yet:
    // ALLOW_ALL); the first bucket starts full.
    assert_eq!(envoy.get("probe").status, 200);
    std::thread::sleep(Duration::from_millis(1_000));
    let first = burst();
    assert!(
        (4..=5).contains(&first),
        "a fresh bucket of 4 admitted {first}"
    );
    // Replaced half a second after it was drained: a fresh bucket would
    // admit 4 at once; one filled in proportion holds well under 2.
    std::thread::sleep(Duration::from_millis(700));
    let replaced = burst();
    assert!(
        replaced <= 2,
        "a replacement of a drained bucket admitted {replaced}"
    );
    // Full again, replaced by a slower one of the same size: it admits
    // what the full bucket held, not more.
    std::thread::sleep(Duration::from_millis(3_500));
    let full = burst();
    assert!(
        (3..=5).contains(&full),
        "a replacement of a full bucket admitted {full}"
    );
}
