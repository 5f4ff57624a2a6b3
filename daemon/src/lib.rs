//! The p2ptrain node runtime: everything `p2ptrain join` runs, as a library the CLI in `cli/`
//! is a thin layer over.
//!
//! The path through it is config → node → actors:
//!
//! - [`config`] reads the TOML file, merges the command line's overrides and validates the
//!   result into one typed [`Config`]; [`device`] parses and opens the compute device.
//! - [`node`] prepares data, model and device, then starts the actors and owns start-up and
//!   shutdown order; the state they share is a [`handle::NodeHandle`].
//! - The actors: the [`network`] event loop (owns the libp2p swarm; [`nat`] for reachability;
//!   the byte formats in [`wire`]), the [`mesh`] actor (carries out what the IO-less
//!   [`mesh_core`] decides: membership, neighbours, the sync [`policy`], update and sync
//!   guards ([`guard`], [`sync_guard`]), offences for [`scoring`]; and serves state
//!   [`transfer`]s to joiners), the [`trainer`] thread (model, optimizer, data, device; it only
//!   computes), the checkpoint writer ([`store`], in the file format of [`checkpoint`]), and
//!   the [`control`] API (HTTP + JSON, speaking the shapes of [`status`]; Prometheus metrics
//!   from [`prometheus`]; a live page).
//! - [`identity`] keeps the node's key, and so its peer id, across restarts; [`memory`] reports
//!   the node's own memory; [`timeline`] writes spans of its work as a Chrome trace.

pub mod atomic_file;
pub mod checkpoint;
pub mod config;
pub mod control;
pub mod device;
#[cfg(test)]
mod fuzz;
pub mod guard;
pub mod handle;
pub mod identity;
#[cfg(test)]
mod import_scan;
pub mod memory;
pub mod mesh;
pub mod mesh_core;
pub mod nat;
pub mod network;
pub mod node;
pub mod policy;
pub mod prometheus;
pub mod ring_attack;
pub mod scoring;
pub mod serving;
pub mod status;
pub mod store;
pub mod sync_guard;
pub mod timeline;
pub mod trainer;
pub mod transfer;
pub mod wire;

pub use config::Config;
