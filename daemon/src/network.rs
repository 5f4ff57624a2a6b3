//! The libp2p side of a node: one task (the [`EventLoop`]) owns the `Swarm` and is driven by
//! [`Command`]s from cloneable [`Client`]s over a bounded channel; what it learns comes back as
//! [`Event`]s. It knows nothing about training: updates and states are opaque bytes here.
//!
//! Protocols: TCP + noise + yamux; identify (whose protocol version carries the run id and the
//! gossip size limit, so a peer of another run or with another limit is refused instead of
//! silently deafened); ping (a crashed peer is dropped after a few seconds); Kademlia in server
//! mode (discovery from one bootstrap address); gossipsub (signed, strict, every message
//! validated by the node before it is forwarded, content-hash ids); and a request-response
//! channel ("bulk") for what is too big for gossip: state downloads and full-model syncs.
//!
//! NAT traversal: AutoNAT (peers dial back to tell a node whether it is reachable), a relay
//! client (a private node listens through up to two members that are) and relay server (with
//! libp2p's default limits), DCUtR hole punching over relayed connections, and optional UPnP.
//! What may use a relay is decided in [`crate::nat`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use libp2p::allow_block_list;
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::Boxed;
use libp2p::core::Transport as _;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance, MessageId};
use libp2p::identity::Keypair;
pub use libp2p::pnet::PreSharedKey;
use libp2p::request_response::{self, OutboundRequestId, ProtocolSupport, ResponseChannel};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{
    autonat, dcutr, identify, kad, mdns, noise, ping, relay, tcp, upnp, yamux, Multiaddr, PeerId,
    StreamProtocol, Swarm,
};
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use crate::nat::{self, Links, Nat, NatReport};
use crate::scoring;

/// Largest gossip message (the whole RPC) any p2ptrain node sends or accepts. It is part of the
/// protocol version peers compare, because a node with a smaller limit silently stops
/// hearing a sender after one oversized message.
pub const MAX_TRANSMIT_SIZE: usize = 2 * 1024 * 1024;
/// Largest request on the bulk channel.
pub const BULK_REQUEST_MAX: u64 = 64 * 1024;
/// Largest response on the bulk channel (a state chunk or a full model).
pub const BULK_RESPONSE_MAX: u64 = 64 * 1024 * 1024;
/// Time a bulk request may take before it fails (and the caller tries another peer).
pub const BULK_TIMEOUT: Duration = Duration::from_secs(30);
/// Capacity of the command channel into the event loop.
pub const COMMAND_CAP: usize = 64;
/// Capacity of the event channel out of the event loop.
pub const EVENT_CAP: usize = 256;
/// How often peers ping each other, and how long a ping may take before the peer is dropped.
pub const PING_INTERVAL: Duration = Duration::from_secs(1);
/// See [`PING_INTERVAL`].
pub const PING_TIMEOUT: Duration = Duration::from_secs(3);
/// A member with no successful ping for this long is dropped. libp2p's ping reports only the
/// second failure in a row, and a hung peer's next ping stream waits out a 10 s negotiation
/// timeout first (measured: a SIGSTOPped peer was dropped after 14.6 s), so the event loop
/// keeps its own clock of the last answer.
pub const SILENT_AFTER: Duration = Duration::from_secs(4);
/// Kademlia random walk interval, so nodes keep learning peers beyond their bootstrap.
pub const KAD_WALK_EVERY: Duration = Duration::from_secs(30);
/// First wait before redialling a member that was lost (crashed, hung, or cut off by a
/// partition); it doubles per failed attempt up to [`REDIAL_MAX`].
pub const REDIAL_MIN: Duration = Duration::from_secs(1);
/// See [`REDIAL_MIN`]: a lost member is retried at least this often, so a healed partition
/// joins up again within seconds (a dial on a LAN costs one packet).
pub const REDIAL_MAX: Duration = Duration::from_secs(8);
/// A lost member not reached again for this long is forgotten.
pub const FORGET_AFTER: Duration = Duration::from_secs(30 * 60);

/// The identify protocol version of a node of run `run_id`: equal strings, and only equal
/// strings, can train together.
pub fn protocol_version(run_id: &str) -> String {
    format!("/p2ptrain/1/run/{run_id}/gossip-max/{MAX_TRANSMIT_SIZE}")
}

/// The agent string other peers see.
pub fn agent_version() -> String {
    format!("p2ptrain/{}", env!("CARGO_PKG_VERSION"))
}

/// A request on the bulk channel.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum BulkRequest {
    /// Freeze your current state for download and describe it.
    StateManifest,
    /// One chunk of a frozen state.
    StateChunk {
        /// SHA-256 of the whole state.
        state: ByteBuf,
        /// Chunk index.
        index: u32,
    },
    /// Your current parameters, for a neighbour sync.
    Params,
    /// A large update you announced.
    Update {
        /// Its content hash, from the announcement.
        hash: ByteBuf,
    },
}

/// A frozen state on offer to a joiner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateManifest {
    /// SHA-256 of the whole state (a checkpoint file's bytes).
    pub hash: ByteBuf,
    /// The donor's step when it froze the state.
    pub step: u64,
    /// Total bytes.
    pub total: u64,
    /// Bytes per chunk (the last may be shorter).
    pub chunk_size: u32,
    /// SHA-256 of each chunk.
    pub chunk_hashes: Vec<ByteBuf>,
    /// Transfers the donor is serving now: joiners prefer less loaded donors.
    pub load: u32,
    /// Other states (by hash) the donor can serve chunks of, e.g. one it downloaded itself.
    #[serde(default)]
    pub cached: Vec<ByteBuf>,
}

/// An answer on the bulk channel.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum BulkResponse {
    /// See [`BulkRequest::StateManifest`].
    StateManifest(StateManifest),
    /// See [`BulkRequest::StateChunk`].
    StateChunk(ByteBuf),
    /// See [`BulkRequest::Params`]: the step and the flat parameters (little-endian `f32`).
    Params {
        /// The donor's step.
        step: u64,
        /// Its parameter layout hash.
        layout: String,
        /// Flat parameters.
        values: ByteBuf,
    },
    /// See [`BulkRequest::Update`]: the encoded update.
    Update(ByteBuf),
    /// The peer cannot or will not answer.
    Refused(String),
}

// The derive generates an event enum without docs; keep it in a module that allows that.
#[allow(missing_docs)]
mod composed {
    use super::*;

