//! Models, data and optimizers for p2ptrain, on Candle alone.
//!
//! This crate owns everything numeric a node does: loading data sets, building a model with
//! deterministic weights, one training step, evaluation, the optimizers whose state can be
//! saved and shipped to another node, and the name-sorted flat view of the parameters that
//! every node of a run must agree on. It knows nothing about threads, sockets or disks beyond
//! reading a data file: the daemon wires it to those.

pub mod cnn;
pub mod codec;
pub mod cpu;
pub mod data;
mod dense;
pub mod error;
#[doc(hidden)]
pub mod fuzz_report;
pub mod generate;
pub mod gpt;
pub mod gpu;
pub mod hf;
pub mod init;
pub mod kind;
pub mod llama;
pub mod mlp;
pub mod model;
pub mod optim;
pub mod params;
pub mod replica;
pub mod samples;
pub mod text;
pub mod tokenizer;
pub mod tokens;
pub mod train;

#[cfg(test)]
mod testing;

pub use cnn::CnnSpec;
pub use error::{Error, Result};
pub use mlp::MlpSpec;
pub use model::{Model, ModelSpec};
pub use optim::{Optimizer, OptimizerSpec};
pub use params::{Layout, Params};
