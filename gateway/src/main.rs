//! The `sluice` command line.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use sluice::config::{Config, LogFormat};
use tracing_subscriber::EnvFilter;

mod ctl;

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
    /// Manage a running gateway through its admin API (`/api/v1`).
    Ctl(ctl::Ctl),
    /// Rules, tried without a running gateway.
    Rule {
        #[command(subcommand)]
        command: RuleCommand,
    },
}

#[derive(Subcommand)]
enum RuleCommand {
    /// Match one event against a pattern or a CESQL filter, and transform it if it matches.
    /// Prints `{"matched": true|false, "output": ...}`; exits 2 on a bad input.
    Test {
        /// A structured-mode CloudEvent (JSON file).
        #[arg(long)]
        event: PathBuf,
        /// An event pattern (JSON file).
        #[arg(long, required_unless_present = "filter", conflicts_with = "filter")]
        pattern: Option<PathBuf>,
        /// A CESQL filter expression.
        #[arg(long)]
        filter: Option<String>,
        /// A transform step or chain (JSON file).
        #[arg(long)]
        transform: Option<PathBuf>,
    },
}

/// `sluice rule test`: the JSON answer, or the error for stderr.
fn rule_test(
    event: &Path,
    pattern: Option<&Path>,
    filter: Option<&str>,
    transform: Option<&Path>,
) -> Result<serde_json::Value, String> {
    let read = |what: &str, path: &Path| {
        std::fs::read(path).map_err(|e| format!("cannot read the {what} {}: {e}", path.display()))
    };
    let json = |what: &str, path: &Path| -> Result<serde_json::Value, String> {
        serde_json::from_slice(&read(what, path)?)
            .map_err(|e| format!("the {what} {} is not JSON: {e}", path.display()))
    };
    let event = read("event", event)?;
    let pattern = pattern.map(|p| json("pattern", p)).transpose()?;
    let transform = transform.map(|t| json("transform", t)).transpose()?;
    let condition = match (&pattern, filter) {
        (Some(p), _) => sluice_functions::Condition::Pattern(p),
        (None, Some(f)) => sluice_functions::Condition::Filter(f),
        (None, None) => return Err("give --pattern or --filter".to_string()),
    };
    sluice_functions::test_rule(&event, condition, transform.as_ref()).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Rule {
        command:
            RuleCommand::Test {
                event,
                pattern,
                filter,
                transform,
            },
    } = &cli.command
    {
        return match rule_test(
            event,
            pattern.as_deref(),
            filter.as_deref(),
            transform.as_deref(),
        ) {
            Ok(answer) => {
                println!("{answer}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("sluice rule test: {e}");
                ExitCode::from(2)
            }
        };
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Rule { .. } => Ok(()),
        Command::Ctl(ctl) => ctl::run(ctl),
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
            let config = Config::load_with(&config, |config| {
                if let Some(listen) = listen {
                    config.listen = listen;
                }
                if let Some(dir) = data_dir {
                    config.data_dir = dir;
                }
            })?;
            let export = init_logging(&config)?;
            let unknown: Vec<String> = std::env::vars()
                .map(|(k, _)| k)
                .filter(|k| k.starts_with("SLUICE_"))
                .filter(|k| {
                    let key = k["SLUICE_".len()..].to_ascii_lowercase();
                    !matches!(key.as_str(), "config" | "admin_token" | "server")
                        && !sluice::values::ENV_KEYS.contains(&key.as_str())
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
            runtime.block_on(async {
                survive_file_size_limit();
                #[cfg(feature = "otlp")]
                let export = export.map(|exporter| {
                    tracing::info!(endpoint = %sluice::values::redact_url(config.tracing.otlp_endpoint.as_deref().unwrap_or("")), "exporting spans over OTLP");
                    let (stop, stopped) = tokio::sync::watch::channel(false);
                    (stop, tokio::spawn(exporter.run(stopped)))
                });
                #[cfg(not(feature = "otlp"))]
                drop(export);
                let result = sluice::app::run(config, shutdown_signal()).await;
                // Send the spans still queued, within a bound.
                #[cfg(feature = "otlp")]
                if let Some((stop, handle)) = export {
                    let _ = stop.send(true);
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(3), handle).await;
                }
                result
            })?;
            Ok(())
        }
    }
}

#[cfg(feature = "otlp")]
type SpanExport = sluice::otlp::Exporter;
#[cfg(not(feature = "otlp"))]
type SpanExport = std::convert::Infallible;

/// Logs to stderr (text or JSON, filtered by `log`) and, when `[tracing] otlp_endpoint` is
/// set, spans to the collector (the exporter returned runs once the runtime exists).
fn init_logging(config: &Config) -> anyhow::Result<Option<SpanExport>> {
    use tracing_subscriber::prelude::*;
    let filter = EnvFilter::try_new(&config.log)
        .with_context(|| format!("log filter `{}` is not valid", config.log))?;
    // Logs go to stderr: stdout belongs to the `log` target's events.
    let logs = match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let registry = tracing_subscriber::registry().with(logs.with_filter(filter));
    let export = config.tracing.resolve().map_err(anyhow::Error::msg)?;
    #[cfg(feature = "otlp")]
    if let Some(export) = export {
        let (layer, exporter) = sluice::otlp::pipeline(sluice::otlp::Settings {
            endpoint: export.endpoint,
            service_name: config.tracing.service_name.clone(),
            headers: export.headers.into_iter().collect(),
            sample_ratio: config.tracing.sample_ratio,
        });
        // The gateway's own spans, whatever the log filter says.
        let spans =
            tracing_subscriber::filter::Targets::new().with_target("sluice", tracing::Level::INFO);
        registry.with(layer.with_filter(spans)).init();
        return Ok(Some(exporter));
    }
    #[cfg(not(feature = "otlp"))]
    drop(export);
    registry.init();
    Ok(None)
}

/// Under a file-size limit (`ulimit -f`, a container's) the kernel answers a write past it
/// with SIGXFSZ, whose default action kills the process and drops every request in flight.
/// With a handler installed the write fails with `EFBIG` instead: the store reports it
/// (readiness fails, the requests get 503) and takes writes again once there is room.
fn survive_file_size_limit() {
    use tokio::signal::unix::{signal, SignalKind};
    // SIGXFSZ is 25 on x86, ARM, RISC-V and POWER Linux (31 on MIPS and SPARC).
    #[cfg(any(target_arch = "mips", target_arch = "mips64", target_arch = "sparc64"))]
    const SIGXFSZ: i32 = 31;
    #[cfg(not(any(target_arch = "mips", target_arch = "mips64", target_arch = "sparc64")))]
    const SIGXFSZ: i32 = 25;
    match signal(SignalKind::from_raw(SIGXFSZ)) {
        Ok(mut signals) => {
            tokio::spawn(async move { while signals.recv().await.is_some() {} });
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot handle SIGXFSZ; a file-size limit will kill the process")
        }
    }
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
