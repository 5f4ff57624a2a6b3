//! NAT traversal bookkeeping, kept apart from the swarm so its rules can be tested alone:
//! which connections to each peer are direct and which run through a relay, what AutoNAT
//! concluded about this node's reachability, and which relays a private node listens through.
//!
//! The policy it serves (enforced in [`crate::network`]): a relay carries only what it takes
//! to find and hole-punch a peer. Full syncs and state downloads never go through a relay (a
//! bulk request is refused on a relayed connection, and a peer reachable only through a relay
//! is not a member the mesh syncs with); a relayed connection is closed as soon as a direct one
//! exists, or when hole punching fails. Gossip that slips through in between is capped by the
//! relay's own default limits (128 KiB and two minutes per circuit).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use libp2p::autonat::NatStatus;
use libp2p::core::transport::ListenerId;
use libp2p::core::transport::PortUse;
use libp2p::core::ConnectedPoint;
use libp2p::core::Endpoint;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{
    dummy, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm,
};
use libp2p::{Multiaddr, PeerId};
use serde::{Deserialize, Serialize};
use std::task::{Context, Poll};

/// How many relays a private node keeps a reservation with: two, so losing one relay does not
/// make the node unreachable until the next attempt.
pub const RELAYS_WANTED: usize = 2;

/// Pause between attempts to find a relay, and how long a relay that refused is skipped.
pub const RELAY_RETRY: Duration = Duration::from_secs(10);

/// How long a peer whose hole punch failed is not dialled through a relay again: without it,
/// redialling would open a relayed connection, fail to punch and close it, over and over.
pub const NO_PUNCH_FOR: Duration = Duration::from_secs(600);

/// What status reports about reachability and relays.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NatReport {
    /// "public", "private" or "unknown": AutoNAT's conclusion from peers dialling back.
    pub reachability: String,
    /// The address a peer reached this node at, when public.
    pub public_addr: Option<String>,
    /// Addresses through relays this node listens on (only while private).
    pub relay_addrs: Vec<String>,
    /// Whether this node relays for others (with libp2p's default limits), once it knows
    /// itself reachable.
    pub relay_server: bool,
    /// Whether UPnP port mapping is on.
    pub upnp: bool,
    /// The address UPnP mapped on the gateway, if any.
    pub upnp_addr: Option<String>,
    /// Relayed connections opened, either way.
    pub relayed_connections: u64,
    /// Relayed connections that hole punching turned into direct ones.
    pub hole_punches: u64,
    /// Hole punches that failed (the peer stays reachable through the gossip mesh).
    pub hole_punch_failures: u64,
    /// Bulk requests refused because they came over a relayed connection.
    pub relayed_requests_refused: u64,
}

/// One open connection.
#[derive(Debug, Clone)]
struct Link {
    id: ConnectionId,
    relayed: bool,
    remote: Multiaddr,
    dialed: bool,
    /// When this node closes it: an AutoNAT dial-back whose probe is answered
    /// ([`Links::spend_dial_back`]).
    close_at: Option<Instant>,
    /// Requests of the peer's that arrived on it and are not answered yet: a spent dial-back
    /// closes only without any ([`Links::due_to_close`]).
    unanswered: u32,
}

/// How long a dial-back whose probe is answered stays open: the dialler counts the dial-back
/// a success once its side of the handshake is done (multistream-select's lazy mode), before
/// the other side has finished its own; closed at once, the other side saw its handshake
/// break off and took it for a wrong network key. The handshake takes a few round trips.
pub const DIAL_BACK_GRACE: Duration = Duration::from_secs(5);

/// How long past its grace a spent dial-back waits for this node's requests to the peer to
/// be answered (any of them may travel on it) before it closes regardless: a ring's hops
/// can be in flight at nearly every moment, and a dial-back left open for good let the
/// per-peer limit refuse the next one (see [`Links::spend_dial_back`]). A request lost so
/// is asked again by its caller (a state chunk, a hop's attempt).
pub const DIAL_BACK_PATIENCE: Duration = Duration::from_secs(30);