    /// The composed behaviour.
    #[derive(NetworkBehaviour)]
    pub struct Behaviour {
        pub(super) identify: identify::Behaviour,
        pub(super) ping: ping::Behaviour,
        pub(super) kad: kad::Behaviour<kad::store::MemoryStore>,
        pub(super) gossipsub: gossipsub::Behaviour,
        pub(super) bulk: request_response::cbor::Behaviour<BulkRequest, BulkResponse>,
        pub(super) mdns: Toggle<mdns::tokio::Behaviour>,
        pub(super) allow: Toggle<allow_block_list::Behaviour<allow_block_list::AllowedPeers>>,
        pub(super) banned: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
        pub(super) relay_gate: nat::RelayGate,
        pub(super) autonat: autonat::Behaviour,
        pub(super) relay_client: relay::client::Behaviour,
        pub(super) relay: Toggle<relay::Behaviour>,
        pub(super) dcutr: dcutr::Behaviour,
        pub(super) upnp: Toggle<upnp::tokio::Behaviour>,
    }
}
pub use composed::{Behaviour, BehaviourEvent};

/// What the node asks of the network.
#[derive(Debug)]
pub enum Command {
    /// Publish bytes on a topic.
    Publish {
        /// Topic name.
        topic: String,
        /// Message bytes.
        data: Vec<u8>,
        /// Ok, or why not (no subscribed peer is a normal answer at start-up).
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Start receiving a topic.
    Subscribe(String),
    /// Stop receiving a topic.
    Unsubscribe(String),
    /// The mesh caught `peer` at something only a broken or hostile peer does; remembered so
    /// that a ban can name it.
    Offence {
        /// The peer.
        peer: PeerId,
        /// What it did.
        why: String,
    },
    /// Accept or reject a gossip message after validation.
    Validate {
        /// Message id.
        id: MessageId,
        /// The peer that forwarded it.
        source: PeerId,
        /// The verdict.
        verdict: MessageAcceptance,
    },
    /// Send a bulk request.
    Request {
        /// To whom.
        peer: PeerId,
        /// What.
        request: BulkRequest,
        /// The answer, or why there is none.
        reply: oneshot::Sender<Result<BulkResponse, String>>,
    },
    /// Answer an inbound bulk request.
    Respond {
        /// The channel from [`Event::Request`].
        channel: ResponseChannel<BulkResponse>,
        /// The answer.
        response: BulkResponse,
    },
    /// Report the network's state.
    Snapshot(oneshot::Sender<NetSnapshot>),
    /// A peer left for good: close its connections and stop redialling it.
    Forget(PeerId),
    /// This node refused a full-sync reply of the peer's: lower its application score (see
    /// [`scoring::Refusals`]), which takes a peer that keeps doing it to the graylist and the ban.
    SyncRefused(PeerId),
}

/// What the network tells the node.
#[derive(Debug)]
pub enum Event {
    /// A peer of our run is connected and identified.
    PeerUp(PeerId),
    /// A member peer has no connection left.
    PeerDown(PeerId),
    /// A gossip message awaiting validation.
    Gossip {
        /// The peer that forwarded it (penalised on reject).
        source: PeerId,
        /// The signed author.
        author: Option<PeerId>,
        /// Message id for the verdict.
        id: MessageId,
        /// Topic name.
        topic: String,
        /// Payload.
        data: Vec<u8>,
    },
    /// A peer asks something on the bulk channel.
    Request {
        /// Who asks.
        peer: PeerId,
        /// What.
        request: BulkRequest,
        /// Where the answer goes.
        channel: ResponseChannel<BulkResponse>,
    },
    /// A peer subscribed to a topic.
    Subscribed {
        /// The peer.
        peer: PeerId,
        /// The topic name.
        topic: String,
    },
}

/// A connected peer as the network sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PeerInfo {
    /// Peer id.
    pub peer_id: String,
    /// Address of the first connection.
    pub address: String,
    /// Latest ping round trip, in milliseconds.
    pub rtt_ms: Option<f64>,
    /// Its agent string.
    pub agent: Option<String>,
    /// Its gossipsub score as this node sees it (negative after rejected messages).
    #[serde(default)]
    pub score: Option<f64>,
    /// "direct", or "relayed" while the only connection runs through a relay.
    #[serde(default)]
    pub path: Option<String>,
    /// Where the connection runs to: for a peer behind a NAT, its gateway's address.
    #[serde(default)]
    pub remote: Option<String>,
}

/// A peer disconnected and refused for a while because its score fell below the graylist
/// threshold. An operator who sees one needs to know what it did and when it may come back:
/// a ban is the mesh's sharpest tool and must be explainable.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BannedPeer {
    /// Peer id.
    pub peer_id: String,
    /// Its score when it was banned.
    pub score: f64,
    /// Seconds until it may connect again.
    pub secs_left: f64,
    /// When the ban ends, in seconds since the Unix epoch.
    #[serde(default)]
    pub until: u64,
    /// The offence: what the peer did that this node reported (rejected messages, refused
    /// syncs), or that the score fell through gossip misbehaviour alone.
    #[serde(default)]
    pub reason: String,
}

/// A ban in force.
#[derive(Debug, Clone)]
struct Ban {
    score: f64,
    until: Instant,
    until_unix: u64,
    reason: String,
    /// Addresses the peer was known at: a connection from one of them that breaks off
    /// mid-handshake is most likely the banned peer redialling (its other dial attempts are
    /// cancelled once one is refused), not a key mismatch.
    ips: HashSet<std::net::IpAddr>,
}

/// The IP address in a multiaddr, if any.
fn ip_of(addr: &Multiaddr) -> Option<std::net::IpAddr> {
    addr.iter().find_map(|p| match p {
        libp2p::multiaddr::Protocol::Ip4(ip) => Some(ip.into()),
        libp2p::multiaddr::Protocol::Ip6(ip) => Some(ip.into()),
        _ => None,
    })
}

/// What a peer did wrong, as the mesh reported it: the evidence a ban names.
#[derive(Debug, Clone, Default)]
struct Offences {
    count: u64,
    last: String,
}

