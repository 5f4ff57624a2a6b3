//! `p2ptrain bench`: the benchmarks, one module each, every one writing JSON. Timing belongs
//! here, never in a test's pass/fail.
//!
//! - [`trainer`]: steps/s of the trainer inside a running daemon against a bare Candle loop;
//! - [`step`]: one training step of each model and optimizer against PyTorch eager;
//! - [`mesh`]: a local mesh per update codec (bytes, accuracy, consensus);
//! - [`scaling`]: time to a target against one node alone, every sync mode and PyTorch DDP;
//! - [`sim`]: the mesh core's simulator at sizes no lab can start.

pub mod mesh;
pub mod scaling;
pub mod sim;
pub mod step;
pub mod trainer;
