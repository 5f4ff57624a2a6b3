//! How the event loop reacts to what the swarm reports: connections opening and closing
//! (direct or relayed), dial and listen failures (told apart for the log: a ban, the
//! allowlist, a handshake that most likely failed on the network key), and each protocol's
//! events (identify admits members of this run and refuses the rest; ping, gossip and bulk
//! messages prove a member alive; AutoNAT, relay, DCUtR and UPnP feed the NAT state, and an
//! AutoNAT dial-back this node made is closed a little after its probe is answered).

use std::time::Instant;

use libp2p::swarm::{ConnectionId, SwarmEvent};
use libp2p::{
    allow_block_list, autonat, dcutr, gossipsub, identify, kad, mdns, ping, relay,
    request_response, upnp, PeerId,
};

use super::EventLoop;
use crate::nat;
use crate::network::behaviour::BehaviourEvent;
use crate::network::losses::LossCause;
use crate::network::peer_book::{ip_of, ADDRS_MAX};
use crate::network::{BulkRequest, BulkResponse, Event, NetError, PeerInfo};

/// Whether a connection error happened in the handshake (pnet, noise or protocol
/// negotiation) rather than in reaching the address.
fn looks_like_handshake_failure(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    [
        "handshake",
        "noise",
        "decrypt",
        "multistream",
        "negotiat",
        "invalid",
        "unexpected eof",
        "connection reset",
    ]
    .iter()
    .any(|k| t.contains(k))
        && !t.contains("timeout")
        && !nothing_answers(text)
}

/// Whether a dial failed because nothing answers at the address (refused, unreachable): a
/// stopped member, not a key mismatch, so such a failure gets no `--psk` hint.
fn nothing_answers(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    ["connection refused", "unreachable", "no route to host"]
        .iter()
        .any(|k| t.contains(k))
}

impl EventLoop {
    /// Tracks which connections are relayed and keeps the relay for signalling only: a
    /// relayed connection is closed once a direct one to the same peer exists.
    fn on_connection_opened(
        &mut self,
        peer: PeerId,
        id: libp2p::swarm::ConnectionId,
        endpoint: &libp2p::core::ConnectedPoint,
    ) {
        self.links.opened(peer, id, endpoint);
        if endpoint.is_relayed() {
            self.nat.relayed_connections += 1;
            tracing::info!(peer = %peer, "relayed connection via {}", endpoint.get_remote_address());
            if self.links.has_direct(&peer) {
                let _ = self.swarm.close_connection(id);
            }
        } else {
            for relayed in self.links.relayed(&peer) {
                tracing::debug!(peer = %peer, "direct connection up; closing the relayed one");
                let _ = self.swarm.close_connection(relayed);
            }
        }
    }