/// Open connections by peer, each marked direct or relayed.
#[derive(Debug, Default)]
pub struct Links {
    by_peer: HashMap<PeerId, Vec<Link>>,
}

impl Links {
    /// Records a new connection.
    pub fn opened(&mut self, peer: PeerId, id: ConnectionId, endpoint: &ConnectedPoint) {
        let link = Link {
            id,
            relayed: endpoint.is_relayed(),
            remote: endpoint.get_remote_address().clone(),
            dialed: endpoint.is_dialer(),
            close_at: None,
            unanswered: 0,
        };
        self.by_peer.entry(peer).or_default().push(link);
    }

    /// Forgets a closed connection.
    pub fn closed(&mut self, peer: &PeerId, id: ConnectionId) {
        if let Some(links) = self.by_peer.get_mut(peer) {
            links.retain(|l| l.id != id);
            if links.is_empty() {
                self.by_peer.remove(peer);
            }
        }
    }

    /// Whether any connection to `peer` is open.
    pub fn connected(&self, peer: &PeerId) -> bool {
        self.by_peer.contains_key(peer)
    }

    /// How many connections to `peer` are open.
    pub fn count(&self, peer: &PeerId) -> u32 {
        self.by_peer.get(peer).map_or(0, |l| l.len() as u32)
    }

    /// Whether a connection to `peer` runs without a relay.
    pub fn has_direct(&self, peer: &PeerId) -> bool {
        self.by_peer
            .get(peer)
            .is_some_and(|l| l.iter().any(|l| !l.relayed))
    }

    /// Whether connection `id` runs through a relay.
    pub fn is_relayed(&self, peer: &PeerId, id: ConnectionId) -> bool {
        self.by_peer
            .get(peer)
            .and_then(|l| l.iter().find(|l| l.id == id))
            .is_some_and(|l| l.relayed)
    }

    /// The relayed connections to `peer`.
    pub fn relayed(&self, peer: &PeerId) -> Vec<ConnectionId> {
        self.by_peer
            .get(peer)
            .map(|l| l.iter().filter(|l| l.relayed).map(|l| l.id).collect())
            .unwrap_or_default()
    }

