//! Integration tests: real `p2ptrain` processes on 127.0.0.1, real data, real files.
//! One test binary (so the suite links once), one module per area.
//!
//! libtest starts tests in the order of their names, as many at once as there are cores, and
//! a test waiting for the cores' lock (`harness::cpu_sensitive`) holds its thread while it
//! waits. So a test that needs the cores to itself must not come right after a long one that
//! loads them: the flood test (`rogue_flood`) once came right after the churn test and waited
//! out its 190 s with one of CI's two test threads, while nothing else ran beside the churn.

mod bench;
mod churn;
mod docs;
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
mod rogue_flood;
mod single_node;
mod skewed;
mod soak;
mod text;
