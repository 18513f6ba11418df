//! The `sluice` command line.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use sluice::config::{Config, LogFormat};
use tracing_subscriber::EnvFilter;

// Request handling allocates many small short-lived buffers across threads; mimalloc's
// thread-local free lists cost far less there than glibc's arenas (measured with perf).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "sluice", version, about = "A CloudEvents HTTP gateway")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        /// The configuration file (TOML).
        #[arg(long, short, env = "SLUICE_CONFIG")]
        config: PathBuf,
        /// Listen address; overrides `listen` and SLUICE_LISTEN.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Data directory; overrides `data_dir` and SLUICE_DATA_DIR.
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Check a configuration file and exit: 0 if it is valid, 1 with the error if not.
    CheckConfig {
        /// The configuration file (TOML).
        file: PathBuf,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::CheckConfig { file } => {
            let config = Config::load(&file)?;
            println!(
                "{}: ok ({} buses, {} rules)",
                file.display(),
                config.buses.len(),
                config.rules.len()
            );
            Ok(())
        }
        Command::Serve {
            config,
            listen,
            data_dir,
        } => {
            let mut config = Config::load(&config)?;
            if let Some(listen) = listen {
                config.listen = listen;
            }
            if let Some(dir) = data_dir {
                config.data_dir = dir;
            }
            init_logging(&config)?;
            let unknown: Vec<String> = std::env::vars()
                .map(|(k, _)| k)
                .filter(|k| k.starts_with("SLUICE_"))
                .filter(|k| {
                    let key = k["SLUICE_".len()..].to_ascii_lowercase();
                    key != "config" && !sluice::config::ENV_KEYS.contains(&key.as_str())
                })
                .collect();
            for var in unknown {
                tracing::warn!(%var, "ignoring an environment variable that names no top-level key");
            }
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("sluice")
                .build()
                .context("cannot start the async runtime")?;
            runtime.block_on(sluice::app::run(config, shutdown_signal()))?;
            Ok(())
        }
    }
}

fn init_logging(config: &Config) -> anyhow::Result<()> {
    let filter = EnvFilter::try_new(&config.log)
        .with_context(|| format!("log filter `{}` is not valid", config.log))?;
    // Logs go to stderr: stdout belongs to the `log` target's events.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match config.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("shutdown requested");
}
