//! Who the event loop lets in, and what it turned away: the protocol string a peer must speak
//! (the run id and the settings members must share), peers refused for speaking another and
//! when their connections close, the private network's key and allowlist in force, and the
//! counts of connections refused or broken off in the handshake that status shows. State of
//! [`super::EventLoop`]: the loop tells it what happened and asks it what to do.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use libp2p::PeerId;

use crate::network::{NetConfig, NetworkStatus};

/// Delay between refusing a peer and closing its connection: the stranger receives this
/// node's identify too, and can say why it was turned away instead of seeing a bare
/// disconnect.
const HANG_UP_AFTER: Duration = Duration::from_millis(500);

/// See the module docs.
pub(super) struct Admission {
    protocol_version: String,
    refused: HashSet<PeerId>,
    refused_count: u64,
    /// Refused peers to disconnect, and when.
    hang_up: Vec<(PeerId, Instant)>,
    /// The private network key's fingerprint, if any.
    psk_fingerprint: Option<String>,
    /// Size of the allowlist, if one is in force.
    allowlist: Option<usize>,
    /// Connections that failed in the security handshake (a wrong or missing network key).
    handshake_failures: u64,
    /// Connections refused (or not dialled) because of the allowlist.
    denied_connections: u64,
    /// Connections refused (or not dialled) at a connection limit.
    over_limit: u64,
}

/// Peers refused for another protocol that are remembered (so not redialled): a public
/// mesh's strangers must not grow the set without bound. A full set starts over: a peer
/// forgotten so is refused again at its next identify.
const REFUSED_KEPT: usize = 4096;

impl Admission {
    /// Admission for a node speaking `protocol_version`, with `cfg`'s key and allowlist.
    pub(super) fn new(cfg: &NetConfig, protocol_version: String) -> Admission {
        Admission {
            protocol_version,
            refused: HashSet::new(),
            refused_count: 0,
            hang_up: Vec::new(),
            psk_fingerprint: cfg.psk.map(|k| k.fingerprint().to_string()),
            allowlist: cfg.allow.as_ref().map(HashSet::len),
            handshake_failures: 0,
            denied_connections: 0,
            over_limit: 0,
        }
    }

    /// The protocol string members speak.
    pub(super) fn protocol_version(&self) -> &str {
        &self.protocol_version
    }

    /// Whether `peer` was refused for speaking another protocol (it is not redialled).
    pub(super) fn is_refused(&self, peer: &PeerId) -> bool {
        self.refused.contains(peer)
    }

    /// `peer` speaks another protocol: it is refused, and its connection closes
    /// [`HANG_UP_AFTER`] from `now`. Answers whether it is newly refused (worth a warning).
    pub(super) fn refuse(&mut self, peer: PeerId, now: Instant) -> bool {
        self.hang_up.push((peer, now + HANG_UP_AFTER));
        if self.refused.len() >= REFUSED_KEPT && !self.refused.contains(&peer) {
            self.refused.clear();
        }
        let new = self.refused.insert(peer);
        if new {
            self.refused_count += 1;
        }
        new
    }

    /// The refused peers whose connections are due to close at `now`, forgotten here.
    pub(super) fn hang_ups_due(&mut self, now: Instant) -> Vec<PeerId> {
        let due = self
            .hang_up
            .iter()
            .filter(|(_, t)| *t <= now)
            .map(|(p, _)| *p)
            .collect();
        self.hang_up.retain(|(_, t)| *t > now);
        due
    }

    /// A connection was refused, or not dialled, because the peer is not on the allowlist.
    pub(super) fn denied(&mut self) {
        self.denied_connections += 1;
    }

    /// A connection was refused, or not dialled, at a connection limit; answers whether
    /// that is worth a warning (the first time, and then at each doubling of the count).
    pub(super) fn over_limit(&mut self) -> bool {
        self.over_limit += 1;
        self.over_limit.is_power_of_two()
    }

    /// A connection broke off in the security handshake.
    pub(super) fn handshake_failed(&mut self) {
        self.handshake_failures += 1;
    }

    /// What a failed handshake most likely means, for the log: the commonest cause on a
    /// private network is a key mismatch, which pnet itself cannot detect (both sides just
    /// see garbage once the nonces are exchanged).
    pub(super) fn key_hint(&self) -> String {
        match &self.psk_fingerprint {
            Some(f) => format!(
                "this node is on a private network (PSK fingerprint {f}): the peer may use another key, or none"
            ),
            None => "this node has no network key (--psk): if the peer runs a private network, this node needs its key".into(),
        }
    }

    /// Fills in what status shows of admission.
    pub(super) fn report(&self, status: &mut NetworkStatus) {
        status.refused_peers = self.refused_count;
        status.psk_fingerprint = self.psk_fingerprint.clone();
        status.allowlist = self.allowlist;
        status.handshake_failures = self.handshake_failures;
        status.denied_connections = self.denied_connections;
        status.connections_over_limit = self.over_limit;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission() -> Admission {
        Admission {
            protocol_version: "p2ptrain/run/1".into(),
            refused: HashSet::new(),
            refused_count: 0,
            hang_up: Vec::new(),
            psk_fingerprint: None,
            allowlist: None,
            handshake_failures: 0,
            denied_connections: 0,
            over_limit: 0,
        }
    }

    /// A peer of another protocol is refused once however often it identifies, and its
    /// connection is closed after the delay, once.
    #[test]
    fn a_refused_peer_is_counted_once_and_hung_up_after_the_delay() {
        let mut a = admission();
        let (p, t0) = (PeerId::random(), Instant::now());
        assert!(a.refuse(p, t0));
        assert!(!a.refuse(p, t0));
        assert!(a.is_refused(&p) && !a.is_refused(&PeerId::random()));
        assert!(a.hang_ups_due(t0).is_empty());
        let due = a.hang_ups_due(t0 + HANG_UP_AFTER);
        assert_eq!(due, vec![p, p]);
        assert!(a.hang_ups_due(t0 + 2 * HANG_UP_AFTER).is_empty());
        let mut status = NetworkStatus::default();
        a.denied();
        a.handshake_failed();
        let warned: Vec<bool> = (0..5).map(|_| a.over_limit()).collect();
        a.report(&mut status);
        assert_eq!(
            (
                status.refused_peers,
                status.denied_connections,
                status.handshake_failures,
                status.connections_over_limit
            ),
            (1, 1, 1, 5)
        );
        assert_eq!(
            warned,
            [true, true, false, true, false],
            "warned at 1, 2, 4"
        );
    }

    /// Strangers of another protocol are remembered up to a bound, and counted all the same.
    #[test]
    fn the_refused_set_stays_bounded() {
        let mut a = admission();
        let t0 = Instant::now();
        for _ in 0..REFUSED_KEPT + 10 {
            a.refuse(PeerId::random(), t0);
        }
        assert!(a.refused.len() <= REFUSED_KEPT);
        assert_eq!(a.refused_count, (REFUSED_KEPT + 10) as u64);
        a.hang_ups_due(t0 + HANG_UP_AFTER);
        assert!(a.hang_up.is_empty());
    }
}
