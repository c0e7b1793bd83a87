//! The `StreamRateLimitQuotas` call: one stream per connected Envoy.

use std::sync::atomic::Ordering;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use futures_util::stream::BoxStream;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use super::Rlqs;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = BoxStream<'static, Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let mut inbound = request.into_inner();
        let envoy = self.inner.next_envoy.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(256);
        self.inner.lock().envoys.insert(envoy, tx);
        crate::stats::rlqs_streams(1.0);
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let mut domain = String::new();
            while let Ok(Some(message)) = inbound.message().await {
                crate::stats::rlqs_message("received");
                if domain.is_empty() {
                    domain = message.domain.clone();
                }
                inner.report(envoy, &domain, &message, std::time::Instant::now());
            }
            inner.leave(envoy, std::time::Instant::now());
            crate::stats::rlqs_streams(-1.0);
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
