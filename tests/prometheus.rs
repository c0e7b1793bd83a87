//! The one-call Prometheus exporter, scraped over HTTP. Its own test binary:
//! a process has one global recorder.

use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use slicelimit::{nonzero, Limiter, Quota};

#[tokio::test]
async fn the_exporter_serves_described_metrics_with_fixed_labels() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = ([127, 0, 0, 1], port).into();
    let handle = slicelimit::metrics::install_prometheus(addr).expect("installed");
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(3)))
        .name("scrape")
        .local()
        .build()
        .unwrap();
    for _ in 0..5 {
        limiter.check("user-1", 1).await;
    }
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut text = String::new();
    for _ in 0..50 {
        let uri = format!("http://127.0.0.1:{port}/metrics");
        if let Ok(response) = client.get(uri.parse().unwrap()).await {
            let body = response.into_body().collect().await.unwrap().to_bytes();
            text = String::from_utf8_lossy(&body).into_owned();
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        text.contains("# TYPE slicelimit_decisions_total counter"),
        "{text}"
    );
    assert!(text.contains("# HELP slicelimit_decisions_total"), "{text}");
    assert!(
        text.contains(
            "slicelimit_decisions_total{limiter=\"scrape\",outcome=\"allowed\",source=\"local\"} 3"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "slicelimit_decisions_total{limiter=\"scrape\",outcome=\"denied\",source=\"local\"} 2"
        ),
        "{text}"
    );
    assert!(!text.contains("user-1"), "user keys never become labels");
    assert!(handle.render().contains("slicelimit_decisions_total"));
}

/// A port another process (here: a listener of this one) already uses is
/// an `Io` error that says so, not "invalid input"; nothing is installed.
#[tokio::test]
async fn a_port_in_use_is_an_io_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let err = slicelimit::metrics::install_prometheus(addr).unwrap_err();
    assert_eq!(err.kind(), slicelimit::ErrorKind::Io, "{err}");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}
