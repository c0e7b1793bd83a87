//! `examples/envoy/run.sh`, the one-command setup (Redis, two replicas,
//! Envoy, traffic), run as a user would run it, with the binaries the
//! other tests use.

use std::process::Command;

use slicelimit_sim::envoy::envoy_binary;
use slicelimit_sim::server_binary;

#[test]
fn the_envoy_example_runs_and_every_limit_holds() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/envoy/run.sh");
    let out = Command::new("bash")
        .arg(script)
        .env("SLICELIMIT_SERVER", env!("CARGO_BIN_EXE_slicelimit-server"))
        .env("SLICELIMIT_ENVOY", envoy_binary())
        .env("REDIS_SERVER", server_binary())
        .output()
        .expect("run bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "run.sh failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("alice: 5 of 20"), "{stdout}");
    assert!(stdout.contains("bob: 2 of 4"), "{stdout}");
    println!("{stdout}");
}
