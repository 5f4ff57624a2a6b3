//! The identity every update and sync message carries in its codec header (run, parameter
//! layout, sender), written and checked in one place: the update path and the full-sync path
//! build headers from the same [`HeaderIds`] and refuse the same faults.

use libp2p::PeerId;
use p2ptrain_models::codec::{self, Codec, UpdateHeader};
use p2ptrain_models::params::Layout;

/// This node's run, layout and name as headers spell them (8 bytes each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HeaderIds {
    run: [u8; 8],
    layout: [u8; 8],
    me: [u8; 8],
}

/// Why a header does not fit this node's run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HeaderFault {
    /// It names another run.
    Run,
    /// It was computed on another parameter layout (these bytes of its hash).
    Layout([u8; 8]),
    /// It names a sender other than the peer it came from.
    Sender,
}

impl HeaderIds {
    /// The ids of node `me` in run `run_id` (hex) with parameters laid out as `layout`.
    pub(super) fn new(me: &PeerId, run_id: &str, layout: &Layout) -> HeaderIds {
        HeaderIds {
            run: codec::id_bytes(run_id),
            layout: codec::id_bytes(&layout.hash()),
            me: codec::sender_bytes(&me.to_bytes()),
        }
    }

    /// A header of this node's for a message covering `base_step..step`.
    pub(super) fn header(
        &self,
        base_step: u64,
        step: u64,
        codec: Codec,
        numel: u32,
    ) -> UpdateHeader {
        UpdateHeader {
            run_id: self.run,
            layout: self.layout,
            sender: self.me,
            base_step,
            step,
            codec,
            numel,
        }
    }

    /// Whether `header`, received from `sender`, is of this run and layout and names
    /// `sender`; faults in that order.
    pub(super) fn check(&self, header: &UpdateHeader, sender: &PeerId) -> Result<(), HeaderFault> {
        if header.run_id != self.run {
            return Err(HeaderFault::Run);
        }
        if header.layout != self.layout {
            return Err(HeaderFault::Layout(header.layout));
        }
        if header.sender != codec::sender_bytes(&sender.to_bytes()) {
            return Err(HeaderFault::Sender);
        }
        Ok(())
    }
}

/// Whether every value is finite: a NaN or an infinity would spread to every replica that
/// averages it.
pub(super) fn all_finite(values: &[f32]) -> bool {
    values.iter().all(|v| v.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(n: usize) -> Layout {
        Layout {
            entries: vec![("w".into(), vec![n])],
        }
    }

    #[test]
    fn a_header_written_by_a_node_passes_its_peers_check() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let ids_a = HeaderIds::new(&a, "00aa", &layout(4));
        let ids_b = HeaderIds::new(&b, "00aa", &layout(4));
        let h = ids_a.header(1, 2, Codec::Dense, 4);
        assert_eq!(ids_b.check(&h, &a), Ok(()));
    }

    #[test]
    fn another_run_is_the_first_fault_named() {
        let a = PeerId::random();
        let theirs = HeaderIds::new(&a, "00bb", &layout(5)).header(0, 1, Codec::Dense, 5);
        let ours = HeaderIds::new(&PeerId::random(), "00aa", &layout(4));
        assert_eq!(
            ours.check(&theirs, &PeerId::random()),
            Err(HeaderFault::Run)
        );
    }

    #[test]
    fn another_layout_is_named_with_its_hash() {
        let a = PeerId::random();
        let theirs = HeaderIds::new(&a, "00aa", &layout(5)).header(0, 1, Codec::Dense, 5);
        let ours = HeaderIds::new(&PeerId::random(), "00aa", &layout(4));
        assert_eq!(
            ours.check(&theirs, &a),
            Err(HeaderFault::Layout(theirs.layout))
        );
    }

    #[test]
    fn a_header_naming_another_sender_is_refused() {
        let (a, relay) = (PeerId::random(), PeerId::random());
        let theirs = HeaderIds::new(&a, "00aa", &layout(4)).header(0, 1, Codec::Dense, 4);
        let ours = HeaderIds::new(&PeerId::random(), "00aa", &layout(4));
        assert_eq!(ours.check(&theirs, &relay), Err(HeaderFault::Sender));
    }

    #[test]
    fn one_nan_or_infinity_makes_values_unfit() {
        assert!(all_finite(&[0.0, -1.0, 3.5]));
        assert!(!all_finite(&[0.0, f32::NAN]));
        assert!(!all_finite(&[f32::NEG_INFINITY]));
    }
}