    /// "direct" if any connection to `peer` is direct, "relayed" if all go through relays.
    pub fn path(&self, peer: &PeerId) -> Option<&'static str> {
        let links = self.by_peer.get(peer)?;
        Some(if links.iter().any(|l| !l.relayed) {
            "direct"
        } else {
            "relayed"
        })
    }

    /// The address the connection to `peer` runs to, direct ones first: for a peer behind a
    /// NAT that dialled us, its gateway's address, not the one it listens on.
    pub fn remote(&self, peer: &PeerId) -> Option<String> {
        let links = self.by_peer.get(peer)?;
        links
            .iter()
            .find(|l| !l.relayed)
            .or(links.first())
            .map(|l| l.remote.to_string())
    }

    /// The connection this node dialled to `peer` at `address` to answer its AutoNAT probe
    /// (the dial-back) is spent now that the probe is answered: it is closed
    /// [`DIAL_BACK_GRACE`] from `now` ([`Links::due_to_close`]). Left open, every probe
    /// (each 15 s until the verdict is sure, then each 5 min, in both directions) added a
    /// connection that gossip's streams kept alive, until the per-peer limit refused the
    /// next dial-back and the probe failed.
    pub fn spend_dial_back(&mut self, peer: &PeerId, address: &Multiaddr, now: Instant) {
        let Some(links) = self.by_peer.get_mut(peer) else {
            return;
        };
        if let Some(dial_back) = links
            .iter_mut()
            .rev()
            .find(|l| l.dialed && !l.relayed && &l.remote == address)
        {
            dial_back.close_at = Some(now + DIAL_BACK_GRACE);
        }
    }

    /// The spent dial-backs due to close at `now`, each only while another direct
    /// connection to its peer stays (never a peer's last direct connection) and nothing is in
    /// flight on it: no request of the peer's that arrived on it unanswered, and no answer
    /// this node awaits from the peer (`awaiting`: libp2p picks which of a peer's
    /// connections carries a request, so any of them may carry this node's), the latter for
    /// at most [`DIAL_BACK_PATIENCE`].
    pub fn due_to_close(&self, now: Instant, awaiting: &HashSet<PeerId>) -> Vec<ConnectionId> {
        self.by_peer
            .iter()
            .flat_map(|(peer, links)| {
                let awaited = awaiting.contains(peer);
                links.iter().filter(move |l| {
                    l.close_at
                        .is_some_and(|at| at <= now && (!awaited || at + DIAL_BACK_PATIENCE <= now))
                        && l.unanswered == 0
                        && links
                            .iter()
                            .any(|o| o.id != l.id && !o.relayed && o.close_at.is_none())
                })
            })
            .map(|l| l.id)
            .collect()
    }

    /// A request of `peer`'s arrived on connection `id`.
    pub fn request_arrived(&mut self, peer: &PeerId, id: ConnectionId) {
        if let Some(link) = self.link_mut(peer, id) {
            link.unanswered += 1;
        }
    }

    /// A request of `peer`'s that arrived on connection `id` is answered (or failed).
    pub fn request_answered(&mut self, peer: &PeerId, id: ConnectionId) {
        if let Some(link) = self.link_mut(peer, id) {
            link.unanswered = link.unanswered.saturating_sub(1);
        }
    }

    fn link_mut(&mut self, peer: &PeerId, id: ConnectionId) -> Option<&mut Link> {
        self.by_peer.get_mut(peer)?.iter_mut().find(|l| l.id == id)
    }

    /// An address this node reached `peer` at directly: a relay candidate, since at least
    /// this node can reach it.
    pub fn dialed_addr(&self, peer: &PeerId) -> Option<Multiaddr> {
        self.by_peer
            .get(peer)?
            .iter()
            .find(|l| l.dialed && !l.relayed)
            .map(|l| l.remote.clone())
    }
}

/// Reachability and relay state; see the module docs.
#[derive(Debug)]
pub struct Nat {
    status: NatStatus,
    relay_listeners: HashMap<ListenerId, PeerId>,
    next_relay_try: Instant,
    refused_relays: HashMap<PeerId, Instant>,
    relay_server: bool,
    upnp: bool,
    upnp_addr: Option<Multiaddr>,
    /// Relayed connections opened.
    pub relayed_connections: u64,
    /// Successful hole punches.
    pub hole_punches: u64,
    /// Failed hole punches.
    pub hole_punch_failures: u64,
    /// Bulk requests refused on relayed connections.
    pub relayed_requests_refused: u64,
}

impl Nat {
    /// Fresh state: reachability unknown until AutoNAT's first probes.
    pub fn new(relay_server: bool, upnp: bool) -> Self {
        Nat {
            status: NatStatus::Unknown,
            relay_listeners: HashMap::new(),
            next_relay_try: Instant::now(),
            refused_relays: HashMap::new(),
            relay_server,
            upnp,
            upnp_addr: None,
            relayed_connections: 0,
            hole_punches: 0,
            hole_punch_failures: 0,
            relayed_requests_refused: 0,
        }
    }

    /// AutoNAT's new conclusion. Returns the relay listeners to close when the node turned
    /// out to be reachable after all.
    pub fn set_status(&mut self, status: NatStatus) -> Vec<ListenerId> {
        self.status = status;
        if self.status.is_public() {
            self.relay_listeners.drain().map(|(id, _)| id).collect()
        } else {
            Vec::new()
        }
    }

    /// Whether this node is known to be unreachable.
    pub fn is_private(&self) -> bool {
        self.status == NatStatus::Private
    }

