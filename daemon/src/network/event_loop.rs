//! The task that owns the `Swarm`: it runs commands from [`super::Client`]s, turns swarm
//! events into [`Event`]s for the node, and once a second drops silent members, bans
//! graylisted ones, redials lost ones and looks for a relay. Peer memory lives in the
//! [`PeerBook`], byte counts in [`super::metrics`]'s `Traffic`, who may be a member (and what
//! was turned away) in `admission`; the reactions to swarm and protocol events are in
//! `swarm_events`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use futures::StreamExt;
use libp2p::gossipsub::IdentTopic;
use libp2p::request_response::OutboundRequestId;
use libp2p::{Multiaddr, PeerId, Swarm};
use tokio::sync::{mpsc, oneshot};

use super::behaviour::Behaviour;
use super::losses::{LossCause, PeerLosses};
use super::metrics::{Bandwidth, Envelope, Traffic};
use super::peer_book::{GraylistVerdict, PeerBook};
use super::{
    BulkResponse, Command, Event, NetConfig, NetError, NetSnapshot, NetworkStatus, PeerInfo,
    SILENT_AFTER,
};
use crate::nat::{self, Links, Nat};
use crate::scoring;

mod admission;
mod swarm_events;

use admission::Admission;

/// Events the loop holds for the node before it stops polling the swarm: as many as the
/// channel to the node holds, so a node that keeps up never sees the swarm paused.
const OUTBOX_CAP: usize = super::EVENT_CAP;

/// Owns the swarm; see the module docs.
pub struct EventLoop {
    swarm: Swarm<Behaviour>,
    cmd_rx: mpsc::Receiver<Command>,
    event_tx: mpsc::Sender<Event>,
    /// Events the node has not taken yet, oldest first (see [`EventLoop::run`]).
    outbox: VecDeque<Event>,
    /// Since when the swarm has not been read because the outbox is full.
    paused_at: Option<Instant>,
    /// Bytes through every connection, and gossip this node published per topic.
    traffic: Traffic,
    /// Who may be a member, and what was turned away.
    admission: Admission,
    members: HashMap<PeerId, PeerInfo>,
    listen_addrs: Vec<Multiaddr>,
    /// This node's bulk requests awaiting their answers: to whom, and who waits for it.
    pending_requests:
        HashMap<OutboundRequestId, (PeerId, oneshot::Sender<Result<BulkResponse, NetError>>)>,
    topics: HashSet<String>,
    walk: WalkClock,
    /// Peers named in bootstrap addresses, whose dial failures the user needs to see.
    bootstrap_peers: HashSet<PeerId>,
    /// When each member was last heard from: a ping answer, a gossip message or a bulk
    /// message (or when it joined). Any of them proves the peer alive, so a ping queued
    /// behind bulk traffic on a slow link does not make an honest peer look dead.
    last_heard: HashMap<PeerId, Instant>,
    /// Members seen (to redial when lost), bans and offences.
    book: PeerBook,
    /// Members lost, by cause (see [`NetworkStatus::peer_losses`]).
    losses: PeerLosses,
    /// This node said goodbye ([`Command::Leaving`]): lost members are no longer counted.
    leaving: bool,
    /// Open connections, direct or relayed.
    links: Links,
    /// Peers of this run connected only through a relay: shown in status, never synced with.
    relayed_members: HashMap<PeerId, PeerInfo>,
    /// Reachability and relays.
    nat: Nat,
    /// Members that offer the relay service (identify lists the hop protocol): the only
    /// ones a private node asks to relay for it.
    relay_capable: HashSet<PeerId>,
    /// Provable offences outside gossip per peer (refused full-sync replies, bad ring hops,
    /// heartbeats over their author's rate), behind their application score.
    penalties: scoring::Penalties<PeerId>,
    /// libp2p's Prometheus metrics of swarm and protocol events (connections, dials,
    /// identify, ping round trips, Kademlia, gossip messages), registered in the registry the
    /// control API serves.
    libp2p_metrics: libp2p::metrics::Metrics,
}

/// Seconds since the Unix epoch, for ban ends shown to operators.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// When the loop last walked the DHT for new peers, and how often it does.
struct WalkClock {
    every: Duration,
    last: Instant,
}

