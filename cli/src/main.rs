//! `p2ptrain`: run a training node, and talk to a running one.
//!
//! This binary is glue: argument parsing, human or JSON output, exit codes. The work lives in
//! `p2ptrain-daemon` and `p2ptrain-models`. Every failure ends as one line on stderr and a
//! non-zero exit code.

mod allocator;
mod bench;
mod client;
mod evaluate;
mod hf_export;
mod init;
mod local;
mod measure;
mod output;
mod plot;
mod progress;
mod runtime;
mod sample;
mod tokenize;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use p2ptrain_daemon::config::{Overrides, SyncMode, DEFAULT_API, DEFAULT_DATA_DIR};
use p2ptrain_daemon::control::TOKEN_ENV;
use p2ptrain_daemon::node::{self, Options};
use p2ptrain_daemon::status::{CheckpointView, Status};
use p2ptrain_daemon::Config;

use crate::client::Client;

#[derive(Parser)]
#[command(
    name = "p2ptrain",
    version,
    about = "Peer-to-peer training daemon: every node trains a full copy of the model"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start a node in the foreground and train (Ctrl-C stops it with a final checkpoint).
    Join(JoinArgs),
    /// Show a running node's status.
    Status(StatusArgs),
    /// Save, list, export or restore checkpoints of a running node.
    #[command(subcommand)]
    Checkpoint(CheckpointCmd),
    /// Evaluate a checkpoint file on the held-out data, without a daemon.
    Eval(EvalArgs),
    /// Stop a running node gracefully: it tells its neighbours it leaves (they replace it at
    /// once), finishes its step and writes a final checkpoint. `leave` is another name for it.
    #[command(visible_alias = "leave")]
    Stop(ApiArgs),
    /// List the node's peers.
    Peers(PeersArgs),
    /// Run a mesh of N nodes on this machine (127.0.0.1), show progress, summarise.
    Local(local::LocalArgs),
    /// Generate text with a language model (gpt) from a checkpoint or a running node.
    Sample(sample::SampleArgs),
    /// Write a llama checkpoint file as a Hugging Face folder (config.json and
    /// model.safetensors), which transformers loads with from_pretrained.
    Export(ExportArgs),
    /// Write a fine-tune of a Hugging Face llama-family folder as a folder to copy to every
    /// box: a config (the folder's shape and digest), its tokenizer and your text.
    Init(init::InitArgs),
    /// Tokenize text files with a Hugging Face tokenizer.json into a token file
    /// (`data.source = "tokens"`).
    Tokenize(tokenize::TokenizeArgs),
    /// Benchmarks that write JSON.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Write a new random key for a private network (give every node the same file).
    Keygen(KeygenArgs),
    /// Print a shell completion script, e.g. `p2ptrain completions bash >
    /// ~/.local/share/bash-completion/completions/p2ptrain`.
    Completions(CompletionsArgs),
}