    /// Picks a relay to listen through if this node is private, has fewer than
    /// [`RELAYS_WANTED`] and the last attempt is [`RELAY_RETRY`] ago. `candidates` are peers
    /// with the address this node reached them at directly.
    pub fn pick_relay(
        &mut self,
        now: Instant,
        candidates: impl IntoIterator<Item = (PeerId, Multiaddr)>,
    ) -> Option<(PeerId, Multiaddr)> {
        if !self.is_private()
            || self.relay_listeners.len() >= RELAYS_WANTED
            || now < self.next_relay_try
        {
            return None;
        }
        self.refused_relays.retain(|_, until| *until > now);
        let mut candidates: Vec<(PeerId, Multiaddr)> = candidates
            .into_iter()
            .filter(|(p, _)| {
                !self.refused_relays.contains_key(p)
                    && !self.relay_listeners.values().any(|r| r == p)
            })
            .collect();
        candidates.sort_by_key(|(p, _)| p.to_bytes());
        let (peer, addr) = candidates.into_iter().next()?;
        self.next_relay_try = now + RELAY_RETRY;
        // The address without any trailing /p2p, then the relay's id and the circuit marker.
        let base: Multiaddr = addr
            .iter()
            .filter(|p| !matches!(p, Protocol::P2p(_)))
            .collect();
        Some((
            peer,
            base.with(Protocol::P2p(peer)).with(Protocol::P2pCircuit),
        ))
    }

    /// A listener through `relay` was opened.
    pub fn relay_listening(&mut self, id: ListenerId, relay: PeerId) {
        self.relay_listeners.insert(id, relay);
    }

    /// A listener closed; returns the relay if it was a relay listener (which is then skipped
    /// for [`RELAY_RETRY`]).
    pub fn listener_closed(&mut self, id: ListenerId, now: Instant) -> Option<PeerId> {
        let relay = self.relay_listeners.remove(&id)?;
        self.refused_relays.insert(relay, now + RELAY_RETRY);
        Some(relay)
    }

    /// UPnP mapped an address on the gateway (or the mapping expired: `None`).
    pub fn set_upnp_addr(&mut self, addr: Option<Multiaddr>) {
        self.upnp_addr = addr;
    }

    /// The status report; the relay addresses are the circuits among `listen_addrs`.
    pub fn report(&self, listen_addrs: &[Multiaddr]) -> NatReport {
        let (reachability, public_addr) = match &self.status {
            NatStatus::Public(a) => ("public", Some(a.to_string())),
            NatStatus::Private => ("private", None),
            NatStatus::Unknown => ("unknown", None),
        };
        let mut relay_addrs: Vec<String> = listen_addrs
            .iter()
            .filter(|a| is_circuit(a))
            .map(|a| a.to_string())
            .collect();
        relay_addrs.sort();
        NatReport {
            reachability: reachability.into(),
            public_addr,
            relay_addrs,
            relay_server: self.relay_server,
            upnp: self.upnp,
            upnp_addr: self.upnp_addr.as_ref().map(|a| a.to_string()),
            relayed_connections: self.relayed_connections,
            hole_punches: self.hole_punches,
            hole_punch_failures: self.hole_punch_failures,
            relayed_requests_refused: self.relayed_requests_refused,
        }
    }
}

/// Why [`RelayGate`] refused a connection.
#[derive(Debug, thiserror::Error)]
#[error("relayed connection with {0} refused: hole punching to it failed recently")]
pub struct RelayGated(pub PeerId);

/// Refuses relayed connections with peers that could not be reached directly lately, for
/// [`NO_PUNCH_FOR`]. Without it, every Kademlia walk (each 30 s) would reach such a peer
/// through a relay again and start another hole punch that cannot work. The refusal comes
/// before any protocol runs on the connection.
#[derive(Debug, Default)]
pub struct RelayGate {
    blocked: HashMap<PeerId, Instant>,
}

impl RelayGate {
    /// A relayed connection with `peer` ended with no direct one in its place: hole punching
    /// failed (on the side that dialled through the relay, that shows only as this).
    pub fn avoid(&mut self, peer: PeerId, now: Instant) {
        self.blocked.retain(|_, until| *until > now);
        self.blocked.insert(peer, now + NO_PUNCH_FOR);
    }