/// The network's state for status reports.
#[derive(Debug, Clone, Default)]
pub struct NetSnapshot {
    /// Member peers (same run), connected.
    pub peers: Vec<PeerInfo>,
    /// Our listen addresses, with `/p2p/<id>`.
    pub listen_addrs: Vec<String>,
    /// Bytes sent, from libp2p's bandwidth counters.
    pub bytes_sent: u64,
    /// Bytes received, likewise.
    pub bytes_received: u64,
    /// Peers refused for belonging to another run (or speaking another protocol version).
    pub refused_peers: u64,
    /// Topics we are subscribed to.
    pub topics: Vec<String>,
    /// Gossip messages sent per topic: `(messages, bytes)`, each message counted once per
    /// peer it went to, with gossipsub's envelope (signature, author, topic, sequence number).
    pub topic_sent: BTreeMap<String, (u64, u64)>,
    /// Peers banned for a graylisting score.
    pub banned: Vec<BannedPeer>,
    /// Fingerprint of the private network key, if the node is on one.
    pub psk_fingerprint: Option<String>,
    /// Number of peers on the allowlist, if one is in force.
    pub allowlist: Option<usize>,
    /// Connections that failed in the handshake (most often a network key mismatch).
    pub handshake_failures: u64,
    /// Times a member was lost without saying goodbye: silent too long, its last direct
    /// connection closed, or banned. An honest mesh on a healthy box never loses one.
    pub peer_drops: u64,
    /// Connections refused or not dialled because of the allowlist.
    pub denied_connections: u64,
    /// Reachability, relays and hole punching.
    pub nat: NatReport,
}

/// A cloneable handle that sends commands to the event loop.
#[derive(Clone)]
pub struct Client {
    cmd_tx: mpsc::Sender<Command>,
}

impl Client {
    async fn send(&self, cmd: Command) -> Result<(), String> {
        self.cmd_tx
            .send(cmd)
            .await
            .map_err(|_| "the network task has stopped".to_string())
    }

    /// Publishes `data` on `topic`.
    pub async fn publish(&self, topic: String, data: Vec<u8>) -> Result<(), String> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Publish { topic, data, reply }).await?;
        rx.await
            .map_err(|_| "the network task has stopped".to_string())?
    }

    /// Subscribes to a topic.
    pub async fn subscribe(&self, topic: String) -> Result<(), String> {
        self.send(Command::Subscribe(topic)).await
    }

    /// Unsubscribes from a topic.
    pub async fn unsubscribe(&self, topic: String) -> Result<(), String> {
        self.send(Command::Unsubscribe(topic)).await
    }

    /// Records an offence of `peer` for the reason a later ban gives. Never waits: under
    /// back-pressure the note is dropped (the score, kept by gossipsub, is what bans).
    pub fn report_offence(&self, peer: PeerId, why: String) {
        let _ = self.cmd_tx.try_send(Command::Offence { peer, why });
    }

    /// Reports the verdict on a gossip message.
    pub async fn validate(
        &self,
        id: MessageId,
        source: PeerId,
        verdict: MessageAcceptance,
    ) -> Result<(), String> {
        self.send(Command::Validate {
            id,
            source,
            verdict,
        })
        .await
    }

    /// Sends a bulk request and waits for the answer (at most [`BULK_TIMEOUT`]).
    pub async fn request(
        &self,
        peer: PeerId,
        request: BulkRequest,
    ) -> Result<BulkResponse, String> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Request {
            peer,
            request,
            reply,
        })
        .await?;
        rx.await
            .map_err(|_| "the network task has stopped".to_string())?
    }

    /// Answers an inbound bulk request.
    pub async fn respond(
        &self,
        channel: ResponseChannel<BulkResponse>,
        response: BulkResponse,
    ) -> Result<(), String> {
        self.send(Command::Respond { channel, response }).await
    }

    /// The network's state.
    pub async fn snapshot(&self) -> Result<NetSnapshot, String> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Snapshot(tx)).await?;
        rx.await
            .map_err(|_| "the network task has stopped".to_string())
    }

    /// Drops a peer.
    pub async fn forget(&self, peer: PeerId) -> Result<(), String> {
        self.send(Command::Forget(peer)).await
    }

    /// Lowers a peer's score for a refused full-sync reply.
    pub async fn sync_refused(&self, peer: PeerId) -> Result<(), String> {
        self.send(Command::SyncRefused(peer)).await
    }
}

/// Network settings of one node.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Addresses to listen on.
    pub listen: Vec<Multiaddr>,
    /// Addresses to dial at start.
    pub bootstrap: Vec<Multiaddr>,
    /// The run id, compared with every peer's.
    pub run_id: String,
    /// Discover peers on the local network with mDNS. Off by default: it multicasts on every
    /// interface of the machine.
    pub mdns: bool,
    /// A private network's pre-shared key: every connection is encrypted with it below
    /// noise, so a node without the key cannot complete a handshake or see any topic.
    pub psk: Option<PreSharedKey>,
    /// If given, only these peers may connect (either way).
    pub allow: Option<HashSet<PeerId>>,
    /// Relay for other members once AutoNAT confirms this node reachable.
    pub relay_server: bool,
    /// Ask the gateway for a port mapping with UPnP. Off by default: it talks to the real
    /// router of the network the machine is on.
    pub upnp: bool,
}

/// Why the network could not start.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The swarm could not be built.
    #[error("cannot build the libp2p swarm: {0}")]
    Build(String),
    /// A listen address was refused.
    #[error("cannot listen on {addr}: {msg}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        msg: String,
    },
    /// A bootstrap address is not dialable.
    #[error("cannot dial bootstrap address {addr}: {msg}")]
    Dial {
        /// The address.
        addr: String,
        /// Why.
        msg: String,
    },
}

/// Owns the swarm; see the module docs.
pub struct EventLoop {
    swarm: Swarm<Behaviour>,
    cmd_rx: mpsc::Receiver<Command>,
    event_tx: mpsc::Sender<Event>,
    registry: prometheus_client::registry::Registry,
    gossip_registry: prometheus_client::registry::Registry,
    protocol_version: String,
    members: HashMap<PeerId, PeerInfo>,
    refused: HashSet<PeerId>,
    refused_count: u64,
    listen_addrs: Vec<Multiaddr>,
    pending_requests: HashMap<OutboundRequestId, oneshot::Sender<Result<BulkResponse, String>>>,
    topics: HashSet<String>,
    last_walk: Instant,
    /// Refused peers to disconnect, and when.
    hang_up: Vec<(PeerId, Instant)>,
    /// Peers named in bootstrap addresses, whose dial failures the user needs to see.
    bootstrap_peers: HashSet<PeerId>,
    /// When each member was last heard from: a ping answer, a gossip message or a bulk
    /// message (or when it joined). Any of them proves the peer alive, so a ping queued
    /// behind bulk traffic on a slow link does not make an honest peer look dead.
    last_heard: HashMap<PeerId, Instant>,
    /// Banned peers, as status shows them (the block list refuses their connections).
    banned: HashMap<PeerId, Ban>,
    /// Offences the mesh reported per peer, for the reason a ban gives.
    offences: HashMap<PeerId, Offences>,
    /// Every member seen, to redial when lost (see [`REDIAL_MIN`]).
    known: HashMap<PeerId, KnownPeer>,
    /// The private network key's fingerprint, if any.
    psk_fingerprint: Option<String>,
    /// Size of the allowlist, if one is in force.
    allowlist: Option<usize>,
    /// Connections that failed in the security handshake (a wrong or missing network key).
    handshake_failures: u64,
    /// See [`NetSnapshot::peer_drops`].
    peer_drops: u64,
    /// Connections refused (or not dialled) because of the allowlist.
    denied_connections: u64,
    /// Open connections, direct or relayed.
    links: Links,
    /// Peers of this run connected only through a relay: shown in status, never synced with.
    relayed_members: HashMap<PeerId, PeerInfo>,
    /// Reachability and relays.
    nat: Nat,
    /// Members that offer the relay service (identify lists the hop protocol): the only
    /// ones a private node asks to relay for it.
    relay_capable: HashSet<PeerId>,
    /// Refused full syncs per peer, behind their application score.
    sync_refusals: scoring::Refusals<PeerId>,
}

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
        && !t.contains("connection refused")
        && !t.contains("unreachable")
        && !t.contains("no route to host")
}

