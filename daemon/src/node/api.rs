//! The control API as a node starts and stops it: who it lets in (the token given or kept in
//! the data directory, the config's host names), serving it, and what it leaves for clients
//! to find it by (the address file, the token's listing) until it stops.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::{NodeError, Options, API_ADDR_FILE};
use crate::config::Config;
use crate::control;
use crate::handle::NodeHandle;

/// Serves the control API on `listener` until [`ServedApi::stop`]; lists the token for the
/// CLI, prints the page's address with it, and writes the address file.
pub(super) fn serve_api(
    listener: tokio::net::TcpListener,
    shared: Arc<NodeHandle>,
    access: control::access::Access,
) -> ServedApi {
    let api_addr = shared.api_addr;
    // Listed for the CLI before the address file is written: whoever reads the address can
    // find the token.
    let listed = control::token::list(api_addr, &access.token);
    // The page's address with its token on a terminal, as Jupyter prints it; where the
    // output goes to a log others may read, where the token is kept instead.
    if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        println!(
            "p2ptrain node {}: status page http://{api_addr}/?token={}",
            shared.peer_id, access.token
        );
    } else {
        println!(
            "p2ptrain node {}: status page http://{api_addr}/?token=<the token in {}>",
            shared.peer_id,
            shared.data_dir.join(control::token::TOKEN_FILE).display()
        );
    }
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let router = control::router(shared.clone(), access);
    let server = tokio::spawn(control::serve::serve(
        listener,
        router,
        stop_rx,
        Arc::default(),
        control::serve::Limits::default(),
    ));
    let addr_file = shared.data_dir.join(API_ADDR_FILE);
    if let Err(e) = std::fs::write(&addr_file, format!("{api_addr}\n")) {
        tracing::warn!("cannot write {}: {e}", addr_file.display());
    }
    ServedApi {
        stop_tx,
        server,
        addr_file,
        _listed: listed,
    }
}

/// The control API while it serves: how to stop it, and what it leaves for clients to find
/// it by (the address file, the token's listing), removed once it has stopped.
pub(super) struct ServedApi {
    stop_tx: oneshot::Sender<()>,
    server: tokio::task::JoinHandle<()>,
    addr_file: PathBuf,
    _listed: Option<control::token::Listed>,
}

impl ServedApi {
    /// Stops serving: the connections open are closed once their requests under way are
    /// answered, within 5 s (a client that never finishes one cannot hold the node up), then
    /// the address file and the listing go.
    pub(super) async fn stop(self) {
        let _ = self.stop_tx.send(());
        let mut server = self.server;
        if tokio::time::timeout(Duration::from_secs(5), &mut server)
            .await
            .is_err()
        {
            server.abort();
        }
        let _ = std::fs::remove_file(&self.addr_file);
    }
}

/// Refuses an access token given that no HTTP header can carry.
pub(super) fn check_api_token(opts: &Options) -> Result<(), NodeError> {
    match opts.api_token.as_deref() {
        Some(t) if !control::token::is_usable(t) => Err(NodeError::ApiToken),
        _ => Ok(()),
    }
}

/// What the control API lets through: the token given (`--api-token`, the environment), else
/// the one kept in the data directory, made at the first start; and the config's host names.
pub(super) fn api_access(
    config: &Config,
    opts: &Options,
    data_dir: &Path,
) -> Result<control::access::Access, NodeError> {
    let kept = match opts.api_token.as_deref() {
        // Kept too, so that what reads the file has the token the node asks for.
        Some(token) => control::token::keep(data_dir, token).map(|()| token.to_string()),
        None => control::token::load_or_create(data_dir),
    };
    let token = kept.map_err(|e| {
        NodeError::DataDir(format!(
            "{}: {e}",
            data_dir.join(control::token::TOKEN_FILE).display()
        ))
    })?;
    Ok(control::access::Access {
        token,
        allowed_hosts: config
            .api
            .allowed_hosts
            .iter()
            .map(|h| h.to_ascii_lowercase())
            .collect(),
    })
}
