//! The namespace lab (`p2ptrain-netlab`) for the fault tests: built, or skipped with the
//! reason (a failure where `CI=true`).

pub use p2ptrain_netlab::{Firewall, Lab};

/// The lab, or `None` after printing why the test is skipped.
pub fn lab_or_skip(test: &str, n: usize) -> Option<Lab> {
    crate::harness::clean_up_on_signals();
    match Lab::new(n) {
        Ok(lab) => Some(lab),
        Err(why) => {
            crate::harness::skip_or_fail(
                test,
                &format!("cannot build a network-namespace lab here: {why}"),
            );
            None
        }
    }
}
