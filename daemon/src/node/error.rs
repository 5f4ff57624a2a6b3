//! Why a node could not start, or stopped with an error: one variant per part of the node,
//! each printed as one line.

use crate::{control, identity};

/// Why a node could not start or stopped with an error; one line each.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Configuration problem.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Data could not be loaded.
    #[error("cannot load data: {0}")]
    Data(p2ptrain_models::Error),
    /// Device unavailable.
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// The data shard asked for is empty.
    #[error("{0}")]
    Shard(String),
    /// The private network key is missing or malformed.
    #[error("{0}")]
    Psk(String),
    /// The access token given cannot be sent in an HTTP header.
    #[error("--api-token (or P2PTRAIN_API_TOKEN) must be printable ASCII without spaces")]
    ApiToken,
    /// Control API could not be served.
    #[error(transparent)]
    Api(#[from] control::BindError),
    /// The node's identity key could not be loaded or created.
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    /// The data directory is unusable.
    #[error("{0}")]
    DataDir(String),
    /// The checkpoint store failed.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The trainer failed.
    #[error("trainer: {0}")]
    Trainer(String),
    /// The network could not start.
    #[error(transparent)]
    Network(#[from] crate::network::NetError),
    /// The network task ended while the node ran: a bug, never a peer's doing; the node
    /// stops (its final checkpoint written) rather than train on unheard.
    #[error("the network task stopped: {0}")]
    NetworkStopped(String),
    /// A fresh joiner reached only peers of another run.
    #[error(transparent)]
    Join(#[from] crate::transfer::JoinError),
}
