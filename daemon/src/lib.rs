//! The p2ptrain node runtime.
//!
//! A node trains a model on its own OS thread ([`trainer`]), keeps checkpoints on disk
//! ([`store`], in the format of [`checkpoint`]), and answers a local HTTP + JSON control API
//! ([`control`]); [`node`] wires them together. Configuration is read and validated by
//! [`config`]. The CLI in `cli/` is a thin layer over this library.

pub mod checkpoint;
pub mod config;
pub mod control;
pub mod device;
pub mod guard;
pub mod identity;
pub mod mesh;
pub mod nat;
pub mod network;
pub mod node;
pub mod policy;
pub mod scoring;
pub mod status;
pub mod store;
pub mod sync_guard;
pub mod trainer;
pub mod transfer;
pub mod wire;

pub use config::Config;