#[derive(Args)]
struct CompletionsArgs {
    /// The shell to complete in.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(Args)]
struct ExportArgs {
    /// The checkpoint file (safetensors) of a llama run.
    #[arg(long)]
    checkpoint: PathBuf,
    #[command(flatten)]
    hf: HfExportArgs,
}

/// How a Hugging Face folder is written.
#[derive(Args)]
struct HfExportArgs {
    /// The folder to write (new or empty).
    #[arg(long)]
    out: PathBuf,
    /// Store the weights in bfloat16 (rounded to nearest) instead of float32.
    #[arg(long)]
    bf16: bool,
    /// A tokenizer.json to copy into the folder (the run's data.tokenizer).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The Hugging Face folder the run started from (its model.hf), whose special token ids,
    /// context length and generation and tokenizer files the export carries.
    #[arg(long)]
    base: Option<PathBuf>,
}

#[derive(Args)]
struct KeygenArgs {
    /// Where to write the pre-shared key (never overwrites an existing file).
    #[arg(long)]
    psk: PathBuf,
}

#[derive(Args, Clone)]
struct ApiArgs {
    /// Control API address of the node.
    #[arg(long, env = "P2PTRAIN_API", default_value_t = DEFAULT_API.to_string())]
    api: String,
    /// Access token for the control API.
    #[arg(long, env = TOKEN_ENV, hide_env_values = true)]
    api_token: Option<String>,
}

#[derive(Args)]
struct JoinArgs {
    /// Configuration file (TOML); default: the built-in configs/digits-mlp.toml.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A setting written over the config file's, `section.key=VALUE` with VALUE in TOML (a
    /// bare word is a string), e.g. `--set optimizer.lr=0.001`; repeatable. Settings that
    /// make the run id change it on every box: give joiners the same ones.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    settings: Vec<p2ptrain_daemon::config::Setting>,
    /// Directory for identity, checkpoints and index.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// Control API address (default: from the config, else 127.0.0.1:7070).
    #[arg(long)]
    api: Option<SocketAddr>,
    /// Access token for the control API (required for a non-loopback --api).
    #[arg(long, env = TOKEN_ENV, hide_env_values = true)]
    api_token: Option<String>,
    /// Compute device: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, value_name = "cpu|cuda|cuda:N")]
    device: Option<p2ptrain_daemon::device::DeviceSpec>,
    /// Compute threads for Candle.
    #[arg(long)]
    threads: Option<usize>,
    /// Stop after this many training steps (0: train until stopped).
    #[arg(long)]
    max_steps: Option<u64>,
    /// A member of the mesh to join through, e.g. /ip4/192.168.1.5/tcp/7471/p2p/12D3Koo...
    /// (repeatable). Without one, this node founds a new mesh.
    #[arg(long)]
    bootstrap: Vec<String>,
    /// libp2p address to listen on (repeatable; default /ip4/0.0.0.0/tcp/7471).
    #[arg(long)]
    listen: Vec<String>,
    /// Also find peers on the local network with mDNS (multicast on every interface; off by
    /// default).
    #[arg(long)]
    mdns: bool,
    /// Private network key file (from `p2ptrain keygen --psk`): only nodes with the same key
    /// can connect. Overrides `network.psk`.
    #[arg(long)]
    psk: Option<PathBuf>,
    /// How the members combine their training (see docs/modes.md). Overrides `sync.mode`.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(SyncMode::names()))]
    sync_mode: Option<String>,
    /// In a synchronous mode, start rounds only once this many members (this node included)
    /// are ready. Overrides `sync.min_members`.
    #[arg(long, value_name = "N")]
    min_members: Option<usize>,
    /// Train on part K of N of the training set (`data.partition` says how it is cut).
    /// Overrides `train.shard`.
    #[arg(long, value_name = "K/N")]
    shard: Option<String>,
    /// A held-out figure to reach (bits per byte for a language model, else accuracy): the
    /// node logs the step at which an evaluation first reaches it. Overrides `train.target`.
    #[arg(long)]
    target: Option<f64>,
    /// Write a timeline of the node's work (Chrome trace JSON: open it in ui.perfetto.dev or
    /// chrome://tracing): spans per step for forward/backward, optimizer, encode, publish,
    /// validate, apply, full sync, checkpoint and state download.
    #[arg(long, value_name = "FILE")]
    timeline: Option<PathBuf>,
    /// Start the timeline afresh once the file reaches this many MiB, the full one moved to
    /// FILE.1 (so at most twice this on disk, the latest spans kept).
    #[arg(long, default_value_t = 64, value_name = "MIB", requires = "timeline",
          value_parser = clap::value_parser!(u64).range(1..=65_536))]
    timeline_max_mib: u64,
    /// More log lines: -v adds p2ptrain's debug lines, -vv its trace lines. `RUST_LOG`, when
    /// set, decides instead (e.g. `RUST_LOG=libp2p_gossipsub=debug`).
    #[arg(short, long, action = clap::ArgAction::Count, conflicts_with = "quiet")]
    verbose: u8,
    /// Fewer log lines: -q keeps warnings and errors, -qq errors only.
    #[arg(short, long, action = clap::ArgAction::Count)]
    quiet: u8,
    /// How log lines are written to stderr: text, or json (one object a line, for a log
    /// collector).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// How `join` writes its log lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines (colored on a terminal).
    Text,
    /// One JSON object a line: timestamp, level, target, fields.
    Json,
}