    pub(super) fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        self.record_metrics(&event);
        match &event {
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            } => self.on_connection_opened(*peer_id, *connection_id, endpoint),
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                ..
            } => {
                let was_relayed = self.links.is_relayed(peer_id, *connection_id);
                self.links.closed(peer_id, *connection_id);
                if was_relayed && !self.links.has_direct(peer_id) {
                    // Hole punching failed (on the side that dialled through the relay it
                    // shows only as this), or the relay's limits cut the circuit.
                    self.swarm
                        .behaviour_mut()
                        .relay_gate
                        .avoid(*peer_id, Instant::now());
                }
            }
            _ => {}
        }
        match event {
            SwarmEvent::NewListenAddr { address, .. } => {
                if self.listen_addrs.contains(&address) {
                    // A renewed relay reservation announces its address again.
                    return;
                }
                if nat::is_circuit(&address) {
                    tracing::info!("reachable through a relay at {address}");
                } else {
                    tracing::info!("listening on {address}/p2p/{}", self.swarm.local_peer_id());
                }
                self.listen_addrs.push(address);
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                addresses,
            } => {
                self.listen_addrs.retain(|a| !addresses.contains(a));
                if let Some(relay) = self.nat.listener_closed(listener_id, Instant::now()) {
                    match reason {
                        Ok(()) => {
                            tracing::info!(relay = %relay, "no longer listening through relay")
                        }
                        Err(e) => {
                            tracing::warn!(relay = %relay, "relay reservation failed or ended: {e}")
                        }
                    }
                }
            }
            SwarmEvent::ExternalAddrConfirmed { address } => {
                tracing::info!("peers reach this node at {address}");
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.listen_addrs.retain(|a| a != &address)
            }
            SwarmEvent::ConnectionEstablished { peer_id, .. }
                if self.admission.is_refused(&peer_id) =>
            {
                let _ = self.swarm.disconnect_peer_id(peer_id);
            }
            SwarmEvent::ConnectionClosed { peer_id, .. } => {
                if !self.links.connected(&peer_id) {
                    self.relayed_members.remove(&peer_id);
                    // Its next identify says again whether it relays.
                    self.relay_capable.remove(&peer_id);
                }
                if !self.links.has_direct(&peer_id) {
                    if let Some(info) = self.members.remove(&peer_id) {
                        self.last_heard.remove(&peer_id);
                        tracing::info!(peer = %peer_id, "peer gone");
                        self.losses.count(LossCause::Closed, self.leaving);
                        if self.links.connected(&peer_id) {
                            self.relayed_members.insert(peer_id, info);
                        }
                        self.emit(Event::PeerDown(peer_id));
                    }
                }
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                self.on_dial_failed(peer_id, &error)
            }
            SwarmEvent::IncomingConnectionError {
                send_back_addr,
                error,
                ..
            } => self.on_incoming_failed(&send_back_addr, &error),
            SwarmEvent::Behaviour(event) => self.on_behaviour_event(event),
            _ => {}
        }
    }

    /// A dial failed: said plainly, with the likely cause (a ban, a gate, the allow list, a
    /// missing or wrong network key, a member that stopped).
    fn on_dial_failed(&mut self, peer_id: Option<PeerId>, error: &libp2p::swarm::DialError) {
        let text = error.to_string();
        if let libp2p::swarm::DialError::Denied { cause, .. } = error {
            if cause.downcast_ref::<nat::RelayGated>().is_some() {
                tracing::debug!(peer = ?peer_id, "not connecting through a relay: hole punching failed recently");
                return;
            }
        }
        if let libp2p::swarm::DialError::Denied { cause, .. } = error {
            if cause.downcast_ref::<allow_block_list::Blocked>().is_some() {
                tracing::debug!(peer = ?peer_id, "not connecting: the peer is banned");
                return;
            }
        }
        if let libp2p::swarm::DialError::Denied { cause, .. } = error {
            if let Some(limit) = cause.downcast_ref::<libp2p::connection_limits::Exceeded>() {
                if self.admission.over_limit() {
                    tracing::warn!(peer = ?peer_id, "not connecting: {limit}");
                }
                return;
            }
        }
        if matches!(error, libp2p::swarm::DialError::Denied { .. }) {
            self.admission.denied();
            tracing::warn!(peer = ?peer_id, "not connecting: the peer is not on network.allow");
        } else if looks_like_handshake_failure(&text) {
            self.admission.handshake_failed();
            tracing::warn!(peer = ?peer_id, "handshake with a peer failed: {text}; {}", self.admission.key_hint());
        } else if peer_id.is_some_and(|p| self.bootstrap_peers.contains(&p)) || peer_id.is_none() {
            // A PSK mismatch can also look like a timeout (one side waits for a
            // protocol answer the other cannot decrypt), so the hint goes here too;
            // a refused connection only means nothing listens there any more.
            let hint = if nothing_answers(&text) {
                "nothing listens there: the member may have stopped".to_string()
            } else {
                self.admission.key_hint()
            };
            tracing::warn!(peer = ?peer_id, "cannot reach a bootstrap member: {text}; {hint}");
        } else {
            tracing::debug!(peer = ?peer_id, "dial failed: {text}");
        }
    }

    /// An incoming connection failed: refused (a ban, a gate, the allow list) or broken off
    /// in the handshake (a banned peer redialling, or a network key that differs).
    fn on_incoming_failed(
        &mut self,
        send_back_addr: &libp2p::Multiaddr,
        error: &libp2p::swarm::ListenError,
    ) {
        let text = error.to_string();
        if let libp2p::swarm::ListenError::Denied { cause } = error {
            if cause.downcast_ref::<nat::RelayGated>().is_some() {
                tracing::debug!(from = %send_back_addr, "refused a relayed connection: hole punching failed recently");
                return;
            }
        }
        if let libp2p::swarm::ListenError::Denied { cause } = error {
            if let Some(b) = cause.downcast_ref::<allow_block_list::Blocked>() {
                let why = self.book.ban_text(&b.to_string(), Instant::now());
                tracing::info!(from = %send_back_addr, "refused a connection: {why}");
                return;
            }
        }
        if let libp2p::swarm::ListenError::Denied { cause } = error {
            if let Some(limit) = cause.downcast_ref::<libp2p::connection_limits::Exceeded>() {
                if self.admission.over_limit() {
                    tracing::warn!(from = %send_back_addr, "refused a connection: {limit}");
                }
                return;
            }
        }
        let banned_there = ip_of(send_back_addr).and_then(|ip| self.book.banned_at(ip));
        if matches!(error, libp2p::swarm::ListenError::Denied { .. }) {
            self.admission.denied();
            tracing::warn!(from = %send_back_addr, "refused a connection: the peer is not on network.allow");
        } else if let (true, Some(p)) = (looks_like_handshake_failure(&text), banned_there) {
            tracing::info!(from = %send_back_addr, "an incoming connection broke off during the handshake ({text}): most likely banned peer {p} redialling, whose connections are refused for the ban");
        } else if looks_like_handshake_failure(&text) {
            self.admission.handshake_failed();
            tracing::warn!(from = %send_back_addr, "handshake with an incoming peer failed: {text}; {}", self.admission.key_hint());
        } else {
            tracing::debug!(from = %send_back_addr, "incoming connection failed: {text}");
        }
    }

    /// Counts the event in libp2p's metrics.
    fn record_metrics(&self, event: &SwarmEvent<BehaviourEvent>) {
        use libp2p::metrics::Recorder;
        let m = &self.libp2p_metrics;
        m.record(event);
        match event {
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(e)) => m.record(e),
            SwarmEvent::Behaviour(BehaviourEvent::Identify(e)) => m.record(e),
            SwarmEvent::Behaviour(BehaviourEvent::Ping(e)) => m.record(e),
            SwarmEvent::Behaviour(BehaviourEvent::Kad(e)) => m.record(e),
            SwarmEvent::Behaviour(BehaviourEvent::Dcutr(e)) => m.record(e),
            SwarmEvent::Behaviour(BehaviourEvent::Relay(e)) => m.record(e),
            _ => {}
        }
    }

    fn on_behaviour_event(&mut self, event: BehaviourEvent) {
        match event {
            BehaviourEvent::Identify(identify::Event::Received { peer_id, info, .. }) => {
                self.on_identified(peer_id, info);
            }
            BehaviourEvent::Ping(ping::Event { peer, result, .. }) => match result {
                Ok(rtt) => {
                    if let Some(p) = self.members.get_mut(&peer) {
                        p.rtt_ms = Some(rtt.as_secs_f64() * 1000.0);
                        self.last_heard.insert(peer, Instant::now());
                    }
                }
                // A failed ping alone drops nobody: on a saturated box or link a ping can
                // wait seconds behind bulk traffic while the peer is busy answering. Silence
                // of every kind for `SILENT_AFTER` is what drops a peer (see `on_tick`).
                Err(e) => tracing::debug!(peer = %peer, "ping failed ({e})"),
            },
            BehaviourEvent::Kad(kad::Event::RoutingUpdated {
                peer, addresses, ..
            }) if !self.swarm.is_connected(&peer)
                && !self.admission.is_refused(&peer)
                && peer != *self.swarm.local_peer_id() =>
            {
                // A circuit to a peer behind the relay gate is refused by the gate.
                let opts = libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
                    .addresses(addresses.into_vec())
                    .build();
                let _ = self.swarm.dial(opts);
            }
            BehaviourEvent::Mdns(mdns::Event::Discovered(found)) => {
                let now = Instant::now();
                for (peer, addr) in found {
                    if !self.swarm.is_connected(&peer) && !self.admission.is_refused(&peer) {
                        tracing::info!(peer = %peer, %addr, "found on the local network (mDNS)");
                        self.book.discovered(peer, addr.clone(), now);
                        self.dial_unless_connected(peer, vec![addr]);
                    }
                }
            }
            BehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            }) => {
                self.heard_from(propagation_source);
                self.emit(Event::Gossip {
                    source: propagation_source,
                    author: message.source,
                    id: message_id,
                    topic: message.topic.into_string(),
                    data: message.data,
                });
            }
            BehaviourEvent::Gossipsub(gossipsub::Event::Subscribed { peer_id, topic }) => {
                self.emit(Event::Subscribed {
                    peer: peer_id,
                    topic: topic.into_string(),
                });
            }
            BehaviourEvent::Bulk(request_response::Event::Message {
                peer,
                message,
                connection_id,
            }) => self.on_bulk_message(peer, message, connection_id),
            BehaviourEvent::Bulk(request_response::Event::OutboundFailure {
                request_id,
                error,
                peer,
                ..
            }) => {
                if let Some((_, reply)) = self.pending_requests.remove(&request_id) {
                    let _ = reply.send(Err(NetError::Request { peer, error }));
                }
            }
            BehaviourEvent::Bulk(request_response::Event::ResponseSent {
                peer,
                connection_id,
                ..
            })
            | BehaviourEvent::Bulk(request_response::Event::InboundFailure {
                peer,
                connection_id,
                ..
            }) => self.links.request_answered(&peer, connection_id),
            BehaviourEvent::Autonat(e) => self.on_nat_event(NatEvent::Autonat(e)),
            BehaviourEvent::RelayClient(e) => self.on_nat_event(NatEvent::RelayClient(e)),
            BehaviourEvent::Dcutr(e) => self.on_nat_event(NatEvent::Dcutr(e)),
            BehaviourEvent::Upnp(e) => self.on_nat_event(NatEvent::Upnp(e)),
            _ => {}
        }
    }

    /// A peer identified itself: one of another run (or sync terms, or gossip limit) is
    /// refused; one seen only over a relay is shown but is not a member; one over a direct
    /// connection becomes a member (announced to the mesh when new).
    fn on_identified(&mut self, peer_id: PeerId, info: identify::Info) {
        if info.protocol_version != self.admission.protocol_version() {
            // The connection closes a moment later (see `Admission::refuse`).
            if self.admission.refuse(peer_id, Instant::now()) {
                let differs = crate::network::what_differs(
                    self.admission.protocol_version(),
                    &info.protocol_version,
                );
                tracing::warn!(
                    peer = %peer_id,
                    "refused peer: it cannot train with this node; what differs: {differs}. Nodes train together only with the same model, optimizer, data spec, init seed, sync mode and shared sync settings (allreduce every, ddp resync_every, diloco inner_steps/outer_lr/outer_momentum/outer_values, fedavg local_epochs, gossip mix)"
                );
                if self.bootstrap_peers.contains(&peer_id) {
                    self.emit(Event::BootstrapOfAnotherRun {
                        peer: peer_id,
                        differs,
                    });
                }
            }
            self.swarm.behaviour_mut().kad.remove_peer(&peer_id);
            return;
        }
        if info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
            self.relay_capable.insert(peer_id);
        } else {
            self.relay_capable.remove(&peer_id);
        }
        // As many addresses as the peer book keeps: a hostile identify lists ~100.
        for addr in info.listen_addrs.iter().take(ADDRS_MAX) {
            self.swarm
                .behaviour_mut()
                .kad
                .add_address(&peer_id, addr.clone());
        }
        let address = self
            .swarm
            .connected_peers()
            .find(|p| **p == peer_id)
            .map(|_| {
                info.listen_addrs
                    .first()
                    .map(|a| a.to_string())
                    .unwrap_or_default()
            })
            .unwrap_or_default();
        let now = Instant::now();
        if !self.links.has_direct(&peer_id) {
            // Known and shown, but not a member: the mesh syncs only over direct
            // connections, and hole punching may still make one.
            tracing::debug!(peer = %peer_id, "identified over a relay");
            self.relayed_members.insert(
                peer_id,
                PeerInfo {
                    peer_id: peer_id.to_string(),
                    address,
                    rtt_ms: None,
                    agent: Some(info.agent_version.clone()),
                    score: None,
                    path: None,
                    remote: None,
                    connections: 0,
                    bytes_sent: None,
                    bytes_received: None,
                    offences: 0,
                    last_offence: None,
                },
            );
            return;
        }
        self.relayed_members.remove(&peer_id);
        self.book.seen(peer_id, info.listen_addrs.clone(), now);
        let is_new = !self.members.contains_key(&peer_id);
        self.last_heard.entry(peer_id).or_insert_with(Instant::now);
        let entry = self.members.entry(peer_id).or_insert_with(|| PeerInfo {
            peer_id: peer_id.to_string(),
            address: address.clone(),
            rtt_ms: None,
            agent: None,
            score: None,
            path: None,
            remote: None,
            connections: 0,
            bytes_sent: None,
            bytes_received: None,
            offences: 0,
            last_offence: None,
        });
        entry.agent = Some(info.agent_version.clone());
        if entry.address.is_empty() {
            entry.address = address;
        }
        if is_new {
            tracing::info!(peer = %peer_id, "peer joined");
            if self.members.len() == 1 {
                let _ = self.swarm.behaviour_mut().kad.bootstrap();
            }
            self.emit(Event::PeerUp(peer_id));
        }
    }

    /// A bulk request (served by the mesh actor when its sender is a member over a direct
    /// connection, refused otherwise) or the response to one of ours.
    fn on_bulk_message(
        &mut self,
        peer: PeerId,
        message: request_response::Message<BulkRequest, BulkResponse>,
        connection_id: ConnectionId,
    ) {
        match message {
            request_response::Message::Request {
                request, channel, ..
            } => {
                self.heard_from(peer);
                // Answered here or by the mesh actor; either way a `ResponseSent` or an
                // `InboundFailure` follows.
                self.links.request_arrived(&peer, connection_id);
                if self.links.is_relayed(&peer, connection_id) {
                    self.nat.relayed_requests_refused += 1;
                    let _ = self.swarm.behaviour_mut().bulk.send_response(
                        channel,
                        BulkResponse::Refused(
                            "bulk requests are not served over a relayed connection".into(),
                        ),
                    );
                } else if self.members.contains_key(&peer) {
                    self.emit(Event::Request {
                        peer,
                        request,
                        channel,
                    });
                } else {
                    let _ = self.swarm.behaviour_mut().bulk.send_response(
                        channel,
                        BulkResponse::Refused("not a member of this run".into()),
                    );
                }
            }
            request_response::Message::Response {
                request_id,
                response,
            } => {
                self.heard_from(peer);
                if let Some((_, reply)) = self.pending_requests.remove(&request_id) {
                    let _ = reply.send(Ok(response));
                }
            }
        }
    }

    /// Reachability news: AutoNAT's verdict, a relay reservation, a hole punch, a UPnP
    /// mapping.
    fn on_nat_event(&mut self, event: NatEvent) {
        match event {
            NatEvent::Autonat(autonat::Event::StatusChanged { old, new }) => {
                tracing::info!("reachability: {old:?} -> {new:?} (AutoNAT)");
                for id in self.nat.set_status(new) {
                    self.swarm.remove_listener(id);
                }
            }
            NatEvent::Autonat(autonat::Event::InboundProbe(
                autonat::InboundProbeEvent::Response { peer, address, .. },
            )) => {
                tracing::debug!(peer = %peer, "answered its AutoNAT probe; the dial-back connection closes in {:?}, or once no request is in flight on it", nat::DIAL_BACK_GRACE);
                self.links.spend_dial_back(&peer, &address, Instant::now());
            }
            NatEvent::RelayClient(relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal: false,
                ..
            }) => {
                tracing::info!(relay = %relay_peer_id, "relay reservation accepted");
            }
            NatEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            }) => match result {
                Ok(_) => {
                    self.nat.hole_punches += 1;
                    tracing::info!(peer = %remote_peer_id, "hole punched: direct connection");
                }
                Err(e) => {
                    // Closing the relayed connection engages the relay gate (see
                    // `on_swarm_event`).
                    self.nat.hole_punch_failures += 1;
                    tracing::info!(peer = %remote_peer_id, "{e}; the relayed connection is closed and the peer is reached through the gossip mesh");
                    for id in self.links.relayed(&remote_peer_id) {
                        let _ = self.swarm.close_connection(id);
                    }
                }
            },
            NatEvent::Upnp(event) => match event {
                upnp::Event::NewExternalAddr { external_addr, .. } => {
                    tracing::info!("UPnP mapped {external_addr} on the gateway");
                    self.nat.set_upnp_addr(Some(external_addr));
                }
                upnp::Event::ExpiredExternalAddr { external_addr, .. } => {
                    tracing::info!("UPnP mapping {external_addr} expired");
                    self.nat.set_upnp_addr(None);
                }
                upnp::Event::GatewayNotFound => {
                    tracing::warn!("UPnP: no gateway answered; no port mapping")
                }
                upnp::Event::NonRoutableGateway => {
                    tracing::warn!(
                        "UPnP: the gateway is not on the public internet; no port mapping"
                    )
                }
            },
            _ => {}
        }
    }
}

