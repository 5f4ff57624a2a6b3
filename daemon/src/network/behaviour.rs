//! Assembly of the swarm: the transport (TCP with a user timeout, the optional pre-shared
//! key, noise, yamux, relayed circuits, byte counting) and the composed behaviour with each
//! protocol's configuration. Nothing here runs: [`build`] returns a ready swarm for the event
//! loop to drive.

use std::time::Duration;

use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::Boxed;
use libp2p::core::Transport as _;
use libp2p::gossipsub::{self, MessageId};
use libp2p::identity::Keypair;
use libp2p::pnet::PreSharedKey;
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{
    allow_block_list, autonat, connection_limits, dcutr, identify, kad, mdns, noise, ping, relay,
    tcp, upnp, yamux, PeerId, StreamProtocol, Swarm,
};
use sha2::{Digest, Sha256};

use super::bulk_codec::BulkCodec;
use super::metrics::Bandwidth;
use super::Registry;

/// What the swarm builder accepts from a transport or behaviour constructor.
type BoxError = Box<dyn std::error::Error + Send + Sync>;
use super::{agent_version, NetConfig, NetError, MAX_TRANSMIT_SIZE, PING_INTERVAL, PING_TIMEOUT};
use crate::nat;
use crate::scoring;
use crate::wire;

/// Time a bulk request may take by default before it fails (and the caller tries another
/// peer): `network.request_timeout_secs`.
pub const BULK_TIMEOUT: Duration = Duration::from_secs(30);

/// How long data sent on a connection may stay unacknowledged before the kernel aborts it.
/// Without it, a connection into a partition (or to a box whose cable was pulled) lingers for
/// minutes: closing it waits on TCP's retransmission backoff, and meanwhile requests and gossip
/// to that peer may still be routed into it (measured: the halves of a healed 30 s split took
/// ~25 s to sync again). Pings every second keep data in flight, so a dead link is cut after
/// this long.
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(8);

/// Connections a node accepts that are still in their handshake: a peer (or many) opening
/// connections as fast as it can waits for a slot instead of costing a handshake each.
pub const MAX_PENDING_INCOMING: u32 = 64;
/// Established connections a node accepts from others, all peers together: far above any
/// home lab's mesh (each member keeps a connection or two to a few others), far below what
/// exhausts a box.
pub const MAX_ESTABLISHED_INCOMING: u32 = 512;
/// Established connections to one peer: a direct one, a relayed one and a hole-punched one
/// at most are honest; more is a peer opening connections to hold resources.
pub const MAX_ESTABLISHED_PER_PEER: u32 = 8;

// The derive generates an event enum without docs; keep it in a module that allows that.
#[allow(missing_docs)]
mod composed {
    use super::*;

    /// The composed behaviour. The derive asks the parts about a new connection in field
    /// order and stops at the first refusal, and some parts (request-response) record a
    /// connection as soon as they are asked: so every part that may refuse one (the limits,
    /// the allow and ban lists, the relay gate) comes first, and a refused connection reaches
    /// none of the protocols.
    #[derive(NetworkBehaviour)]
    pub struct Behaviour {
        pub(in crate::network) limits: connection_limits::Behaviour,
        pub(in crate::network) allow:
            Toggle<allow_block_list::Behaviour<allow_block_list::AllowedPeers>>,
        pub(in crate::network) banned: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
        pub(in crate::network) relay_gate: nat::RelayGate,
        pub(in crate::network) identify: identify::Behaviour,
        pub(in crate::network) ping: ping::Behaviour,
        pub(in crate::network) kad: kad::Behaviour<kad::store::MemoryStore>,
        pub(in crate::network) gossipsub: Gossipsub,
        pub(in crate::network) bulk: request_response::Behaviour<BulkCodec>,
        pub(in crate::network) mdns: Toggle<mdns::tokio::Behaviour>,
        pub(in crate::network) autonat: autonat::Behaviour,
        pub(in crate::network) relay_client: relay::client::Behaviour,
        pub(in crate::network) relay: Toggle<relay::Behaviour>,
        pub(in crate::network) dcutr: dcutr::Behaviour,
        pub(in crate::network) upnp: Toggle<upnp::tokio::Behaviour>,
    }
}
pub use composed::{Behaviour, BehaviourEvent};