/// The log filter `join` starts with when `RUST_LOG` is not set: `verbose` and `quiet` are the
/// counts of `-v` and `-q`. sled's own lines stay at warnings unless `-vv`.
fn log_filter(verbose: u8, quiet: u8) -> &'static str {
    match (verbose, quiet) {
        (0, 0) => "info,sled=warn",
        (_, 1) => "warn",
        (_, q) if q >= 2 => "error",
        (1, _) => "info,p2ptrain=debug,p2ptrain_daemon=debug,p2ptrain_models=debug,sled=warn",
        _ => "info,p2ptrain=trace,p2ptrain_daemon=trace,p2ptrain_models=trace",
    }
}

#[derive(Args)]
struct PeersArgs {
    #[command(flatten)]
    api: ApiArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct StatusArgs {
    #[command(flatten)]
    api: ApiArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Keep printing a line every --interval seconds until the node stops.
    #[arg(long)]
    watch: bool,
    /// Seconds between lines with --watch.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
}

#[derive(Subcommand)]
enum CheckpointCmd {
    /// Write a checkpoint of the current state now.
    Save(CkptArgs),
    /// List the node's checkpoints.
    List(CkptArgs),
    /// Copy a checkpoint file out of the node (default: a fresh one of the current state),
    /// or with --hf write a llama's as a Hugging Face folder.
    Export {
        #[command(flatten)]
        args: CkptArgs,
        /// Where to write the safetensors file (with --hf: the folder).
        #[arg(long)]
        out: PathBuf,
        /// Export this checkpoint id instead of saving a fresh one.
        #[arg(long)]
        id: Option<u64>,
        /// Write a Hugging Face folder (config.json and model.safetensors) instead of the
        /// checkpoint file.
        #[arg(long)]
        hf: bool,
        /// With --hf: store the weights in bfloat16.
        #[arg(long, requires = "hf")]
        bf16: bool,
        /// With --hf: a tokenizer.json to copy into the folder.
        #[arg(long, requires = "hf")]
        tokenizer: Option<PathBuf>,
        /// With --hf: the Hugging Face folder the run started from (its model.hf), whose
        /// special token ids, context length and generation and tokenizer files the export
        /// carries.
        #[arg(long, requires = "hf")]
        base: Option<PathBuf>,
    },
    /// Load a checkpoint into the running node and continue training from it.
    Restore {
        #[command(flatten)]
        args: CkptArgs,
        /// Checkpoint id (see `checkpoint list`).
        id: u64,
    },
}

#[derive(Args)]
struct CkptArgs {
    #[command(flatten)]
    api: ApiArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct EvalArgs {
    /// The checkpoint file (safetensors) to evaluate.
    #[arg(long)]
    checkpoint: PathBuf,
    /// The configuration it was trained with; default: the built-in digits config.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Steps/s of the trainer inside a running daemon against a bare Candle loop.
    Trainer(bench::trainer::TrainerArgs),
    /// A local mesh per update codec: bytes per update, accuracy, throughput, consensus;
    /// writes report.json and report.svg.
    Mesh(bench::mesh::MeshArgs),
    /// Time to a target loss or accuracy: one node, one node with N times the batch (the
    /// ideal), N pinned nodes in each sync mode and PyTorch DDP (gloo), over seeds, on
    /// loopback or shaped links; speedup and scaling efficiency in report.json and report.svg.
    Scaling(bench::scaling::ScalingArgs),
    /// One training step of each model and optimizer against PyTorch eager on the same CPU
    /// and thread count, and the codecs' cost per update; writes JSON.
    Step(bench::step::StepArgs),
    /// The mesh core's simulator at sizes no lab can start (churn, hostile peers, a partition
    /// that heals): bytes per node per step and consensus against N; writes JSON.
    Sim(bench::sim::SimArgs),
}

fn main() -> ExitCode {
    allocator::keep_freed_memory();
    p2ptrain_daemon::memory::count_heap_with(allocator::live_heap_bytes);
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e)
            if !e.use_stderr()
                || e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand =>
        {
            e.exit()
        }
        Err(e) => {
            eprintln!("{}", one_line(&e.render().to_string()));
            return ExitCode::from(2);
        }
    };
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A command-line error as one line, as every failure of this binary ends: clap's text up to
/// its usage and help hints, its lines joined (a missing argument's name is on the second).
fn one_line(clap_error: &str) -> String {
    clap_error
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

fn init_logging(verbose: u8, quiet: u8, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(log_filter(verbose, quiet)));
    let lines = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => lines
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => lines.json().with_ansi(false).try_init(),
    };
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Cmd::Join(args) => join(args),
        Cmd::Status(args) => runtime::client_runtime()?.block_on(status(args)),
        Cmd::Checkpoint(cmd) => runtime::client_runtime()?.block_on(checkpoint(cmd)),
        Cmd::Eval(args) => eval(args),
        Cmd::Completions(args) => {
            let mut cli = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(args.shell, &mut cli, "p2ptrain", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Sample(args) => {
            sample::run(args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Stop(api) => runtime::client_runtime()?.block_on(async {
            let client = Client::new(&api.api, api.api_token)?;
            let _: serde_json::Value = client.post("/v1/stop").await?;
            println!("stopping: the node tells its neighbours it leaves, writes a final checkpoint and exits");
            Ok(ExitCode::SUCCESS)
        }),
        Cmd::Peers(args) => runtime::client_runtime()?.block_on(async {
            let client = Client::new(&args.api.api, args.api.api_token)?;
            let s: Status = client.get("/v1/status").await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&s.peers)?);
            } else {
                print!("{}", output::peers_table(&s));
            }
            Ok(ExitCode::SUCCESS)
        }),
        Cmd::Bench(BenchCmd::Trainer(args)) => bench::trainer::run(args),
        Cmd::Bench(BenchCmd::Step(args)) => bench::step::run(args),
        Cmd::Bench(BenchCmd::Sim(args)) => bench::sim::run(args).map(|()| ExitCode::SUCCESS),
        Cmd::Bench(BenchCmd::Mesh(args)) => {
            bench::mesh::run(args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench(BenchCmd::Scaling(args)) => {
            bench::scaling::run(args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Keygen(args) => keygen(&args.psk),
        Cmd::Tokenize(args) => tokenize::run(args).map(|()| ExitCode::SUCCESS),
        Cmd::Init(args) => init::run(args).map(|()| ExitCode::SUCCESS),
        Cmd::Export(args) => {
            let (file, loaded) = evaluate::read_checkpoint_file(&args.checkpoint)?;
            let h = &args.hf;
            hf_export::write(
                &loaded.meta.info.model,
                &loaded.tensors,
                &h.out,
                h.bf16,
                h.tokenizer.as_deref(),
                h.base.as_deref(),
            )
            .with_context(|| format!("exporting {file}"))?;
            println!(
                "wrote {}: {file} (step {}) as a Hugging Face folder",
                h.out.display(),
                loaded.meta.info.step
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Local(args) => {
            let json = args.json;
            let summary = local::run(args)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&summary)?);
            } else {
                local::print_summary(&summary);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn keygen(path: &Path) -> Result<ExitCode> {
    use std::io::Write;
    let text = node::new_psk_file();
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let mut file = opts.open(path).with_context(|| {
        format!(
            "cannot create {} (an existing key is never overwritten)",
            path.display()
        )
    })?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", path.display()))?;
    let key = node::read_psk(path)?;
    println!(
        "wrote a new network key to {} (fingerprint {}); copy it to every node and start each with --psk {}",
        path.display(),
        key.fingerprint(),
        path.display()
    );
    Ok(ExitCode::SUCCESS)
}

impl JoinArgs {
    /// The flags that override the config file, for [`Config::apply`].
    fn overrides(&self) -> Overrides {
        Overrides {
            device: self.device.map(|d| d.to_string()),
            threads: self.threads,
            max_steps: self.max_steps,
            api: self.api,
            listen: self.listen.clone(),
            bootstrap: self.bootstrap.clone(),
            mdns: self.mdns,
            psk: self.psk.clone(),
            sync_mode: self.sync_mode.clone(),
            min_members: self.min_members,
            shard: self.shard.clone(),
            target: self.target,
        }
    }
}

fn join(args: JoinArgs) -> Result<ExitCode> {
    let mut config = Config::load_with(args.config.as_deref(), &args.settings)?;
    config.apply(&args.overrides())?;
    runtime::set_compute_threads(config.train.threads);
    let prepared = node::prepare(config)?;
    init_logging(args.verbose, args.quiet, args.log_format);
    if let Some(path) = &args.timeline {
        p2ptrain_daemon::timeline::install(path, args.timeline_max_mib * 1024 * 1024)?;
    }
    let opts = Options {
        data_dir: args.data_dir,
        api_token: args.api_token.filter(|t| !t.is_empty()),
        download_progress: Default::default(),
    };
    let rt = runtime::runtime()?;
    if !args.bootstrap.is_empty() {
        rt.spawn(show_download(opts.download_progress.clone()));
    }
    let summary = rt.block_on(node::run(prepared, opts, shutdown_signal()));
    if let Some(written) = p2ptrain_daemon::timeline::close() {
        match written {
            Ok(w) => eprintln!(
                "timeline: {} spans written; the file holds the latest {} bytes{}",
                w.events,
                w.bytes,
                if w.rotations > 0 {
                    format!(
                        " (it reached its limit {} times; the one before is {})",
                        w.rotations,
                        p2ptrain_daemon::timeline::rotated_path(
                            args.timeline.as_deref().unwrap_or(std::path::Path::new(""))
                        )
                        .display()
                    )
                } else {
                    String::new()
                }
            ),
            Err(e) => eprintln!("timeline not finished: {e}"),
        }
    }
    let summary = summary?;
    let acc = summary
        .stats
        .training
        .eval
        .map(|e| format!(", held-out {}", e.headline()))
        .unwrap_or_default();
    let ck = summary
        .final_checkpoint
        .map(|c| format!(", final checkpoint {} ({})", c.id, c.file))
        .unwrap_or_default();
    eprintln!("stopped at step {}{acc}{ck}", summary.stats.training.step);
    Ok(ExitCode::SUCCESS)
}

/// Shows a joiner's state download (a bar on a terminal, lines otherwise) from the moment a
/// state is chosen until it is all here, or until the joiner gives up. A node that resumes
/// from its own checkpoint never starts one, and this waits quietly until the process ends.
async fn show_download(progress: std::sync::Arc<p2ptrain_daemon::transfer::DownloadProgress>) {
    let tick = std::time::Duration::from_millis(100);
    let mut shown: Option<(u64, progress::Counted)> = None;
    loop {
        let (done, total) = progress.bytes();
        if progress.given_up() {
            if let Some((_, bar)) = shown.take() {
                bar.abandon(done);
            }
            return;
        }
        match shown.as_mut() {
            // No state chosen yet.
            None if total == 0 => {}
            None => shown = Some((total, progress::Counted::bytes("state download", total))),
            // Another donor's state was chosen: the bar starts again.
            Some((of, _)) if *of != total => {
                if let Some((_, bar)) = shown.take() {
                    bar.finish(done);
                }
                continue;
            }
            Some(_) if done >= total => {
                if let Some((_, bar)) = shown.take() {
                    bar.finish(done);
                }
                return;
            }
            Some((_, bar)) => bar.set(done, ""),
        }
        tokio::time::sleep(tick).await;
    }
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    // The node now finishes its step and writes its final checkpoint, which can take a while
    // for a large model. A second Ctrl-C means the user will not wait: stop at once. A
    // checkpoint is written under a temporary name and renamed, so the newest complete one
    // survives, as it survives `kill -9`.
    tokio::spawn(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("second interrupt: stopping now, without the final checkpoint (the newest one written is kept)");
            std::process::exit(130);
        }
    });
}

async fn status(args: StatusArgs) -> Result<ExitCode> {
    let client = Client::new(&args.api.api, args.api.api_token.clone())?;
    if !args.watch {
        let s: Status = client.get("/v1/status").await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&s)?);
        } else {
            print!("{}", output::status_text(&s));
        }
        return Ok(ExitCode::SUCCESS);
    }
    if !(args.interval > 0.0 && args.interval.is_finite()) {
        bail!("--interval must be a positive number of seconds");
    }
    let mut seen_once = false;
    loop {
        match client.get::<Status>("/v1/status").await {
            Ok(s) => {
                seen_once = true;
                if args.json {
                    println!("{}", serde_json::to_string(&s)?);
                } else {
                    println!("{}", output::status_line(&s));
                }
            }
            Err(e) if seen_once => {
                eprintln!("node gone: {e:#}");
                return Ok(ExitCode::SUCCESS);
            }
            Err(e) => return Err(e),
        }
        tokio::time::sleep(Duration::from_secs_f64(args.interval)).await;
    }
}

async fn checkpoint(cmd: CheckpointCmd) -> Result<ExitCode> {
    match cmd {
        CheckpointCmd::Save(a) => {
            let client = Client::new(&a.api.api, a.api.api_token)?;
            let c: CheckpointView = client.post("/v1/checkpoints").await?;
            print_checkpoint(&c, a.json)?;
        }
        CheckpointCmd::List(a) => {
            let client = Client::new(&a.api.api, a.api.api_token)?;
            let list: Vec<CheckpointView> = client.get("/v1/checkpoints").await?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                print!("{}", output::checkpoint_table(&list));
            }
        }
        CheckpointCmd::Export {
            args,
            out,
            id,
            hf,
            bf16,
            tokenizer,
            base,
        } => {
            let client = Client::new(&args.api.api, args.api.api_token)?;
            let id = match id {
                Some(id) => id,
                None => {
                    client
                        .post::<CheckpointView>("/v1/checkpoints")
                        .await?
                        .meta
                        .id
                }
            };
            let bytes = client
                .get_bytes(&format!("/v1/checkpoints/{id}/file"))
                .await?;
            // Verify before writing: an export is only useful if it loads.
            let (meta, tensors) = p2ptrain_daemon::checkpoint::decode(&bytes, "download")
                .map_err(|e| anyhow!("checkpoint {id} failed verification after download: {e}"))?;
            if hf {
                hf_export::write(
                    &meta.info.model,
                    &tensors,
                    &out,
                    bf16,
                    tokenizer.as_deref(),
                    base.as_deref(),
                )?;
                println!(
                    "wrote {}: checkpoint {id} (step {}) as a Hugging Face folder",
                    out.display(),
                    meta.info.step
                );
                return Ok(ExitCode::SUCCESS);
            }
            write_atomically(&out, &bytes)?;
            let view = CheckpointView {
                meta,
                path: out.display().to_string(),
            };
            print_checkpoint(&view, args.json)?;
        }
        CheckpointCmd::Restore { args, id } => {
            let client = Client::new(&args.api.api, args.api.api_token)?;
            let c: CheckpointView = client
                .post(&format!("/v1/checkpoints/{id}/restore"))
                .await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&c)?);
            } else {
                println!(
                    "restored checkpoint {} (step {}); training continues from there",
                    c.meta.id, c.meta.info.step
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_checkpoint(c: &CheckpointView, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(c)?);
    } else {
        println!(
            "checkpoint {} at step {} ({} bytes): {}",
            c.meta.id, c.meta.info.step, c.meta.bytes, c.path
        );
    }
    Ok(())
}

/// Writes a file so that a reader sees either nothing or all of it.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    p2ptrain_daemon::atomic_file::write(
        path,
        bytes,
        None,
        p2ptrain_daemon::atomic_file::Durability::Flushed,
    )
    .with_context(|| format!("cannot write {}", path.display()))
}