/// The behaviours' events about reachability, handled together by
/// [`EventLoop::on_nat_event`].
enum NatEvent {
    Autonat(autonat::Event),
    RelayClient(relay::client::Event),
    Dcutr(dcutr::Event),
    Upnp(upnp::Event),
}

#[cfg(test)]
mod tests {
    use super::{looks_like_handshake_failure, nothing_answers};

    #[test]
    fn handshake_failures_are_told_from_unreachable_peers() {
        assert!(looks_like_handshake_failure(
            "Noise handshake failed: decrypt error"
        ));
        assert!(looks_like_handshake_failure(
            "Multistream select failed: unexpected EOF"
        ));
        assert!(!looks_like_handshake_failure(
            "Failed to negotiate transport protocol(s): Connection refused (os error 111)"
        ));
        assert!(!looks_like_handshake_failure("handshake timeout"));
        assert!(!looks_like_handshake_failure("No route to host"));
    }

    #[test]
    fn a_refused_dial_is_not_blamed_on_the_network_key() {
        // As logged when a bootstrap member had stopped (the GPU run of 2026-11-24).
        assert!(nothing_answers(
            "Failed to negotiate transport protocol(s): [(/ip4/127.0.0.1/tcp/41199: : Connection refused (os error 111))]"
        ));
        assert!(nothing_answers("Network is unreachable (os error 101)"));
        assert!(!nothing_answers("Noise handshake failed: decrypt error"));
        assert!(!nothing_answers(
            "Failed to negotiate transport protocol(s): timeout"
        ));
    }
}
