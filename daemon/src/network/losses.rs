//! Why members were lost: the network's count of members that left it, by how this node
//! learnt they were gone. Each cause has its own clock by construction: a goodbye and a closed
//! connection are seen at once, silence only after [`super::SILENT_AFTER`], a ban when the
//! peer's score crosses the line. So a test or an operator can tell from status *how* a peer
//! went (a crashed box seen by its reset connections, a hung one only by the ping timeout)
//! without timing it.

use serde::{Deserialize, Serialize};

/// How this node learnt that a member was gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossCause {
    /// It said goodbye (`p2ptrain leave`): not a drop.
    Goodbye,
    /// Nothing heard from it (no ping answer, gossip or bulk message) for `SILENT_AFTER`.
    Silent,
    /// Its last direct connection closed (a crash resets them at once).
    Closed,
    /// This node banned it.
    Banned,
}

/// Members lost since this node started, by cause (status `peer_losses`). Losses while this
/// node itself is leaving are not counted: its members then close their connections to it,
/// as they should.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerLosses {
    /// Members that said goodbye.
    #[serde(default)]
    pub goodbyes: u64,
    /// Members dropped for silence.
    #[serde(default)]
    pub silent: u64,
    /// Members dropped when their last direct connection closed.
    #[serde(default)]
    pub closed: u64,
    /// Members dropped because this node banned them.
    #[serde(default)]
    pub banned: u64,
}

impl PeerLosses {
    /// Counts one member lost for `cause`, unless this node is `leaving`.
    pub fn count(&mut self, cause: LossCause, leaving: bool) {
        if leaving {
            return;
        }
        let counter = match cause {
            LossCause::Goodbye => &mut self.goodbyes,
            LossCause::Silent => &mut self.silent,
            LossCause::Closed => &mut self.closed,
            LossCause::Banned => &mut self.banned,
        };
        *counter += 1;
    }

    /// Members lost without a goodbye (status `peer_drops`): an honest mesh on a healthy box
    /// never loses one.
    pub fn drops(&self) -> u64 {
        self.silent + self.closed + self.banned
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_has_its_own_count_and_only_goodbyes_are_not_drops() {
        let mut losses = PeerLosses::default();
        for cause in [
            LossCause::Goodbye,
            LossCause::Silent,
            LossCause::Closed,
            LossCause::Closed,
            LossCause::Banned,
        ] {
            losses.count(cause, false);
        }
        assert_eq!(
            losses,
            PeerLosses {
                goodbyes: 1,
                silent: 1,
                closed: 2,
                banned: 1
            }
        );
        assert_eq!(losses.drops(), 4);
    }

    #[test]
    fn nothing_is_counted_while_this_node_leaves() {
        let mut losses = PeerLosses::default();
        losses.count(LossCause::Closed, true);
        losses.count(LossCause::Goodbye, true);
        assert_eq!(losses, PeerLosses::default());
    }
}
