//! `lua/rate_share.lua` on a private `redis-server` and its mirror on the
//! embedded store answer the same calls alike.

use slicelimit::{MemoryStore, Store};
use slicelimit_server::share::{RateShare, ShareCall};
use slicelimit_sim::RedisServer;

#[tokio::test]
async fn the_rate_share_script_and_its_mirror_agree() {
    let server = RedisServer::start();
    let redis: Store = slicelimit_sim::store(&server).await.into();
    let memory: Store = MemoryStore::new().into();
    let call = |holder: &str, demand: u64, in_use: u64, ttl_ms: u64| ShareCall {
        holder: holder.into(),
        claims: vec![demand, demand / 3],
        limit: 100,
        ttl_ms,
        tokens_ttl_ms: ttl_ms * 2,
        claims_ttl_ms: ttl_ms / 2,
        in_use,
        tokens: in_use / 4,
    };
    let calls = [
        call("a", 90, 0, 5_000),
        call("b", 90, 0, 5_000),
        call("c", 30, 0, 5_000),
        call("a", 90, 90, 5_000),
        call("a", 90, 35, 5_000),
        call("b", 90, 10, 5_000),
        call("c", 30, 30, 5_000),
        call("b", 0, 0, 0),
        call("a", 200, 35, 5_000),
        call("c", 5, 30, 5_000),
    ];
    for (i, call) in calls.iter().enumerate() {
        let share = RateShare {
            key: "rlqs:parity",
            call,
        };
        let from_redis = redis.run(&share).await.expect("redis");
        let from_memory = memory.run(&share).await.expect("memory");
        assert_eq!(from_redis, from_memory, "call {i}: {call:?}");
    }
}
