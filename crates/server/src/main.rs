//! The `warren` binary: an AMQP 0-9-1 broker.

mod config;
mod driver;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing_subscriber::EnvFilter;
use warren_broker::{Broker, BrokerConfig};
use warren_session::Node;

use crate::config::{Args, Config};

fn main() -> ExitCode {
    let config = match Config::resolve(Args::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("warren: {e}");
            return ExitCode::from(2);
        }
    };
    let filter = EnvFilter::try_new(&config.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("warren: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> std::io::Result<()> {
    let addr = (config.bind, config.port);
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("cannot listen on {}:{}: {e}", config.bind, config.port),
        )
    })?;
    tracing::info!(address = %listener.local_addr()?, "warren listening for AMQP 0-9-1 clients");
    // Server-named queues must not be predictable across restarts.
    let name_seed = {
        use std::hash::{BuildHasher, Hasher};
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    let broker = Broker::new(BrokerConfig {
        name_seed,
        max_message_size: usize::try_from(config.session.max_message_size).unwrap_or(usize::MAX),
        ..BrokerConfig::default()
    });
    let node = Node::new(config.session.clone(), broker);
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = stop_tx.send(true);
    });
    driver::serve(listener, node, stop_rx).await?;
    // Give writer tasks a moment to put the last close frames on the wire.
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