    /// Whether a relayed connection with `peer` may be made now.
    pub fn allows(&self, peer: &PeerId, now: Instant) -> bool {
        self.blocked.get(peer).is_none_or(|until| *until <= now)
    }

    fn check(
        &self,
        peer: PeerId,
        addr: &Multiaddr,
    ) -> Result<dummy::ConnectionHandler, ConnectionDenied> {
        if is_circuit(addr) && !self.allows(&peer, Instant::now()) {
            Err(ConnectionDenied::new(RelayGated(peer)))
        } else {
            Ok(dummy::ConnectionHandler)
        }
    }
}

impl NetworkBehaviour for RelayGate {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = std::convert::Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        local_addr: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.check(peer, local_addr)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        addr: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.check(peer, addr)
    }

    fn on_swarm_event(&mut self, _: FromSwarm) {}

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

/// Whether an address runs through a relay.
pub fn is_circuit(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| p == Protocol::P2pCircuit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dialer(addr: &str) -> ConnectedPoint {
        ConnectedPoint::Dialer {
            address: addr.parse().expect("multiaddr"),
            role_override: Endpoint::Dialer,
            port_use: PortUse::Reuse,
        }
    }

    fn listener(send_back: &str, local: &str) -> ConnectedPoint {
        ConnectedPoint::Listener {
            local_addr: local.parse().expect("multiaddr"),
            send_back_addr: send_back.parse().expect("multiaddr"),
        }
    }

    #[test]
    fn a_peer_is_direct_while_any_connection_is_and_relayed_otherwise() {
        let mut links = Links::default();
        let peer = PeerId::random();
        let relay = PeerId::random();
        let circuit = format!("/ip4/10.0.0.1/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{peer}");
        let (c1, c2) = (
            ConnectionId::new_unchecked(1),
            ConnectionId::new_unchecked(2),
        );
        links.opened(peer, c1, &dialer(&circuit));
        assert_eq!(links.path(&peer), Some("relayed"));
        assert!(!links.has_direct(&peer));
        assert!(links.is_relayed(&peer, c1));
        assert_eq!(
            links.dialed_addr(&peer),
            None,
            "a circuit is no relay candidate"
        );
        links.opened(
            peer,
            c2,
            &listener("/ip4/10.0.0.9/tcp/5555", "/ip4/10.0.0.2/tcp/4001"),
        );
        assert_eq!(links.path(&peer), Some("direct"));
        assert_eq!(links.remote(&peer).expect("some"), "/ip4/10.0.0.9/tcp/5555");
        assert_eq!(links.relayed(&peer), vec![c1]);
        links.closed(&peer, c2);
        assert_eq!(links.path(&peer), Some("relayed"));
        links.closed(&peer, c1);
        assert_eq!(links.path(&peer), None);
        assert!(!links.connected(&peer));
    }

    /// Where a peer listens in the dial-back tests.
    const DIAL_BACK_LISTEN: &str = "/ip4/10.0.0.9/tcp/4001";

    /// The dial-back tests' peer (listening at [`DIAL_BACK_LISTEN`]) and its address, the ids
    /// of its first connection and of a dial-back, and when a dial-back is spent and its
    /// grace ends.
    fn dial_back_case() -> (
        PeerId,
        Multiaddr,
        ConnectionId,
        ConnectionId,
        Instant,
        Instant,
    ) {
        let t0 = Instant::now();
        (
            PeerId::random(),
            DIAL_BACK_LISTEN.parse().expect("multiaddr"),
            ConnectionId::new_unchecked(1),
            ConnectionId::new_unchecked(2),
            t0,
            t0 + DIAL_BACK_GRACE,
        )
    }

    /// A dial-back is closed [`DIAL_BACK_GRACE`] after its probe is answered, and only while
    /// another direct connection to the peer stays: never the peer's last direct connection,
    /// never one the peer dialled, never one to another address.
    #[test]
    fn a_spent_dial_back_is_closed_after_a_grace_beside_another_direct_connection() {
        let mut links = Links::default();
        let (peer, address, first, dial_back, t0, after) = dial_back_case();
        links.opened(peer, dial_back, &dialer(DIAL_BACK_LISTEN));
        links.spend_dial_back(&peer, &address, t0);
        assert!(
            links.due_to_close(after, &HashSet::new()).is_empty(),
            "the only connection stays"
        );
        links.opened(
            peer,
            first,
            &listener("/ip4/10.0.0.9/tcp/5555", "/ip4/10.0.0.2/tcp/4001"),
        );
        assert!(
            links.due_to_close(t0, &HashSet::new()).is_empty(),
            "not before the other side's handshake is done"
        );
        assert_eq!(links.due_to_close(after, &HashSet::new()), vec![dial_back]);
        links.closed(&peer, dial_back);
        assert!(links.due_to_close(after, &HashSet::new()).is_empty());
        // Another address, another peer, or a connection the peer dialled: nothing spent.
        links.spend_dial_back(&peer, &"/ip4/10.0.0.9/tcp/4002".parse().expect("addr"), t0);
        links.spend_dial_back(&PeerId::random(), &address, t0);
        links.spend_dial_back(&peer, &"/ip4/10.0.0.9/tcp/5555".parse().expect("addr"), t0);
        links.opened(
            peer,
            ConnectionId::new_unchecked(3),
            &dialer("/ip4/10.0.0.9/tcp/4003"),
        );
        assert!(links.due_to_close(after, &HashSet::new()).is_empty());
    }

    /// A spent dial-back carrying a request is closed only once nothing is in flight on it:
    /// no request of the peer's that arrived on it unanswered, and no request of this node's
    /// to the peer unanswered (which of a peer's connections carries an outbound request is
    /// libp2p's choice, so any of them may), the latter for at most [`DIAL_BACK_PATIENCE`].
    /// (Closed under requests, it failed a joiner's state download at 10 Mbit/s. An answer
    /// sent is not an answer received, nor is a request on its way counted, so this narrows
    /// the window; the requester asks again.)
    #[test]
    fn a_spent_dial_back_closes_only_once_its_requests_are_answered() {
        let mut links = Links::default();
        let (peer, address, first, dial_back, t0, after) = dial_back_case();
        links.opened(
            peer,
            first,
            &listener("/ip4/10.0.0.9/tcp/5555", "/ip4/10.0.0.2/tcp/4001"),
        );
        links.opened(peer, dial_back, &dialer(DIAL_BACK_LISTEN));
        links.spend_dial_back(&peer, &address, t0);
        let none = HashSet::new();
        // Two of the peer's requests arrive on the dial-back, one on the other connection.
        links.request_arrived(&peer, dial_back);
        links.request_arrived(&peer, dial_back);
        links.request_arrived(&peer, first);
        assert!(
            links.due_to_close(after, &none).is_empty(),
            "two requests on it unanswered"
        );
        links.request_answered(&peer, dial_back);
        assert!(
            links.due_to_close(after, &none).is_empty(),
            "one unanswered"
        );
        links.request_answered(&peer, dial_back);
        // This node awaits an answer from the peer: it may come on the dial-back.
        let awaiting: HashSet<PeerId> = [peer].into_iter().collect();
        assert!(
            links.due_to_close(after, &awaiting).is_empty(),
            "this node's request may be on it"
        );
        assert_eq!(
            links.due_to_close(after + DIAL_BACK_PATIENCE, &awaiting),
            vec![dial_back],
            "but not for ever"
        );
        // A request on another connection, or to another peer, holds nothing.
        let elsewhere: HashSet<PeerId> = [PeerId::random()].into_iter().collect();
        assert_eq!(links.due_to_close(after, &elsewhere), vec![dial_back]);
        // An answer for a connection that closed meanwhile, or one never counted, is ignored.
        links.request_answered(&peer, ConnectionId::new_unchecked(9));
        links.request_answered(&PeerId::random(), dial_back);
        links.request_answered(&peer, dial_back);
        assert_eq!(links.due_to_close(after, &none), vec![dial_back]);
    }

    #[test]
    fn a_private_node_picks_relays_it_dialled_and_skips_those_that_refused() {
        let mut nat = Nat::new(true, false);
        let now = Instant::now();
        let a = PeerId::random();
        let addr: Multiaddr = format!("/ip4/10.0.0.1/tcp/4001/p2p/{a}")
            .parse()
            .expect("multiaddr");
        assert!(
            nat.pick_relay(now, [(a, addr.clone())]).is_none(),
            "unknown reachability needs no relay"
        );
        nat.set_status(NatStatus::Private);
        let (relay, circuit) = nat.pick_relay(now, [(a, addr.clone())]).expect("some");
        assert_eq!(relay, a);
        assert_eq!(
            circuit.to_string(),
            format!("/ip4/10.0.0.1/tcp/4001/p2p/{a}/p2p-circuit")
        );
        assert!(
            nat.pick_relay(now, [(a, addr.clone())]).is_none(),
            "paced by RELAY_RETRY"
        );
        let id = ListenerId::next();
        nat.relay_listening(id, a);
        let later = now + RELAY_RETRY;
        assert!(
            nat.pick_relay(later, [(a, addr.clone())]).is_none(),
            "already listening through it"
        );
        let listen = circuit.clone().with(Protocol::P2p(PeerId::random()));
        let direct: Multiaddr = "/ip4/10.0.0.2/tcp/4001".parse().expect("multiaddr");
        assert_eq!(
            nat.report(&[direct.clone(), listen.clone()]).relay_addrs,
            vec![listen.to_string()]
        );
        assert!(nat.report(&[direct]).relay_addrs.is_empty());
        assert_eq!(nat.listener_closed(id, later), Some(a));
        assert!(
            nat.pick_relay(later, [(a, addr.clone())]).is_none(),
            "a relay that closed is skipped for a while"
        );
        assert!(nat.pick_relay(later + RELAY_RETRY, [(a, addr)]).is_some());
    }

    #[test]
    fn turning_public_closes_the_relay_listeners() {
        let mut nat = Nat::new(true, false);
        nat.set_status(NatStatus::Private);
        let id = ListenerId::next();
        nat.relay_listening(id, PeerId::random());
        let closed = nat.set_status(NatStatus::Public(
            "/ip4/10.0.0.3/tcp/1".parse().expect("multiaddr"),
        ));
        assert_eq!(closed, vec![id]);
        let r = nat.report(&[]);
        assert_eq!(r.reachability, "public");
        assert_eq!(r.public_addr.as_deref(), Some("/ip4/10.0.0.3/tcp/1"));
    }

    #[test]
    fn a_failed_hole_punch_refuses_relayed_connections_with_that_peer_for_a_while() {
        let mut gate = RelayGate::default();
        let now = Instant::now();
        let (p, relay) = (PeerId::random(), PeerId::random());
        let circuit: Multiaddr = format!("/ip4/10.0.0.1/tcp/4001/p2p/{relay}/p2p-circuit")
            .parse()
            .expect("multiaddr");
        let direct: Multiaddr = "/ip4/10.0.0.7/tcp/4001".parse().expect("multiaddr");
        assert!(gate.allows(&p, now));
        assert!(gate.check(p, &circuit).is_ok());
        gate.avoid(p, Instant::now());
        assert!(!gate.allows(&p, now + Duration::from_secs(1)));
        assert!(gate.allows(&p, now + NO_PUNCH_FOR + Duration::from_secs(1)));
        let denied = gate.check(p, &circuit).err();
        assert!(denied.is_some_and(|d| d.downcast_ref::<RelayGated>().is_some()));
        assert!(gate.check(p, &direct).is_ok(), "direct connections pass");
        assert!(
            gate.check(PeerId::random(), &circuit).is_ok(),
            "other peers pass"
        );
    }
}
