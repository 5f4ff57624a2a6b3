//! Integration tests: real `p2ptrain` processes on 127.0.0.1, real data, real files.
//! One test binary (so the suite links once), one module per area.

mod bench;
mod churn;
mod docs;
mod flood;
mod harness;
mod hostile_sync;
mod join;
mod llama;
mod local;
mod mesh;
mod modes;
mod nat;
mod netlab;
mod observe;
mod partition;
mod private;
mod report;
mod ring_rogue;
mod rogue;
mod single_node;
mod skewed;
mod soak;
mod text;