impl EventLoop {
    /// The loop for a built `swarm` (already listening and dialling).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        swarm: Swarm<Behaviour>,
        cfg: &NetConfig,
        protocol_version: String,
        cmd_rx: mpsc::Receiver<Command>,
        event_tx: mpsc::Sender<Event>,
        bandwidth: Bandwidth,
        envelope: Envelope,
        libp2p_metrics: libp2p::metrics::Metrics,
    ) -> Self {
        EventLoop {
            libp2p_metrics,
            swarm,
            cmd_rx,
            event_tx,
            outbox: VecDeque::new(),
            paused_at: None,
            traffic: Traffic::new(bandwidth, envelope),
            admission: Admission::new(cfg, protocol_version),
            members: HashMap::new(),
            listen_addrs: Vec::new(),
            pending_requests: HashMap::new(),
            topics: HashSet::new(),
            walk: WalkClock {
                every: cfg.kad_walk_every,
                last: Instant::now(),
            },
            bootstrap_peers: super::bootstrap_peers(&cfg.bootstrap),
            last_heard: HashMap::new(),
            book: PeerBook::default(),
            losses: PeerLosses::default(),
            leaving: false,
            links: Links::default(),
            relayed_members: HashMap::new(),
            nat: Nat::new(cfg.relay_server, cfg.upnp),
            relay_capable: HashSet::new(),
            penalties: scoring::Penalties::default(),
        }
    }

    /// Runs until every [`super::Client`] is dropped. Pending bulk requests are answered
    /// with [`NetError::Stopped`] when the swarm goes with it.
    ///
    /// The loop never waits on the node: events go to an outbox, handed on as the node takes
    /// them, and commands are served all the while. While the outbox is full the swarm is not
    /// polled (backpressure on the peers, not on the node), so a node busy with a flood can
    /// still publish, answer requests and report status. (It once awaited a full event
    /// channel while the node awaited its answer to a publish: neither moved again.)
    pub async fn run(mut self) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            let swarm_room = self.outbox.len() < OUTBOX_CAP;
            match (swarm_room, self.paused_at) {
                (false, None) => self.paused_at = Some(Instant::now()),
                (true, Some(at)) => {
                    // Nothing could be heard while the swarm was not read: the pause does not
                    // count towards a peer's silence.
                    let pause = at.elapsed();
                    self.last_heard.values_mut().for_each(|t| *t += pause);
                    self.paused_at = None;
                }
                _ => {}
            }
            let event_tx = self.event_tx.clone();
            tokio::select! {
                permit = event_tx.reserve(), if !self.outbox.is_empty() => match permit {
                    Ok(permit) => {
                        if let Some(event) = self.outbox.pop_front() {
                            permit.send(event);
                        }
                    }
                    // The node is gone: nothing will read what waits.
                    Err(_) => self.outbox.clear(),
                },
                event = self.swarm.select_next_some(), if swarm_room => self.on_swarm_event(event),
                cmd = self.cmd_rx.recv() => match cmd {
                    Some(cmd) => self.on_command(cmd),
                    None => return,
                },
                _ = tick.tick() => self.on_tick(),
            }
        }
    }

    /// Hands an event to the node, through the outbox (see [`EventLoop::run`]).
    fn emit(&mut self, event: Event) {
        if !self.event_tx.is_closed() {
            self.outbox.push_back(event);
        }
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        let awaiting: HashSet<PeerId> = self.pending_requests.values().map(|p| p.0).collect();
        for spent in self.links.due_to_close(now, &awaiting) {
            let _ = self.swarm.close_connection(spent);
        }
        let paused = self.paused_at.is_some();
        let silent: Vec<PeerId> = self
            .members
            .keys()
            .filter(|_| !paused)
            .filter(|p| {
                self.last_heard
                    .get(p)
                    .is_some_and(|t| now.duration_since(*t) > SILENT_AFTER)
            })
            .copied()
            .collect();
        for peer in silent {
            tracing::info!(peer = %peer, "nothing heard (no ping answer, gossip or bulk message) for {SILENT_AFTER:?}; dropping the peer");
            self.drop_member(peer, LossCause::Silent);
        }
        let gossip = &mut self.swarm.behaviour_mut().gossipsub;
        for (peer, score) in self.penalties.decay() {
            gossip.set_application_score(&peer, score);
        }
        self.ban_graylisted(now);
        // A node saying goodbye lets its members go: they close their connections to it.
        if !self.leaving {
            self.redial_lost(now);
        }
        self.find_relay(now);
        for peer in self.admission.hang_ups_due(now) {
            let _ = self.swarm.disconnect_peer_id(peer);
        }
        if self.walk.last.elapsed() >= self.walk.every && !self.members.is_empty() {
            let _ = self.swarm.behaviour_mut().kad.bootstrap();
            self.walk.last = Instant::now();
        }
    }

    /// Dials members lost without saying goodbye, with backoff: after a partition heals or a
    /// crashed box comes back on the same address, the mesh joins up again without waiting for
    /// a Kademlia walk (which may have dropped the unreachable peers from its table).
    fn redial_lost(&mut self, now: Instant) {
        let members = &self.members;
        let admission = &self.admission;
        let due = self.book.redial_due(
            now,
            |p| members.contains_key(p),
            |p| admission.is_refused(p),
        );
        for (peer, addrs) in due {
            // The relay gate would refuse such a circuit, but only after the relay opened
            // it: this loop runs every few seconds, so it leaves circuits out itself.
            let relay_ok = self.swarm.behaviour().relay_gate.allows(&peer, now);
            let addrs: Vec<Multiaddr> = addrs
                .into_iter()
                .filter(|a| relay_ok || !nat::is_circuit(a))
                .collect();
            if addrs.is_empty() {
                continue;
            }
            tracing::debug!(peer = %peer, "redialling a lost member");
            self.dial_unless_connected(peer, addrs);
        }
    }

    /// Dials `peer` at `addrs` unless it is connected or already being dialled; a failure
    /// shows up as a swarm event, and the redial loop tries again later.
    fn dial_unless_connected(&mut self, peer: PeerId, addrs: Vec<Multiaddr>) {
        let opts = libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
            .condition(libp2p::swarm::dial_opts::PeerCondition::DisconnectedAndNotDialing)
            .addresses(addrs)
            .build();
        let _ = self.swarm.dial(opts);
    }

    /// A private node listens through a member it reached directly (see [`nat::Nat::pick_relay`]),
    /// so peers that cannot dial it can reach it through the relay and hole-punch from there.
    fn find_relay(&mut self, now: Instant) {
        let candidates: Vec<(PeerId, Multiaddr)> = self
            .members
            .keys()
            .filter(|p| self.relay_capable.contains(p))
            .filter_map(|p| self.links.dialed_addr(p).map(|a| (*p, a)))
            .collect();
        let Some((relay, addr)) = self.nat.pick_relay(now, candidates) else {
            return;
        };
        match self.swarm.listen_on(addr.clone()) {
            Ok(id) => {
                tracing::info!(relay = %relay, "this node is not reachable (AutoNAT); asking {addr} to relay for it");
                self.nat.relay_listening(id, relay);
            }
            Err(e) => tracing::warn!(relay = %relay, "cannot listen through relay {addr}: {e}"),
        }
    }

    /// Disconnects members whose gossip score fell below the graylist threshold and refuses
    /// them for [`scoring::BAN_FOR`]: gossipsub already ignores what they send, and the ban
    /// also frees the neighbour slot and the bulk channel they hold. A member with no offence
    /// on record is spared unless it stays below or comes back below
    /// ([`PeerBook::graylisted`]): gossip protocol penalties alone are what a starved honest
    /// box earns by answering late.
    fn ban_graylisted(&mut self, now: Instant) {
        for peer in self.book.end_expired_bans(now) {
            tracing::info!(peer = %peer, "ban ended; the peer may connect again");
            self.swarm.behaviour_mut().banned.unblock_peer(peer);
        }
        let members = &self.members;
        self.book.forget_stale(now, |p| members.contains_key(p));
        let gossip = &self.swarm.behaviour().gossipsub;
        let scores: Vec<(PeerId, f64)> = self
            .members
            .keys()
            .filter_map(|p| gossip.peer_score(p).map(|s| (*p, s)))
            .collect();
        let mut to_ban = Vec::new();
        for (peer, score) in scores {
            if score >= scoring::GRAYLIST_THRESHOLD {
                self.book.not_graylisted(&peer);
                continue;
            }
            match self.book.graylisted(peer, now) {
                GraylistVerdict::Ban => to_ban.push((peer, score)),
                GraylistVerdict::Spare { new_spell: true } => {
                    tracing::info!(peer = %peer, "gossip score {score:.1} is below the graylist threshold through gossip protocol penalties alone (broken IWANT promises or grafts during a prune backoff, which a late answer earns too): gossipsub ignores the peer meanwhile; not banned unless it stays below or comes back");
                }
                GraylistVerdict::Spare { new_spell: false } => {}
            }
        }
        for (peer, score) in to_ban {
            let seen_at = self
                .members
                .get(&peer)
                .and_then(|m| m.address.parse::<Multiaddr>().ok());
            let reason = self.book.ban(peer, score, now, unix_now(), seen_at);
            tracing::warn!(peer = %peer, "banned for {:?}: {reason}", scoring::BAN_FOR);
            // The block list refuses the peer's connections, either way, until the ban ends:
            // refused at the connection level, it is never mistaken for a failed handshake.
            self.swarm.behaviour_mut().banned.block_peer(peer);
            self.swarm.behaviour_mut().kad.remove_peer(&peer);
            self.drop_member(peer, LossCause::Banned);
        }
    }

    /// Notes that `peer` showed signs of life, if it is a member.
    fn heard_from(&mut self, peer: PeerId) {
        if let Some(t) = self.last_heard.get_mut(&peer) {
            *t = Instant::now();
        }
    }

    /// Disconnects a peer and tells the mesh at once: a hung peer's connections can take many
    /// seconds more to finish closing.
    fn drop_member(&mut self, peer: PeerId, cause: LossCause) {
        let _ = self.swarm.disconnect_peer_id(peer);
        self.last_heard.remove(&peer);
        if self.members.remove(&peer).is_some() {
            self.losses.count(cause, self.leaving);
            self.emit(Event::PeerDown(peer));
        }
    }

    /// Publishes on `topic` and counts the copies: with flood publishing (gossipsub's
    /// default) a message goes to every peer subscribed to the topic whose score is above
    /// the publish threshold.
    fn publish(&mut self, topic: String, data: Vec<u8>) -> Result<(), NetError> {
        let data_len = data.len();
        let topic = IdentTopic::new(topic);
        let gossip = &mut self.swarm.behaviour_mut().gossipsub;
        gossip.publish(topic.clone(), data)?;
        let hash = topic.hash();
        let threshold = scoring::thresholds().publish_threshold;
        let copies = gossip
            .all_peers()
            .filter(|(_, topics)| topics.contains(&&hash))
            .filter(|(p, _)| gossip.peer_score(p).is_none_or(|s| s >= threshold))
            .count() as u64;
        self.traffic.published(hash.as_str(), data_len, copies);
        Ok(())
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Publish { topic, data, reply } => {
                let _ = reply.send(self.publish(topic, data));
            }
            Command::Subscribe(topic) => {
                if let Err(e) = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .subscribe(&IdentTopic::new(topic.clone()))
                {
                    tracing::warn!(%topic, "cannot subscribe: {e}");
                } else {
                    let gossip = &mut self.swarm.behaviour_mut().gossipsub;
                    if let Err(e) = gossip
                        .set_topic_params(IdentTopic::new(topic.clone()), scoring::topic_params())
                    {
                        tracing::warn!(%topic, "cannot score the topic: {e}");
                    }
                    self.topics.insert(topic);
                }
            }
            Command::Unsubscribe(topic) => {
                self.swarm
                    .behaviour_mut()
                    .gossipsub
                    .unsubscribe(&IdentTopic::new(topic.clone()));
                self.topics.remove(&topic);
            }
            Command::Offence { peer, why } => self.book.note_offence(peer, why, Instant::now()),
            Command::Validate {
                id,
                source,
                verdict,
            } => {
                let rejected = matches!(verdict, libp2p::gossipsub::MessageAcceptance::Reject);
                let penalised = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .report_message_validation_result(&id, &source, verdict);
                // The mesh names most rejections itself, but its word may have been dropped
                // on a full channel: the one that lowered the score is evidence enough.
                if rejected && penalised {
                    self.book.note_unnamed_offence(
                        source,
                        "a gossip message the node rejected",
                        Instant::now(),
                    );
                }
            }
            Command::Request {
                peer,
                request,
                reply,
            } => {
                // Members always have a direct connection (see `on_swarm_event`).
                if !self.members.contains_key(&peer) {
                    let why = if self.relayed_members.contains_key(&peer) {
                        NetError::RelayedOnly(peer)
                    } else {
                        NetError::NotConnected(peer)
                    };
                    let _ = reply.send(Err(why));
                    return;
                }
                let id = self.swarm.behaviour_mut().bulk.send_request(&peer, request);
                self.pending_requests.insert(id, (peer, reply));
            }
            Command::Respond { channel, response } => {
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .bulk
                    .send_response(channel, response);
            }
            Command::Snapshot(reply) => {
                let _ = reply.send(self.snapshot());
            }
            Command::Leaving => self.leaving = true,
            Command::Forget(peer) => {
                self.book.forget(&peer);
                self.relayed_members.remove(&peer);
                // It said goodbye (the mesh already let it go): not a drop.
                if self.members.remove(&peer).is_some() {
                    self.losses.count(LossCause::Goodbye, self.leaving);
                }
                self.last_heard.remove(&peer);
                // Nor found again by a walk of the DHT in the seconds it takes to exit (it
                // would come back a member, and its exit count as a drop).
                self.swarm.behaviour_mut().kad.remove_peer(&peer);
                let _ = self.swarm.disconnect_peer_id(peer);
            }
            Command::Penalise(peer) => {
                self.book.note_unnamed_offence(
                    peer,
                    "a refused full-sync reply, a bad ring hop or heartbeats over their rate",
                    Instant::now(),
                );
                let score = self.penalties.add(peer);
                self.swarm
                    .behaviour_mut()
                    .gossipsub
                    .set_application_score(&peer, score);
            }
        }
    }

    /// The network's state, for [`Command::Snapshot`].
    fn snapshot(&self) -> NetSnapshot {
        let me = *self.swarm.local_peer_id();
        let mut listen: Vec<&Multiaddr> = self.listen_addrs.iter().collect();
        // Addresses other machines can reach first; loopback last.
        listen.sort_by_key(|a| {
            a.to_string().starts_with("/ip4/127.") || a.to_string().starts_with("/ip6/::1")
        });
        let gossip = &self.swarm.behaviour().gossipsub;
        let mut peers: Vec<PeerInfo> = self
            .members
            .iter()
            .chain(self.relayed_members.iter())
            .map(|(id, p)| {
                let offences = self.book.offences_of(id);
                PeerInfo {
                    score: gossip.peer_score(id),
                    bytes_sent: self.traffic.bandwidth.of_peer(id).map(|b| b.0),
                    bytes_received: self.traffic.bandwidth.of_peer(id).map(|b| b.1),
                    path: self.links.path(id).map(str::to_string),
                    remote: self.links.remote(id),
                    connections: self.links.count(id),
                    offences: offences.map_or(0, |o| o.0),
                    last_offence: offences.map(|o| o.1.to_string()),
                    ..p.clone()
                }
            })
            .collect();
        peers.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
        let mut topics: Vec<String> = self.topics.iter().cloned().collect();
        topics.sort();
        let mut status = NetworkStatus {
            listen_addrs: listen
                .into_iter()
                .map(|a| format!("{a}/p2p/{me}"))
                .collect(),
            bytes_sent: self.traffic.bandwidth.sent(),
            bytes_received: self.traffic.bandwidth.received(),
            topics,
            banned_peers: self.book.banned(Instant::now()),
            peer_drops: self.losses.drops(),
            peer_losses: self.losses,
            nat: self.nat.report(&self.listen_addrs),
            ..NetworkStatus::default()
        };
        self.admission.report(&mut status);
        NetSnapshot {
            peers,
            topic_sent: self.traffic.by_topic(),
            status,
        }
    }
}