/// The reason a ban gives: the score, and the offences behind it when the mesh reported any.
fn ban_reason(score: f64, offences: Option<&Offences>) -> String {
    let threshold = scoring::GRAYLIST_THRESHOLD;
    match offences {
        Some(o) if o.count > 0 => format!(
            "gossip score {score:.1} fell below the graylist threshold {threshold} after {} offences (last: {})",
            o.count, o.last
        ),
        _ => format!(
            "gossip score {score:.1} fell below the graylist threshold {threshold} through gossip protocol misbehaviour (grafts during a prune backoff or broken gossip promises), with no rejected message"
        ),
    }
}

/// A member this node has seen: where it listens and when to try it again.
struct KnownPeer {
    addrs: Vec<Multiaddr>,
    last_seen: Instant,
    next_dial: Instant,
    backoff: Duration,
}

/// Delay between refusing a peer and closing its connection.
const HANG_UP_AFTER: Duration = Duration::from_millis(500);

fn message_id(m: &gossipsub::Message) -> MessageId {
    // Content addressed: the same update republished or replayed is one message.
    let mut h = Sha256::new();
    h.update(m.topic.as_str().as_bytes());
    h.update([0]);
    h.update(&m.data);
    MessageId::from(h.finalize()[..20].to_vec())
}

/// How long data sent on a connection may stay unacknowledged before the kernel aborts it.
/// Without it, a connection into a partition (or to a box whose cable was pulled) lingers for
/// minutes: closing it waits on TCP's retransmission backoff, and meanwhile requests and gossip
/// to that peer may still be routed into it (measured: the halves of a healed 30 s split took
/// ~25 s to sync again). Pings every second keep data in flight, so a dead link is cut after
/// this long.
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(8);

/// Sets [`TCP_USER_TIMEOUT`] on a fresh connection's socket (Linux; a no-op elsewhere).
fn abort_when_unacked(stream: &tokio::net::TcpStream) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_user_timeout(Some(TCP_USER_TIMEOUT)) {
        tracing::debug!("cannot set TCP_USER_TIMEOUT: {e}");
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = stream;
}