fn eval(args: EvalArgs) -> Result<ExitCode> {
    let config = Config::load(args.config.as_deref())?;
    runtime::set_compute_threads(config.train.threads);
    let (file, loaded) = evaluate::read_checkpoint_file(&args.checkpoint)?;
    // Check the run before loading any data.
    let run_id = config.run_id();
    if loaded.meta.info.run_id != run_id {
        bail!(
            "{file} is from run {} but the config ({}) is run {run_id}; pass the --config it was trained with",
            loaded.meta.info.run_id,
            config.origin
        );
    }
    let prepared = node::prepare(config)?;
    let e = evaluate::evaluate_loaded(&file, &loaded, &prepared)?;
    if args.json {
        let v = serde_json::json!({
            "checkpoint": file,
            "run_id": loaded.meta.info.run_id,
            "step": loaded.meta.info.step,
            "model": prepared.spec.name(),
            "data": prepared.config.data.describe(),
            "accuracy": e.accuracy,
            "loss": e.loss,
            "samples": e.samples,
            "bits_per_byte": e.bits_per_byte,
            "perplexity": e.bits_per_byte.map(|_| e.loss.exp()),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if let Some(bpb) = e.bits_per_byte {
        println!(
            "{file}: step {}, {} on {}: {bpb:.3} bits per byte, perplexity {:.2} ({} held-out windows), next-{} accuracy {:.2}%",
            loaded.meta.info.step,
            prepared.spec.name(),
            prepared.config.data.describe(),
            e.loss.exp(),
            e.samples,
            if matches!(prepared.spec, p2ptrain_models::ModelSpec::Llama(_)) {
                "token"
            } else {
                "byte"
            },
            e.accuracy * 100.0
        );
    } else {
        println!(
            "{file}: step {}, {} on {}: accuracy {:.2}% ({} held-out samples), loss {:.4}",
            loaded.meta.info.step,
            prepared.spec.name(),
            prepared.config.data.describe(),
            e.accuracy * 100.0,
            e.samples,
            e.loss
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use std::collections::BTreeSet;

    /// The rows of `docs/cli.md`'s command table: each command's path (`checkpoint export`)
    /// and the long flags its synopsis names.
    fn documented_commands() -> Vec<(String, BTreeSet<String>)> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/cli.md");
        let text = std::fs::read_to_string(&path).expect("docs/cli.md");
        text.lines()
            .filter_map(|line| line.strip_prefix("| `p2ptrain "))
            .map(|row| {
                let synopsis = row.split("` |").next().unwrap_or(row);
                let command: Vec<&str> = synopsis
                    .split_whitespace()
                    .take_while(|w| w.chars().all(|c| c.is_ascii_lowercase()))
                    .collect();
                let flags = synopsis
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .filter(|w| w.starts_with("--") && w.len() > 2)
                    .map(str::to_string)
                    .collect();
                (command.join(" "), flags)
            })
            .collect()
    }

    /// Every leaf command of the CLI, by path, with its long flags (help and version aside).
    fn commands(cmd: &clap::Command, path: &str, out: &mut Vec<(String, BTreeSet<String>)>) {
        let subcommands: Vec<&clap::Command> = cmd
            .get_subcommands()
            .filter(|c| c.get_name() != "help")
            .collect();
        if subcommands.is_empty() {
            let flags = cmd
                .get_arguments()
                .filter_map(|a| a.get_long())
                .filter(|l| *l != "help" && *l != "version")
                .map(|l| format!("--{l}"))
                .collect();
            out.push((path.to_string(), flags));
        }
        for sub in subcommands {
            let sub_path = if path.is_empty() {
                sub.get_name().to_string()
            } else {
                format!("{path} {}", sub.get_name())
            };
            commands(sub, &sub_path, out);
        }
    }

    /// Devices, codecs and sync modes are checked when the command line is read, and the
    /// error lists what is accepted.
    #[test]
    fn devices_codecs_and_modes_are_refused_at_parse_time_naming_the_choices() {
        let refused = |args: &[&str]| match Cli::try_parse_from(args) {
            Ok(_) => panic!("{args:?} parsed"),
            Err(e) => e.to_string(),
        };
        let e = refused(&["p2ptrain", "join", "--device", "gpu"]);
        assert!(e.contains("\"cpu\", \"cuda\" or \"cuda:N\""), "{e}");
        let e = refused(&[
            "p2ptrain",
            "bench",
            "mesh",
            "--out",
            "x",
            "--codec",
            "dense,zip",
        ]);
        assert!(e.contains("onebit-tensor") && e.contains("zip"), "{e}");
        let e = refused(&[
            "p2ptrain", "bench", "scaling", "--out", "x", "--modes", "ddp,ring",
        ]);
        assert!(e.contains("diloco") && e.contains("ring"), "{e}");
        let e = refused(&["p2ptrain", "join", "--log-format", "xml"]);
        assert!(e.contains("json"), "{e}");
        let e = refused(&["p2ptrain", "join", "-v", "-q"]);
        assert!(e.contains("cannot be used with"), "{e}");
        let ok = Cli::try_parse_from(["p2ptrain", "join", "--device", "cuda:1", "-vv"]);
        match ok.map(|c| c.command) {
            Ok(Cmd::Join(j)) => {
                assert_eq!(j.device, Some(p2ptrain_daemon::device::DeviceSpec::Cuda(1)));
                assert_eq!(log_filter(j.verbose, j.quiet), log_filter(2, 0));
            }
            _ => panic!("join --device cuda:1 -vv"),
        }
        let ok = Cli::try_parse_from([
            "p2ptrain",
            "bench",
            "mesh",
            "--out",
            "x",
            "--codec",
            "onebit,topk",
        ]);
        assert!(ok.is_ok());
    }

    /// A command-line error is one line, the argument it is about named.
    #[test]
    fn a_command_line_error_is_one_line() {
        let error = |args: &[&str]| match Cli::try_parse_from(args) {
            Ok(_) => panic!("{args:?} parsed"),
            Err(e) => one_line(&e.render().to_string()),
        };
        let e = error(&["p2ptrain", "join", "--device", "tpu"]);
        assert!(
            e.starts_with("error: invalid value 'tpu'") && e.contains("cuda:N"),
            "{e}"
        );
        let e = error(&["p2ptrain", "bench", "scaling"]);
        assert!(!e.contains('\n') && e.contains("--out"), "{e}");
    }

    #[test]
    fn more_or_fewer_log_lines_as_the_flags_ask() {
        assert_eq!(log_filter(0, 0), "info,sled=warn");
        assert!(log_filter(1, 0).contains("p2ptrain_daemon=debug"));
        assert!(log_filter(2, 0).contains("p2ptrain_daemon=trace"));
        assert_eq!(log_filter(0, 1), "warn");
        assert_eq!(log_filter(0, 3), "error");
    }

    /// The completion script knows the commands, their flags and the values they take.
    #[test]
    fn completions_name_commands_flags_and_values() {
        let mut script = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut Cli::command(),
            "p2ptrain",
            &mut script,
        );
        let script = String::from_utf8(script).expect("utf8");
        for word in [
            "join",
            "--sync-mode",
            "diloco",
            "--log-format",
            "onebit-tensor",
        ] {
            assert!(script.contains(word), "{word} missing");
        }
    }

    #[test]
    fn the_cli_reference_names_every_command_and_flag_and_no_other() {
        let documented = documented_commands();
        let mut code = Vec::new();
        commands(&Cli::command(), "", &mut code);
        assert!(code.len() > 10, "{} commands", code.len());
        let mut wrong = Vec::new();
        for (path, flags) in &code {
            match documented.iter().find(|(p, _)| p == path) {
                None => wrong.push(format!("p2ptrain {path}: no row in docs/cli.md")),
                Some((_, docs)) => {
                    for flag in flags.difference(docs) {
                        wrong.push(format!("p2ptrain {path} {flag}: not in its row"));
                    }
                    for flag in docs.difference(flags) {
                        wrong.push(format!(
                            "p2ptrain {path} {flag}: in its row, not in the CLI"
                        ));
                    }
                }
            }
        }
        for (path, _) in &documented {
            if !code.iter().any(|(p, _)| p == path) {
                wrong.push(format!(
                    "p2ptrain {path}: a row in docs/cli.md, not a command"
                ));
            }
        }
        assert!(
            wrong.is_empty(),
            "docs/cli.md and the CLI disagree:\n{}",
            wrong.join("\n")
        );
    }
}