/// A message's id: its author, topic and content. The same message republished or replayed
/// is one message, but two authors' equal bytes are two: two joiners that restored the same
/// state send heartbeats that are equal byte for byte until they train, and with the content
/// alone the second was dropped as "already published", so the mesh never heard it (a
/// synchronous mesh waiting for all its members then waited forever).
fn message_id(m: &gossipsub::Message) -> MessageId {
    let mut h = Sha256::new();
    if let Some(source) = &m.source {
        h.update(source.to_bytes());
    }
    h.update([0]);
    h.update(m.topic.as_str().as_bytes());
    h.update([0]);
    h.update(&m.data);
    MessageId::from(h.finalize()[..20].to_vec())
}

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
/// noise and yamux; or a relayed circuit with noise and yamux on top. Every connection's
/// substreams count into `bandwidth`. The PSK layer sits below noise, so without the key not
/// even the peer id is exchanged. There is no QUIC transport: pnet can only wrap a stream
/// transport, and TCP alone keeps a private network private.
fn transport(
    key: &Keypair,
    psk: Option<PreSharedKey>,
    relay: relay::client::Transport,
    bandwidth: Bandwidth,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, BoxError> {
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
    let direct = private
        .upgrade(libp2p::core::upgrade::Version::V1Lazy)
        .authenticate(noise)
        .multiplex(yamux::Config::default())
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)));
    // As libp2p's `with_relay_client` builds it: the circuit first, then the direct stack.
    let relayed = relay
        .upgrade(libp2p::core::upgrade::Version::V1Lazy)
        .authenticate(noise::Config::new(key)?)
        .multiplex(yamux::Config::default())
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)));
    Ok(relayed
        .or_transport(direct)
        .map(move |either, _| {
            let (peer, muxer) = either.into_inner();
            let muxer = bandwidth.count(peer, muxer);
            (peer, muxer)
        })
        .boxed())
}

/// gossipsub with subscriptions to run `run_id`'s topics only ([`RunTopics`]), at most
/// [`gossipsub::MaxCountSubscriptionFilter`]'s default of 100 per peer and per message.
pub type Gossipsub = gossipsub::Behaviour<
    gossipsub::IdentityTransform,
    gossipsub::MaxCountSubscriptionFilter<RunTopics>,
>;

/// Keeps a peer's subscriptions to topics of other runs (or to names that are no topic of
/// any run) out of gossipsub's tables: each would take an entry per peer in them, and a peer
/// of this run has no honest reason to name one. An honest node subscribes to its run's
/// heartbeat topic, its own update topic and its neighbours'.
#[derive(Debug, Clone)]
pub struct RunTopics {
    names: wire::RunTopicNames,
}

impl gossipsub::TopicSubscriptionFilter for RunTopics {
    fn can_subscribe(&mut self, topic: &gossipsub::TopicHash) -> bool {
        self.names.contains(topic.as_str())
    }
}

/// Run `run_id`'s topics only, at most 100 a peer and 100 in one message (gossipsub's
/// default counts).
fn subscription_filter(run_id: &str) -> gossipsub::MaxCountSubscriptionFilter<RunTopics> {
    let counts =
        gossipsub::MaxCountSubscriptionFilter::<gossipsub::AllowAllSubscriptionFilter>::default();
    gossipsub::MaxCountSubscriptionFilter {
        filter: RunTopics {
            names: wire::RunTopicNames::new(run_id),
        },
        max_subscribed_topics: counts.max_subscribed_topics,
        max_subscriptions_per_request: counts.max_subscriptions_per_request,
    }
}

/// The gossipsub behaviour: strict signing, every message held until the node's verdict,
/// content-hash ids, peer scoring, the size limit every node shares, and subscriptions to
/// run `run_id`'s topics only. Its own Prometheus metrics (mesh peers, scores, messages per
/// topic) go into `registry`.
fn gossipsub(key: &Keypair, run_id: &str, registry: &mut Registry) -> Result<Gossipsub, BoxError> {
    let gossip_cfg = gossipsub::ConfigBuilder::default()
        .heartbeat_interval(Duration::from_millis(700))
        .validation_mode(gossipsub::ValidationMode::Strict)
        .validate_messages()
        .max_transmit_size(MAX_TRANSMIT_SIZE)
        .message_id_fn(message_id)
        .duplicate_cache_time(Duration::from_secs(120))
        .build()
        .map_err(|e| e.to_string())?;
    let mut gossipsub = Gossipsub::new_with_subscription_filter(
        gossipsub::MessageAuthenticity::Signed(key.clone()),
        gossip_cfg,
        subscription_filter(run_id),
    )
    .map_err(|e| e.to_string())?
    .with_metrics(registry, gossip_metrics_config());
    gossipsub.with_peer_score(scoring::peer_params(), scoring::thresholds())?;
    Ok(gossipsub)
}

/// Gossipsub's metrics settings: its score histograms with buckets from 0 up only. OpenMetrics
/// forbids a histogram with negative buckets to carry a `_sum` (prometheus-client always writes
/// one, and a strict parser refuses the whole exposition), so negative scores all fall in the
/// first bucket; each peer's own score is in `p2ptrain_peer_score`.
fn gossip_metrics_config() -> gossipsub::MetricsConfig {
    gossipsub::MetricsConfig {
        score_buckets: vec![0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0],
        ..gossipsub::MetricsConfig::default()
    }
}