/// TCP with [`TCP_USER_TIMEOUT`], then (on a private network) the pre-shared-key layer, then
/// noise and yamux. The PSK layer sits below noise, so without the key not even the peer id
/// is exchanged. There is no QUIC transport: pnet can only wrap a stream transport, and TCP
/// alone keeps a private network private.
fn transport(
    key: &Keypair,
    psk: Option<PreSharedKey>,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, Box<dyn std::error::Error + Send + Sync>> {
    let noise = noise::Config::new(key)?;
    let tcp = tcp::tokio::Transport::new(tcp::Config::default().nodelay(true)).map(|stream, _| {
        abort_when_unacked(&stream.0);
        stream
    });
    let private = tcp.and_then(move |socket, _| async move {
        match psk {
            Some(psk) => libp2p::pnet::PnetConfig::new(psk)
                .handshake(socket)
                .await
                .map(futures::future::Either::Left),
            None => Ok(futures::future::Either::Right(socket)),
        }
    });
    Ok(private
        .upgrade(libp2p::core::upgrade::Version::V1Lazy)
        .authenticate(noise)
        .multiplex(yamux::Config::default())
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
        .boxed())
}

/// Builds the swarm and starts listening and dialing; returns the handle, the event stream,
/// and the loop to spawn.
pub fn new(
    key: Keypair,
    cfg: &NetConfig,
) -> Result<(Client, mpsc::Receiver<Event>, EventLoop), NetError> {
    let mut registry = prometheus_client::registry::Registry::default();
    let mut gossip_registry = prometheus_client::registry::Registry::default();
    let peer_id = key.public().to_peer_id();
    let protocol_version = protocol_version(&cfg.run_id);
    let pv = protocol_version.clone();
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_other_transport(|key| transport(key, cfg.psk))
        .map_err(|e| NetError::Build(e.to_string()))?
        .with_relay_client(noise::Config::new, yamux::Config::default)
        .map_err(|e| NetError::Build(e.to_string()))?
        .with_bandwidth_metrics(&mut registry)
        .with_behaviour(|key, relay_client| {
            let gossip_cfg = gossipsub::ConfigBuilder::default()
                .heartbeat_interval(Duration::from_millis(700))
                .validation_mode(gossipsub::ValidationMode::Strict)
                .validate_messages()
                .max_transmit_size(MAX_TRANSMIT_SIZE)
                .message_id_fn(message_id)
                .duplicate_cache_time(Duration::from_secs(120))
                .build()
                .map_err(|e| e.to_string())?;
            let mut gossipsub = gossipsub::Behaviour::new(
                gossipsub::MessageAuthenticity::Signed(key.clone()),
                gossip_cfg,
            )
            .map_err(|e| e.to_string())?
            // Per-topic message counts and sizes (protobuf envelope included): how the mesh
            // measures bytes per update on the wire.
            .with_metrics(&mut gossip_registry, Default::default());
            gossipsub.with_peer_score(scoring::peer_params(), scoring::thresholds())?;
            let mut kad_cfg = kad::Config::new(StreamProtocol::new("/p2ptrain/kad/1"));
            kad_cfg.set_query_timeout(Duration::from_secs(30));
            // The event loop walks the DHT itself once it has a peer; kad's own start-up
            // bootstrap would only warn that a founder knows nobody yet.
            kad_cfg.set_periodic_bootstrap_interval(None);
            let kad = kad::Behaviour::with_config(
                peer_id,
                kad::store::MemoryStore::new(peer_id),
                kad_cfg,
            );
            let codec =
                request_response::cbor::codec::Codec::<BulkRequest, BulkResponse>::default()
                    .set_request_size_maximum(BULK_REQUEST_MAX)
                    .set_response_size_maximum(BULK_RESPONSE_MAX);
            let bulk = request_response::Behaviour::with_codec(
                codec,
                [(
                    StreamProtocol::new("/p2ptrain/bulk/1"),
                    ProtocolSupport::Full,
                )],
                request_response::Config::default().with_request_timeout(BULK_TIMEOUT),
            );
            let mdns = if cfg.mdns {
                Some(
                    mdns::tokio::Behaviour::new(mdns::Config::default(), peer_id)
                        .map_err(|e| e.to_string())?,
                )
            } else {
                None
            };
            let allow = cfg.allow.as_ref().map(|peers| {
                let mut b =
                    allow_block_list::Behaviour::<allow_block_list::AllowedPeers>::default();
                for p in peers {
                    b.allow_peer(*p);
                }
                b
            });
            let autonat = autonat::Behaviour::new(
                peer_id,
                autonat::Config {
                    // Home labs are private address ranges; the default only probes and
                    // serves global addresses.
                    only_global_ips: false,
                    boot_delay: Duration::from_secs(3),
                    retry_interval: Duration::from_secs(15),
                    refresh_interval: Duration::from_secs(5 * 60),
                    throttle_server_period: Duration::from_secs(10),
                    ..Default::default()
                },
            );
            let relay = cfg
                .relay_server
                .then(|| relay::Behaviour::new(peer_id, relay::Config::default()));
            Ok(Behaviour {
                mdns: Toggle::from(mdns),
                allow: Toggle::from(allow),
                banned: allow_block_list::Behaviour::default(),
                relay_gate: nat::RelayGate::default(),
                autonat,
                relay_client,
                relay: Toggle::from(relay),
                dcutr: dcutr::Behaviour::new(peer_id),
                upnp: Toggle::from(cfg.upnp.then(upnp::tokio::Behaviour::default)),
                identify: identify::Behaviour::new(
                    identify::Config::new(pv, key.public())
                        .with_agent_version(agent_version())
                        // Relay addresses appear after the connection is up; peers need them.
                        .with_push_listen_addr_updates(true),
                ),
                ping: ping::Behaviour::new(
                    ping::Config::new()
                        .with_interval(PING_INTERVAL)
                        .with_timeout(PING_TIMEOUT),
                ),
                kad,
                gossipsub,
                bulk,
            })
        })
        .map_err(|e| NetError::Build(e.to_string()))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        .build();
    // On loopback no external address is ever confirmed, so Kademlia would stay a client and
    // never answer the lookups that let nodes find each other.
    swarm.behaviour_mut().kad.set_mode(Some(kad::Mode::Server));
    for addr in &cfg.listen {
        swarm
            .listen_on(addr.clone())
            .map_err(|e| NetError::Listen {
                addr: addr.to_string(),
                msg: e.to_string(),
            })?;
    }
    for addr in &cfg.bootstrap {
        swarm.dial(addr.clone()).map_err(|e| NetError::Dial {
            addr: addr.to_string(),
            msg: e.to_string(),
        })?;
    }
    let (cmd_tx, cmd_rx) = mpsc::channel(COMMAND_CAP);
    let (event_tx, event_rx) = mpsc::channel(EVENT_CAP);
    Ok((
        Client { cmd_tx },
        event_rx,
        EventLoop {
            swarm,
            cmd_rx,
            event_tx,
            registry,
            gossip_registry,
            protocol_version,
            members: HashMap::new(),
            refused: HashSet::new(),
            refused_count: 0,
            listen_addrs: Vec::new(),
            pending_requests: HashMap::new(),
            topics: HashSet::new(),
            last_walk: Instant::now(),
            hang_up: Vec::new(),
            bootstrap_peers: cfg
                .bootstrap
                .iter()
                .filter_map(|a| {
                    a.iter().find_map(|p| match p {
                        libp2p::multiaddr::Protocol::P2p(id) => Some(id),
                        _ => None,
                    })
                })
                .collect(),
            last_heard: HashMap::new(),
            banned: HashMap::new(),
            offences: HashMap::new(),
            known: HashMap::new(),
            psk_fingerprint: cfg.psk.map(|k| k.fingerprint().to_string()),
            allowlist: cfg.allow.as_ref().map(HashSet::len),
            handshake_failures: 0,
            peer_drops: 0,
            denied_connections: 0,
            links: Links::default(),
            relayed_members: HashMap::new(),
            nat: Nat::new(cfg.relay_server, cfg.upnp),
            relay_capable: HashSet::new(),
            sync_refusals: scoring::Refusals::default(),
        },
    ))
}

/// Hands an event to the node. Backpressure: the node drains this channel; if it falls
/// behind, the swarm waits.
async fn emit(tx: &mpsc::Sender<Event>, event: Event) {
    let _ = tx.send(event).await;
}

impl EventLoop {
    /// Runs until every [`Client`] is dropped.
    pub async fn run(mut self) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                event = self.swarm.select_next_some() => self.on_swarm_event(event).await,
                cmd = self.cmd_rx.recv() => match cmd {
                    Some(cmd) => self.on_command(cmd),
                    None => return,
                },
                _ = tick.tick() => self.on_tick().await,
            }
        }
    }

    async fn on_tick(&mut self) {
        let now = Instant::now();
        let silent: Vec<PeerId> = self
            .members
            .keys()
            .filter(|p| {
                self.last_heard
                    .get(p)
                    .is_some_and(|t| now.duration_since(*t) > SILENT_AFTER)
            })
            .copied()
            .collect();
        for peer in silent {
            tracing::info!(peer = %peer, "nothing heard (no ping answer, gossip or bulk message) for {SILENT_AFTER:?}; dropping the peer");
            self.drop_member(peer).await;
        }
        let gossip = &mut self.swarm.behaviour_mut().gossipsub;
        for (peer, score) in self.sync_refusals.decay() {
            gossip.set_application_score(&peer, score);
        }
        self.ban_graylisted(now).await;
        self.redial_lost(now);
        self.find_relay(now);
        let due: Vec<PeerId> = self
            .hang_up
            .iter()
            .filter(|(_, t)| *t <= now)
            .map(|(p, _)| *p)
            .collect();
        self.hang_up.retain(|(_, t)| *t > now);
        for peer in due {
            let _ = self.swarm.disconnect_peer_id(peer);
        }
        if self.last_walk.elapsed() >= KAD_WALK_EVERY && !self.members.is_empty() {
            let _ = self.swarm.behaviour_mut().kad.bootstrap();
            self.last_walk = Instant::now();
        }
    }

    /// Dials members lost without saying goodbye, with backoff: after a partition heals or a
    /// crashed box comes back on the same address, the mesh joins up again without waiting for
    /// a Kademlia walk (which may have dropped the unreachable peers from its table).
    fn redial_lost(&mut self, now: Instant) {
        for (peer, k) in self.known.iter_mut() {
            if self.members.contains_key(peer) {
                k.last_seen = now;
                k.backoff = REDIAL_MIN;
                k.next_dial = now + REDIAL_MIN;
            }
        }
        self.known
            .retain(|_, k| now.duration_since(k.last_seen) < FORGET_AFTER);
        let due: Vec<(PeerId, Vec<Multiaddr>)> = self
            .known
            .iter_mut()
            .filter(|(p, k)| {
                k.next_dial <= now
                    && !self.members.contains_key(p)
                    && !self.refused.contains(p)
                    && !self.banned.contains_key(p)
            })
            .map(|(p, k)| {
                k.next_dial = now + k.backoff;
                k.backoff = (k.backoff * 2).min(REDIAL_MAX);
                // The relay gate would refuse such a circuit, but only after the relay opened
                // it: this loop runs every few seconds, so it leaves circuits out itself.
                let relay_ok = self.swarm.behaviour().relay_gate.allows(p, now);
                let addrs = k
                    .addrs
                    .iter()
                    .filter(|a| relay_ok || !nat::is_circuit(a))
                    .cloned()
                    .collect();
                (*p, addrs)
            })
            .filter(|(_, addrs): &(PeerId, Vec<Multiaddr>)| !addrs.is_empty())
            .collect();
        for (peer, addrs) in due {
            tracing::debug!(peer = %peer, "redialling a lost member");
            let opts = libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
                .condition(libp2p::swarm::dial_opts::PeerCondition::DisconnectedAndNotDialing)
                .addresses(addrs)
                .build();
            let _ = self.swarm.dial(opts);
        }
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

    /// What a failed handshake most likely means, for the log: the commonest cause on a
    /// private network is a key mismatch, which pnet itself cannot detect (both sides just
    /// see garbage once the nonces are exchanged).
    fn key_hint(&self) -> String {
        match &self.psk_fingerprint {
            Some(f) => format!(
                "this node is on a private network (PSK fingerprint {f}): the peer may use another key, or none"
            ),
            None => "this node has no network key (--psk): if the peer runs a private network, this node needs its key".into(),
        }
    }

    /// Disconnects members whose gossip score fell below the graylist threshold and refuses
    /// them for [`scoring::BAN_FOR`]: gossipsub already ignores what they send, and the ban
    /// also frees the neighbour slot and the bulk channel they hold.
    async fn ban_graylisted(&mut self, now: Instant) {
        let expired: Vec<PeerId> = self
            .banned
            .iter()
            .filter(|(_, b)| b.until <= now)
            .map(|(p, _)| *p)
            .collect();
        for peer in expired {
            tracing::info!(peer = %peer, "ban ended; the peer may connect again");
            self.banned.remove(&peer);
            self.offences.remove(&peer);
            self.swarm.behaviour_mut().banned.unblock_peer(peer);
        }
        let gossip = &self.swarm.behaviour().gossipsub;
        let graylisted: Vec<(PeerId, f64)> = self
            .members
            .keys()
            .filter_map(|p| gossip.peer_score(p).map(|s| (*p, s)))
            .filter(|(_, s)| *s < scoring::GRAYLIST_THRESHOLD)
            .collect();
        for (peer, score) in graylisted {
            let reason = ban_reason(score, self.offences.get(&peer));
            tracing::warn!(peer = %peer, "banned for {:?}: {reason}", scoring::BAN_FOR);
            let until_unix = crate::store::unix_now() + scoring::BAN_FOR.as_secs();
            let ips = self
                .members
                .get(&peer)
                .and_then(|m| m.address.parse::<Multiaddr>().ok())
                .into_iter()
                .chain(
                    self.known
                        .get(&peer)
                        .into_iter()
                        .flat_map(|k| k.addrs.clone()),
                )
                .filter_map(|a| ip_of(&a))
                .collect();
            self.banned.insert(
                peer,
                Ban {
                    score,
                    until: now + scoring::BAN_FOR,
                    until_unix,
                    reason,
                    ips,
                },
            );
            // The block list refuses the peer's connections, either way, until the ban ends:
            // refused at the connection level, it is never mistaken for a failed handshake.
            self.swarm.behaviour_mut().banned.block_peer(peer);
            self.swarm.behaviour_mut().kad.remove_peer(&peer);
            self.drop_member(peer).await;
        }
    }

    /// Notes that `peer` showed signs of life, if it is a member.
    fn heard_from(&mut self, peer: PeerId) {
        if let Some(t) = self.last_heard.get_mut(&peer) {
            *t = Instant::now();
        }
    }

    /// A log text for a connection refused because of a ban, naming the ban when the denial's
    /// text names the peer.
    fn ban_text(&self, denial: &str) -> String {
        let found = self
            .banned
            .iter()
            .find(|(p, _)| denial.contains(&p.to_string()));
        match found {
            Some((p, b)) => format!(
                "peer {p} is banned for another {}s ({})",
                b.until.saturating_duration_since(Instant::now()).as_secs(),
                b.reason
            ),
            None => format!("the peer is banned ({denial})"),
        }
    }

    /// Disconnects a peer and tells the mesh at once: a hung peer's connections can take many
    /// seconds more to finish closing.
    async fn drop_member(&mut self, peer: PeerId) {
        let _ = self.swarm.disconnect_peer_id(peer);
        self.last_heard.remove(&peer);
        if self.members.remove(&peer).is_some() {
            self.peer_drops += 1;
            emit(&self.event_tx, Event::PeerDown(peer)).await;
        }
    }

    fn bandwidth(&self) -> (u64, u64) {
        let mut text = String::new();
        if prometheus_client::encoding::text::encode(&mut text, &self.registry).is_err() {
            return (0, 0);
        }
        let (mut sent, mut received) = (0u64, 0u64);
        for line in text
            .lines()
            .filter(|l| l.starts_with("libp2p_bandwidth_bytes_total{"))
        {
            let value = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0) as u64;
            if line.contains("direction=\"Outbound\"") {
                sent += value;
            } else if line.contains("direction=\"Inbound\"") {
                received += value;
            }
        }
        (sent, received)
    }

    fn topic_sent(&self) -> BTreeMap<String, (u64, u64)> {
        let mut text = String::new();
        let mut out: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        if prometheus_client::encoding::text::encode(&mut text, &self.gossip_registry).is_err() {
            return out;
        }
        for line in text.lines() {
            let counts = line.starts_with("topic_msg_sent_counts_total{");
            let bytes = line.starts_with("topic_msg_sent_bytes_total{");
            if !(counts || bytes) {
                continue;
            }
            let topic = line
                .split_once("hash=\"")
                .and_then(|(_, rest)| rest.split_once('"'))
                .map(|(t, _)| t.to_string());
            let value = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0) as u64;
            if let Some(topic) = topic {
                let e = out.entry(topic).or_default();
                if counts {
                    e.0 += value;
                } else {
                    e.1 += value;
                }
            }
        }
        out
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Publish { topic, data, reply } => {
                let result = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .publish(IdentTopic::new(topic), data)
                    .map(|_| ())
                    .map_err(|e| e.to_string());
                let _ = reply.send(result);
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
            Command::Offence { peer, why } => {
                let o = self.offences.entry(peer).or_default();
                o.count += 1;
                o.last = why;
            }
            Command::Validate {
                id,
                source,
                verdict,
            } => {
                self.swarm
                    .behaviour_mut()
                    .gossipsub
                    .report_message_validation_result(&id, &source, verdict);
            }
            Command::Request {
                peer,
                request,
                reply,
            } => {
                // Members always have a direct connection (see `on_swarm_event`).
                if !self.members.contains_key(&peer) {
                    let why = if self.relayed_members.contains_key(&peer) {
                        format!("peer {peer} is reachable only through a relay, which carries no bulk traffic")
                    } else {
                        format!("peer {peer} is not connected")
                    };
                    let _ = reply.send(Err(why));
                    return;
                }
                let id = self.swarm.behaviour_mut().bulk.send_request(&peer, request);
                self.pending_requests.insert(id, reply);
            }
            Command::Respond { channel, response } => {
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .bulk
                    .send_response(channel, response);
            }
            Command::Snapshot(reply) => {
                let (bytes_sent, bytes_received) = self.bandwidth();
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
                    .map(|(id, p)| PeerInfo {
                        score: gossip.peer_score(id),
                        path: self.links.path(id).map(str::to_string),
                        remote: self.links.remote(id),
                        ..p.clone()
                    })
                    .collect();
                let now = Instant::now();
                let mut banned: Vec<BannedPeer> = self
                    .banned
                    .iter()
                    .filter(|(_, b)| b.until > now)
                    .map(|(id, b)| BannedPeer {
                        peer_id: id.to_string(),
                        score: b.score,
                        secs_left: b.until.duration_since(now).as_secs_f64(),
                        until: b.until_unix,
                        reason: b.reason.clone(),
                    })
                    .collect();
                banned.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
                peers.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
                let mut topics: Vec<String> = self.topics.iter().cloned().collect();
                topics.sort();
                let _ = reply.send(NetSnapshot {
                    peers,
                    listen_addrs: listen
                        .into_iter()
                        .map(|a| format!("{a}/p2p/{me}"))
                        .collect(),
                    bytes_sent,
                    bytes_received,
                    refused_peers: self.refused_count,
                    topics,
                    topic_sent: self.topic_sent(),
                    banned,
                    psk_fingerprint: self.psk_fingerprint.clone(),
                    allowlist: self.allowlist,
                    handshake_failures: self.handshake_failures,
                    peer_drops: self.peer_drops,
                    denied_connections: self.denied_connections,
                    nat: self.nat.report(&self.listen_addrs),
                });
            }
            Command::Forget(peer) => {
                self.known.remove(&peer);
                self.relayed_members.remove(&peer);
                // It said goodbye (the mesh already let it go): not a drop.
                self.members.remove(&peer);
                self.last_heard.remove(&peer);
                let _ = self.swarm.disconnect_peer_id(peer);
            }
            Command::SyncRefused(peer) => {
                let score = self.sync_refusals.add(peer);
                self.swarm
                    .behaviour_mut()
                    .gossipsub
                    .set_application_score(&peer, score);
            }
        }
    }

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

    async fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
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
                if self.refused.contains(&peer_id) =>
            {
                let _ = self.swarm.disconnect_peer_id(peer_id);
            }
            SwarmEvent::ConnectionClosed { peer_id, .. } => {
                if !self.links.connected(&peer_id) {
                    self.relayed_members.remove(&peer_id);
                }
                if !self.links.has_direct(&peer_id) {
                    if let Some(info) = self.members.remove(&peer_id) {
                        self.last_heard.remove(&peer_id);
                        tracing::info!(peer = %peer_id, "peer gone");
                        self.peer_drops += 1;
                        if self.links.connected(&peer_id) {
                            self.relayed_members.insert(peer_id, info);
                        }
                        emit(&self.event_tx, Event::PeerDown(peer_id)).await;
                    }
                }
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                let text = error.to_string();
                if let libp2p::swarm::DialError::Denied { cause, .. } = &error {
                    if cause.downcast_ref::<nat::RelayGated>().is_some() {
                        tracing::debug!(peer = ?peer_id, "not connecting through a relay: hole punching failed recently");
                        return;
                    }
                }
                if let libp2p::swarm::DialError::Denied { cause, .. } = &error {
                    if cause.downcast_ref::<allow_block_list::Blocked>().is_some() {
                        tracing::debug!(peer = ?peer_id, "not connecting: the peer is banned");
                        return;
                    }
                }
                if matches!(error, libp2p::swarm::DialError::Denied { .. }) {
                    self.denied_connections += 1;
                    tracing::warn!(peer = ?peer_id, "not connecting: the peer is not on network.allow");
                } else if looks_like_handshake_failure(&text) {
                    self.handshake_failures += 1;
                    tracing::warn!(peer = ?peer_id, "handshake with a peer failed: {text}; {}", self.key_hint());
                } else if peer_id.is_some_and(|p| self.bootstrap_peers.contains(&p))
                    || peer_id.is_none()
                {
                    // A PSK mismatch can also look like a timeout (one side waits for a
                    // protocol answer the other cannot decrypt), so the hint goes here too.
                    tracing::warn!(peer = ?peer_id, "cannot reach a bootstrap member: {text}; {}", self.key_hint());
                } else {
                    tracing::debug!(peer = ?peer_id, "dial failed: {text}");
                }
            }
            SwarmEvent::IncomingConnectionError {
                send_back_addr,
                error,
                ..
            } => {
                let text = error.to_string();
                if let libp2p::swarm::ListenError::Denied { cause } = &error {
                    if cause.downcast_ref::<nat::RelayGated>().is_some() {
                        tracing::debug!(from = %send_back_addr, "refused a relayed connection: hole punching failed recently");
                        return;
                    }
                }
                if let libp2p::swarm::ListenError::Denied { cause } = &error {
                    if let Some(b) = cause.downcast_ref::<allow_block_list::Blocked>() {
                        let why = self.ban_text(&b.to_string());
                        tracing::info!(from = %send_back_addr, "refused a connection: {why}");
                        return;
                    }
                }
                let banned_there = ip_of(&send_back_addr).and_then(|ip| {
                    self.banned
                        .iter()
                        .find(|(_, b)| b.ips.contains(&ip))
                        .map(|(p, _)| *p)
                });
                if matches!(error, libp2p::swarm::ListenError::Denied { .. }) {
                    self.denied_connections += 1;
                    tracing::warn!(from = %send_back_addr, "refused a connection: the peer is not on network.allow");
                } else if let (true, Some(p)) = (looks_like_handshake_failure(&text), banned_there)
                {
                    tracing::info!(from = %send_back_addr, "an incoming connection broke off during the handshake ({text}): most likely banned peer {p} redialling, whose connections are refused for the ban");
                } else if looks_like_handshake_failure(&text) {
                    self.handshake_failures += 1;
                    tracing::warn!(from = %send_back_addr, "handshake with an incoming peer failed: {text}; {}", self.key_hint());
                } else {
                    tracing::debug!(from = %send_back_addr, "incoming connection failed: {text}");
                }
            }
            SwarmEvent::Behaviour(event) => self.on_behaviour_event(event).await,
            _ => {}
        }
    }

    async fn on_behaviour_event(&mut self, event: BehaviourEvent) {
        match event {
            BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                connection_id,
            }) => {
                if info.protocol_version != self.protocol_version {
                    if self.refused.insert(peer_id) {
                        self.refused_count += 1;
                        tracing::warn!(
                            peer = %peer_id,
                            "refused peer: it speaks {:?} ({}), this node speaks {:?}; a different run id (model, optimizer, data spec or seed) or gossip size limit cannot train together",
                            info.protocol_version,
                            info.agent_version,
                            self.protocol_version
                        );
                    }
                    self.swarm.behaviour_mut().kad.remove_peer(&peer_id);
                    // Hang up a moment later, so the stranger receives our identify too and
                    // can say why it was turned away instead of seeing a bare disconnect.
                    self.hang_up.push((peer_id, Instant::now() + HANG_UP_AFTER));
                    return;
                }
                if info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
                    self.relay_capable.insert(peer_id);
                } else {
                    self.relay_capable.remove(&peer_id);
                }
                for addr in &info.listen_addrs {
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
                let _ = connection_id;
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
                        },
                    );
                    return;
                }
                self.relayed_members.remove(&peer_id);
                self.known.insert(
                    peer_id,
                    KnownPeer {
                        addrs: info.listen_addrs.clone(),
                        last_seen: now,
                        next_dial: now + REDIAL_MIN,
                        backoff: REDIAL_MIN,
                    },
                );
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
                    emit(&self.event_tx, Event::PeerUp(peer_id)).await;
                }
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
                && !self.refused.contains(&peer)
                && peer != *self.swarm.local_peer_id() =>
            {
                // A circuit to a peer behind the relay gate is refused by the gate.
                let opts = libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
                    .addresses(addresses.into_vec())
                    .build();
                let _ = self.swarm.dial(opts);
            }
            BehaviourEvent::Mdns(mdns::Event::Discovered(found)) => {
                for (peer, addr) in found {
                    if !self.swarm.is_connected(&peer) && !self.refused.contains(&peer) {
                        tracing::info!(peer = %peer, %addr, "found on the local network (mDNS)");
                        let _ = self.swarm.dial(addr);
                    }
                }
            }
            BehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            }) => {
                self.heard_from(propagation_source);
                emit(
                    &self.event_tx,
                    Event::Gossip {
                        source: propagation_source,
                        author: message.source,
                        id: message_id,
                        topic: message.topic.into_string(),
                        data: message.data,
                    },
                )
                .await;
            }
            BehaviourEvent::Gossipsub(gossipsub::Event::Subscribed { peer_id, topic }) => {
                emit(
                    &self.event_tx,
                    Event::Subscribed {
                        peer: peer_id,
                        topic: topic.into_string(),
                    },
                )
                .await;
            }
            BehaviourEvent::Bulk(request_response::Event::Message {
                peer,
                message,
                connection_id,
            }) => match message {
                request_response::Message::Request {
                    request, channel, ..
                } => {
                    self.heard_from(peer);
                    if self.links.is_relayed(&peer, connection_id) {
                        self.nat.relayed_requests_refused += 1;
                        let _ = self.swarm.behaviour_mut().bulk.send_response(
                            channel,
                            BulkResponse::Refused(
                                "bulk requests are not served over a relayed connection".into(),
                            ),
                        );
                    } else if self.members.contains_key(&peer) {
                        emit(
                            &self.event_tx,
                            Event::Request {
                                peer,
                                request,
                                channel,
                            },
                        )
                        .await;
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
                    if let Some(reply) = self.pending_requests.remove(&request_id) {
                        let _ = reply.send(Ok(response));
                    }
                }
            },
            BehaviourEvent::Bulk(request_response::Event::OutboundFailure {
                request_id,
                error,
                peer,
                ..
            }) => {
                if let Some(reply) = self.pending_requests.remove(&request_id) {
                    let _ = reply.send(Err(format!("request to {peer} failed: {error}")));
                }
            }
            BehaviourEvent::Autonat(autonat::Event::StatusChanged { old, new }) => {
                tracing::info!("reachability: {old:?} -> {new:?} (AutoNAT)");
                for id in self.nat.set_status(new) {
                    self.swarm.remove_listener(id);
                }
            }
            BehaviourEvent::RelayClient(relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal: false,
                ..
            }) => {
                tracing::info!(relay = %relay_peer_id, "relay reservation accepted");
            }
            BehaviourEvent::Dcutr(dcutr::Event {
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
            BehaviourEvent::Upnp(event) => match event {
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
