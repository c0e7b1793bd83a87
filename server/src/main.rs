//! `slicelimit-server`: Envoy's rate limit service on leased slices of
//! Redis budgets. `slicelimit-server --help` lists the flags;
//! `docs/envoy.md` tells how to run it behind Envoy.

use clap::Parser;
use slicelimit_server::run::{run, Options};

fn main() -> std::process::ExitCode {
    let options = Options::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("slicelimit-server: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(options, terminated())) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("slicelimit-server: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// SIGTERM (how Kubernetes and most supervisors stop a process) or
/// Ctrl-C.
async fn terminated() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