/// Every protocol of a node, configured from `cfg`.
fn behaviour(
    key: &Keypair,
    cfg: &NetConfig,
    protocol_version: String,
    relay_client: relay::client::Behaviour,
    registry: &mut Registry,
) -> Result<Behaviour, BoxError> {
    let peer_id = key.public().to_peer_id();
    let mut kad_cfg = kad::Config::new(StreamProtocol::new("/p2ptrain/kad/1"));
    kad_cfg.set_query_timeout(Duration::from_secs(30));
    // The event loop walks the DHT itself once it has a peer; kad's own start-up
    // bootstrap would only warn that a founder knows nobody yet.
    kad_cfg.set_periodic_bootstrap_interval(None);
    let kad = kad::Behaviour::with_config(peer_id, kad::store::MemoryStore::new(peer_id), kad_cfg);
    let codec = BulkCodec::new(cfg.bulk);
    let bulk_protocol =
        StreamProtocol::try_from_owned(wire::bulk_protocol()).map_err(|e| e.to_string())?;
    let bulk = request_response::Behaviour::with_codec(
        codec,
        [(bulk_protocol, ProtocolSupport::Full)],
        request_response::Config::default().with_request_timeout(cfg.request_timeout),
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
        let mut b = allow_block_list::Behaviour::<allow_block_list::AllowedPeers>::default();
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
    let limits = connection_limits::ConnectionLimits::default()
        .with_max_pending_incoming(Some(MAX_PENDING_INCOMING))
        .with_max_established_incoming(Some(MAX_ESTABLISHED_INCOMING))
        .with_max_established_per_peer(Some(MAX_ESTABLISHED_PER_PEER));
    Ok(Behaviour {
        limits: connection_limits::Behaviour::new(limits),
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
            identify::Config::new(protocol_version, key.public())
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
        gossipsub: gossipsub(key, &cfg.run_id, registry)?,
        bulk,
    })
}

/// Builds the swarm of a node with identity `key` speaking `protocol_version`; its
/// connections count their bytes into `bandwidth`, gossipsub registers its metrics in
/// `registry`. It neither listens nor dials yet.
pub fn build(
    key: Keypair,
    cfg: &NetConfig,
    protocol_version: String,
    bandwidth: Bandwidth,
    registry: &mut Registry,
) -> Result<Swarm<Behaviour>, NetError> {
    let (relay_transport, relay_client) = relay::client::new(key.public().to_peer_id());
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_other_transport(|key| transport(key, cfg.psk, relay_transport, bandwidth))
        .map_err(|e| NetError::Build(e.to_string()))?
        .with_behaviour(|key| behaviour(key, cfg, protocol_version, relay_client, registry))
        .map_err(|e| NetError::Build(e.to_string()))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        .build();
    // On loopback no external address is ever confirmed, so Kademlia would stay a client and
    // never answer the lookups that let nodes find each other.
    swarm.behaviour_mut().kad.set_mode(Some(kad::Mode::Server));
    Ok(swarm)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's subscriptions to other runs' topics and to non-topics are dropped, its run's
    /// kept (gossipsub asks `can_subscribe` of every incoming subscription), at most 100 a
    /// peer and a message.
    #[test]
    fn subscriptions_are_kept_to_the_runs_topics_and_counted() {
        use gossipsub::{TopicHash, TopicSubscriptionFilter};
        let peer = PeerId::random();
        let mut filter = subscription_filter("run1");
        let mut allows = |topic: String| filter.can_subscribe(&TopicHash::from_raw(topic));
        assert!(allows(wire::heartbeat_topic("run1")));
        assert!(allows(wire::update_topic("run1", &peer)));
        assert!(!allows(wire::heartbeat_topic("run2")));
        assert!(!allows(wire::update_topic("run2", &peer)));
        assert!(!allows(format!(
            "{}nobody",
            wire::update_topic_prefix("run1")
        )));
        assert!(!allows("junk".into()));
        assert_eq!(
            (
                filter.max_subscribed_topics,
                filter.max_subscriptions_per_request
            ),
            (100, 100)
        );
    }

    fn message(source: Option<PeerId>, data: &[u8]) -> gossipsub::Message {
        gossipsub::Message {
            source,
            data: data.to_vec(),
            sequence_number: None,
            topic: gossipsub::TopicHash::from_raw("heartbeat"),
        }
    }

    #[test]
    fn equal_bytes_from_two_authors_are_two_messages_and_a_replay_is_one() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let beat = br#"{"step":1,"seq":3}"#;
        assert_ne!(
            message_id(&message(Some(a), beat)),
            message_id(&message(Some(b), beat))
        );
        assert_eq!(
            message_id(&message(Some(a), beat)),
            message_id(&message(Some(a), beat))
        );
        assert_ne!(
            message_id(&message(Some(a), beat)),
            message_id(&message(Some(a), br#"{"step":1,"seq":4}"#))
        );
    }
}
