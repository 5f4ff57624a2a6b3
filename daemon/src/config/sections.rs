//! The sections of the configuration file that serde reads directly (`[train]`,
//! `[checkpoint]`, `[api]`, `[network]`, `[sync]`, `[debug]`): their fields, the one place
//! their defaults are written, and how their typed values (device, codec, shard, multiaddrs,
//! peer ids) are parsed while the file is read.

use super::*;

/// The train section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Samples per step.
    pub batch_size: usize,
    /// Seed of the initial weights: identical on every node of a run.
    pub init_seed: u64,
    /// Seed of this node's data order; absent, it is derived from the node's peer id.
    pub node_seed: Option<u64>,
    /// `(k, n)`: train only on shard `k` of `n` of the training set (every n-th sample from
    /// k), for boxes that each own part of the data. Absent: the whole set. A local setting,
    /// not part of the run id. Written `"k/n"` in the file.
    #[serde(deserialize_with = "de_shard")]
    pub shard: Option<(usize, usize)>,
    /// Steps between evaluations on the held-out set (0: not by steps).
    pub eval_every: u64,
    /// Also evaluate once this many seconds passed since the last evaluation (0: by steps
    /// only): where rounds cross slow links, `eval_every` steps can take minutes.
    pub eval_every_secs: f64,
    /// Stop after this many steps (0: train until stopped).
    pub max_steps: u64,
    /// Compute threads Candle may use.
    pub threads: usize,
    /// The compute device, parsed from `cpu`, `cuda` or `cuda:N`.
    #[serde(deserialize_with = "de_device")]
    pub device: DeviceSpec,
    /// A held-out figure the run aims for: bits per byte for a language model (reached at or
    /// below), accuracy otherwise (at or above). The node logs the step and time at which an
    /// evaluation first reaches it, and `p2ptrain local` counts each node's steps to it
    /// beside a lone node's. Absent: none. A local setting, not part of the run id.
    pub target: Option<f64>,
}

impl Default for TrainConfig {
    fn default() -> TrainConfig {
        TrainConfig {
            batch_size: 32,
            init_seed: 42,
            node_seed: None,
            shard: None,
            eval_every: 500,
            eval_every_secs: 0.0,
            max_steps: 0,
            threads: 1,
            device: DeviceSpec::Cpu,
            target: None,
        }
    }
}

impl TrainConfig {
    /// What serde cannot check: values out of range.
    pub(super) fn check(&self) -> Result<(), String> {
        if self.batch_size == 0 {
            return Err("train.batch_size must be at least 1".into());
        }
        if self.threads == 0 {
            return Err("train.threads must be at least 1".into());
        }
        if let Some(t) = self.target {
            if !(t.is_finite() && t > 0.0) {
                return Err(format!(
                    "train.target must be a positive number: bits per byte, or an accuracy in (0, 1] (got {t})"
                ));
            }
        }
        if std::time::Duration::try_from_secs_f64(self.eval_every_secs).is_err() {
            return Err(format!(
                "train.eval_every_secs must be a number of seconds, 0 or more (got {})",
                self.eval_every_secs
            ));
        }
        Ok(())
    }
}

/// The checkpoint section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Write a checkpoint every this many steps (0: not by steps).
    pub every_steps: u64,
    /// ... or when this many seconds have passed since the last one (0: not by time).
    pub every_secs: u64,
    /// How many checkpoints to keep on disk (the oldest go first).
    pub keep: usize,
}

impl Default for CheckpointConfig {
    fn default() -> CheckpointConfig {
        CheckpointConfig {
            every_steps: 5000,
            every_secs: 60,
            keep: 5,
        }
    }
}

/// Default control API address: loopback (the API asks for its token there too).
pub const DEFAULT_API: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 7070));

/// Default data directory of `p2ptrain join`, relative to the working directory.
pub const DEFAULT_DATA_DIR: &str = "p2ptrain-data";

/// Default libp2p port: a stable one, for firewall rules.
pub const DEFAULT_LISTEN_PORT: u16 = 7471;

/// The api section: where the control API listens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// The address (`--api` wins); default [`DEFAULT_API`].
    pub listen: SocketAddr,
    /// Host names the API answers to besides IP addresses and `localhost` (a request naming
    /// another in its `Host` header is refused: see `control::access`). Left out of the
    /// config's text when empty, so that configs written before it hash as they did.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allowed_hosts: Vec<String>,
}

impl ApiConfig {
    /// A host name is matched against the `Host` header's name alone: one written with a
    /// scheme, a port or a path would never match, silently.
    pub fn check(&self) -> Result<(), String> {
        match self
            .allowed_hosts
            .iter()
            .find(|h| h.is_empty() || h.contains([':', '/', '@', ' ']))
        {
            Some(h) => Err(format!(
                "api.allowed_hosts: {h:?} is not a bare host name (no scheme, port or path)"
            )),
            None => Ok(()),
        }
    }
}

impl Default for ApiConfig {
    fn default() -> ApiConfig {
        ApiConfig {
            listen: DEFAULT_API,
            allowed_hosts: Vec::new(),
        }
    }
}

/// The network section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// Addresses to listen on (default `/ip4/0.0.0.0/tcp/7471`).
    #[serde(deserialize_with = "de_listen")]
    pub listen: Vec<Multiaddr>,
    /// Members to join through.
    #[serde(deserialize_with = "de_bootstrap")]
    pub bootstrap: Vec<Multiaddr>,
    /// Find peers on the local network with mDNS (off by default).
    pub mdns: bool,
    /// The private network's key file (`p2ptrain keygen --psk`): only nodes with the same key
    /// can connect. Relative paths are taken from the working directory.
    pub psk: Option<PathBuf>,
    /// If given, the only peers allowed to connect.
    #[serde(deserialize_with = "de_allow")]
    pub allow: Option<Vec<PeerId>>,
    /// Relay for members behind NATs once AutoNAT finds this node reachable (on by default;
    /// libp2p's default limits of 128 KiB and two minutes per circuit keep bulk traffic off).
    pub relay_server: bool,
    /// Ask the router for a port mapping with UPnP (off by default: it talks to the real
    /// router of the machine's network).
    pub upnp: bool,
    /// Seconds a joiner waits for a member of the run to connect before it trains from the
    /// run's initial weights.
    pub join_wait_secs: f64,
    /// Seconds a joiner may spend on the mesh's state in all, over every donor it tries (0: no
    /// limit). Past it, it trains from the run's initial weights, and full syncs or the rounds
    /// bring it to the mesh: a donor that drips each chunk just inside the request timeout
    /// cannot hold it for ever.
    pub join_deadline_secs: f64,
    /// Seconds a bulk request (a state chunk, a neighbour's parameters, an update, a ring hop)
    /// may take before it fails and the caller tries another peer.
    pub request_timeout_secs: f64,
}

impl NetworkConfig {
    /// What serde cannot check: the join's and requests' times out of range.
    pub(super) fn check(&self) -> Result<(), String> {
        for (key, v, least) in [
            ("network.join_wait_secs", self.join_wait_secs, 0.0),
            ("network.join_deadline_secs", self.join_deadline_secs, 0.0),
            // Under a second an honest chunk or hop over a home link would fail.
            (
                "network.request_timeout_secs",
                self.request_timeout_secs,
                1.0,
            ),
        ] {
            if !(v >= least && v <= 86_400.0) {
                return Err(format!(
                    "{key} = {v} must be a number of seconds from {least} to 86400"
                ));
            }
        }
        Ok(())
    }

    /// The overall join deadline, `None` for none.
    pub fn join_deadline(&self) -> Option<std::time::Duration> {
        (self.join_deadline_secs > 0.0)
            .then(|| std::time::Duration::from_secs_f64(self.join_deadline_secs))
    }
}

impl Default for NetworkConfig {
    fn default() -> NetworkConfig {
        NetworkConfig {
            listen: vec![Multiaddr::empty()
                .with(Protocol::Ip4(Ipv4Addr::UNSPECIFIED))
                .with(Protocol::Tcp(DEFAULT_LISTEN_PORT))],
            bootstrap: Vec::new(),
            mdns: false,
            psk: None,
            allow: None,
            relay_server: true,
            upnp: false,
            join_wait_secs: 20.0,
            join_deadline_secs: 1800.0,
            request_timeout_secs: crate::network::BULK_TIMEOUT.as_secs_f64(),
        }
    }
}

/// How the members combine what they learn (see docs/modes.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// Asynchronous: updates gossiped to neighbours, full syncs now and then (Distributed
    /// Hogwild; SSP with `staleness_bound`).
    #[default]
    Gossip,
    /// Synchronous parameter averaging (local SGD): every `every` steps the members average
    /// their parameters in a ring and end with bit-identical parameters.
    Allreduce,
    /// Synchronous data parallelism as PyTorch DDP does it: at every step the members sum
    /// their gradients in the ring and each takes the same optimizer step with the mean, so
    /// N members train as one node with N times the batch; every `resync_every` rounds they
    /// average parameters instead, which brings joiners in.
    Ddp,
    /// `inner_steps` local steps, then an outer Nesterov step on the members' mean change.
    Diloco,
    /// `local_epochs` epochs over the node's own data, then a sample-weighted average.
    Fedavg,
}

impl SyncMode {
    /// Every mode, in the order help texts list them.
    pub const ALL: [SyncMode; 5] = [
        SyncMode::Gossip,
        SyncMode::Allreduce,
        SyncMode::Ddp,
        SyncMode::Diloco,
        SyncMode::Fedavg,
    ];

    /// The names of [`SyncMode::ALL`], for a command line's possible values.
    pub fn names() -> [&'static str; 5] {
        SyncMode::ALL.map(SyncMode::name)
    }

    /// The name used in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            SyncMode::Gossip => "gossip",
            SyncMode::Allreduce => "allreduce",
            SyncMode::Ddp => "ddp",
            SyncMode::Diloco => "diloco",
            SyncMode::Fedavg => "fedavg",
        }
    }
}

impl std::str::FromStr for SyncMode {
    type Err = String;

    fn from_str(s: &str) -> Result<SyncMode, String> {
        SyncMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown sync mode {s:?}: one of {}",
                    SyncMode::names().join(", ")
                )
            })
    }
}

/// The most neighbours a node keeps: with its heartbeat and own update topics, 100
/// subscriptions, what its peers' gossipsub takes of one peer.
pub const MAX_DEGREE: usize = 98;

/// The sync section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SyncConfig {
    /// How the members combine their training.
    pub mode: SyncMode,
    /// `allreduce`: steps between two rounds.
    pub every: u64,
    /// `ddp`: gradient rounds between two parameter rounds (at least 2).
    pub resync_every: u64,
    /// Synchronous modes: no round starts with fewer members than this; a founder waits for
    /// the others before its first round (1: never wait). `gossip`: a node takes its first
    /// step once it hears `min_members - 1` neighbours (at most `degree`), and never waits
    /// again.
    pub min_members: usize,
    /// `ddp`: a member more than 10% slower per sample than the fastest takes a smaller
    /// batch, the one it computes while the fastest computes the whole batch, and its
    /// gradient weighs by its samples; so a slow box adds what it can instead of holding every
    /// step back. Members of one speed always take the whole batch.
    pub balance_batches: bool,
    /// `diloco`: local steps between two outer steps (H).
    pub inner_steps: u64,
    /// `diloco`: the outer Nesterov step's learning rate.
    pub outer_lr: f64,
    /// `diloco`: the outer step's momentum.
    pub outer_momentum: f64,
    /// `diloco`: how the members' outer changes travel once they share a round start: `bf16`
    /// (half the bytes of `f32` parameters), `int8` (a little over a quarter: a scale per 64
    /// values, for slow links) or `f32`. A sync term: members must agree.
    pub outer_values: crate::wire::ValueEncoding,
    /// `diloco`: steps a member trains on while its round's outer changes cross the link
    /// (0: it waits). When the outer step arrives, the member keeps what it trained meanwhile
    /// on top of it, so a slow link costs no waiting up to this many steps (Streaming
    /// DiLoCo's overlap). Less than `inner_steps`. A local setting: every member still takes
    /// the same outer step from the same bits.
    pub overlap_steps: u64,
    /// `fedavg`: epochs over the node's own data between two averages (E).
    pub local_epochs: u64,
    /// Neighbours each node keeps.
    pub degree: usize,
    /// Steps between published updates (0: never).
    pub publish_every: u64,
    /// Steps between neighbour syncs (0: never).
    pub full_sync_every: u64,
    /// Updates up to this size travel inline in gossip.
    pub inline_max_bytes: usize,
    /// Reject a neighbour's update whose norm exceeds this times our parameters' norm.
    pub max_update_ratio: f64,
    /// `gossip`: how a node's own published change and its neighbours' combine: `add` (each
    /// keeps its own change whole and adds its neighbours' shares; the default) or `mean` (the
    /// neighbourhood moves by the mean of its members' changes). A sync term: members must agree.
    pub mix: crate::policy::Mixing,
    /// Fixed weight of a neighbour's update (default: the policy's `1 / (neighbours + 1)`
    /// times its staleness discount); `add` mixing only.
    pub update_weight: Option<f64>,
    /// How own updates are encoded.
    #[serde(serialize_with = "codec_name", deserialize_with = "de_codec")]
    pub codec: Codec,
    /// Fraction of values top-k keeps.
    pub density: f64,
    /// Keep what a lossy codec did not send and add it to the next update.
    pub error_feedback: bool,
    /// SSP: run at most this many steps ahead of the slowest neighbour (`None`: no bound).
    pub staleness_bound: Option<u64>,
    /// Staleness scale: an update `t` of its sender's steps behind the sender's latest known
    /// progress is weighted by `1 / (1 + t / stale_after)` (0: no discount).
    pub stale_after: u64,
    /// Publish before `publish_every` steps once the pending update's norm exceeds this
    /// fraction of the parameters' norm (0: off).
    pub publish_early_ratio: f64,
    /// Scale a neighbour's update whose norm exceeds this times the median of recently
    /// accepted ones down to that bound (and reject one 100 times beyond it, or beyond it 32
    /// times in a row); with it, each neighbour's budget holds it to 4 times this node's own
    /// pace (0: all of these off).
    pub outlier_factor: f64,
    /// Sustained updates per second accepted from one neighbour, with a burst of twice that;
    /// beyond it updates are dropped unread (0: no limit).
    pub max_updates_per_sec: f64,
    /// Clamp every value of a neighbour's update to `[-clip_value, clip_value]` (0: off).
    pub clip_value: f32,
    /// Cap on the relative distance `|mine - theirs| / |mine|` of a full-sync reply that is
    /// averaged; below it the bound follows recent accepted syncs (see
    /// [`crate::sync_guard`]). In (0, 1): a reply scaled by 2, or zeros, is at 1.
    pub max_sync_distance: f64,
    /// Synchronous modes: seconds an attempt of a round may make no progress before it is
    /// aborted and retried (a member hung without closing its connection, or one that takes
    /// hops and never forwards them). A local setting: members may differ.
    pub stall_timeout_secs: f64,
}

impl Default for SyncConfig {
    fn default() -> SyncConfig {
        SyncConfig {
            mode: SyncMode::Gossip,
            every: 1,
            resync_every: 25,
            min_members: 1,
            balance_batches: true,
            inner_steps: 100,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            outer_values: crate::wire::ValueEncoding::Bf16,
            overlap_steps: 0,
            local_epochs: 1,
            degree: 4,
            publish_every: 20,
            full_sync_every: 500,
            inline_max_bytes: 1024 * 1024,
            max_update_ratio: 1.0,
            mix: crate::policy::Mixing::default(),
            update_weight: None,
            codec: Codec::Dense,
            density: 0.01,
            error_feedback: true,
            staleness_bound: None,
            stale_after: 100,
            publish_early_ratio: 0.0,
            outlier_factor: 10.0,
            max_updates_per_sec: 200.0,
            clip_value: 0.0,
            max_sync_distance: crate::sync_guard::DEFAULT_MAX_SYNC_DISTANCE,
            stall_timeout_secs: crate::mesh_core::rounds::STALL_TIMEOUT.as_secs_f64(),
        }
    }
}

fn codec_name<S: serde::Serializer>(c: &Codec, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(c.name())
}

// Each typed value is parsed by serde, with an error that names its key (toml adds the line).
fn de_codec<'de, D: Deserializer<'de>>(d: D) -> Result<Codec, D::Error> {
    let text = String::deserialize(d)?;
    text.parse()
        .map_err(|e| de::Error::custom(format!("sync.codec: {e}")))
}

fn de_device<'de, D: Deserializer<'de>>(d: D) -> Result<DeviceSpec, D::Error> {
    let text = String::deserialize(d)?;
    text.parse()
        .map_err(|e| de::Error::custom(format!("train.device: {e}")))
}

fn de_shard<'de, D: Deserializer<'de>>(d: D) -> Result<Option<(usize, usize)>, D::Error> {
    let text = String::deserialize(d)?;
    parse_shard(&text).map(Some).map_err(de::Error::custom)
}

fn de_listen<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Multiaddr>, D::Error> {
    parse_all("network.listen", Vec::<String>::deserialize(d)?).map_err(de::Error::custom)
}

fn de_bootstrap<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Multiaddr>, D::Error> {
    parse_bootstrap("network.bootstrap", Vec::<String>::deserialize(d)?).map_err(de::Error::custom)
}

/// Parses bootstrap addresses (`key`: the key or flag, for the message). Each must name its
/// peer (`/p2p/<id>`): the joiner tells members of its bootstrap peers from strangers, and
/// gives up when every one trains another run, so an address without an id would leave it
/// waiting and then training alone with no word of why.
pub(super) fn parse_bootstrap(key: &str, items: Vec<String>) -> Result<Vec<Multiaddr>, String> {
    let addrs: Vec<Multiaddr> = parse_all(key, items)?;
    match addrs
        .iter()
        .find(|a| !matches!(a.iter().last(), Some(Protocol::P2p(_))))
    {
        Some(a) => Err(format!(
            "{key}: \"{a}\" names no peer: a bootstrap address ends in /p2p/<peer id>, as in the \
             `p2ptrain join --bootstrap ...` line the mesh's first node prints"
        )),
        None => Ok(addrs),
    }
}

fn de_allow<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<PeerId>>, D::Error> {
    parse_all("network.allow", Vec::<String>::deserialize(d)?)
        .map(Some)
        .map_err(de::Error::custom)
}

/// Parses every item, naming the key (or flag) and the item that fails.
pub(super) fn parse_all<T>(key: &str, items: Vec<String>) -> Result<Vec<T>, String>
where
    T: FromStr + Describe,
    T::Err: std::fmt::Display,
{
    items
        .iter()
        .map(|text| {
            text.parse::<T>()
                .map_err(|e| format!("{key}: {text:?} is not {} ({e})", T::WHAT))
        })
        .collect()
}

/// What a parsed value is called in messages.
pub(super) trait Describe {
    const WHAT: &'static str;
}

impl Describe for Multiaddr {
    const WHAT: &'static str = "a multiaddr";
}

impl Describe for PeerId {
    const WHAT: &'static str = "a peer id";
}

impl SyncConfig {
    /// What every member of a run must share about syncing, as the network's handshake
    /// compares it: the mode and the settings its rounds depend on. Settings a node may choose
    /// for itself (how often it publishes or syncs in gossip, its guards) are not terms.
    pub fn shared_terms(&self) -> String {
        match self.mode {
            SyncMode::Gossip => format!("gossip/mix/{}", self.mix.name()),
            SyncMode::Allreduce => format!("allreduce/every/{}", self.every),
            SyncMode::Ddp => format!("ddp/resync_every/{}", self.resync_every),
            SyncMode::Diloco => format!(
                "diloco/inner_steps/{}/outer_lr/{}/outer_momentum/{}/outer_values/{}",
                self.inner_steps,
                self.outer_lr,
                self.outer_momentum,
                self.outer_values.name()
            ),
            SyncMode::Fedavg => format!("fedavg/local_epochs/{}", self.local_epochs),
        }
    }

    /// The policy settings these give.
    pub fn policy(&self) -> crate::policy::PolicyConfig {
        // The synchronous modes neither gossip updates nor sync with neighbours: the rounds
        // do both.
        let gossip = self.mode == SyncMode::Gossip;
        crate::policy::PolicyConfig {
            publish_every: if gossip { self.publish_every } else { 0 },
            publish_early_ratio: if gossip {
                self.publish_early_ratio
            } else {
                0.0
            },
            full_sync_every: if gossip { self.full_sync_every } else { 0 },
            staleness_bound: if gossip { self.staleness_bound } else { None },
            stale_after: self.stale_after,
            mixing: self.mix,
            // A gossip node hears at most `degree` neighbours.
            wait_for_neighbours: if gossip {
                self.min_members.saturating_sub(1).min(self.degree)
            } else {
                0
            },
            ..crate::policy::PolicyConfig::default()
        }
    }

    /// The rounds of a synchronous mode, for a node with `train_samples` training samples and
    /// batches of `batch_size`; `None` in `gossip`.
    pub fn rounds(
        &self,
        train_samples: usize,
        batch_size: usize,
    ) -> Option<crate::mesh_core::rounds::config::RoundConfig> {
        let mut gradients = None;
        let (steps, weight) = match self.mode {
            SyncMode::Gossip => return None,
            SyncMode::Allreduce => (self.every, 1.0),
            SyncMode::Ddp => {
                gradients = Some(self.resync_every);
                (1, 1.0)
            }
            SyncMode::Diloco => (self.inner_steps, 1.0),
            SyncMode::Fedavg => {
                let per_epoch = train_samples.div_ceil(batch_size.max(1)) as u64;
                (self.local_epochs * per_epoch, train_samples as f32)
            }
        };
        Some(crate::mesh_core::rounds::config::RoundConfig {
            steps: steps.max(1),
            weight,
            gradients,
            min_members: self.min_members,
            batch: batch_size,
            balance: self.balance_batches && self.mode == SyncMode::Ddp,
            outer_state: self.mode == SyncMode::Diloco,
            stall_timeout: std::time::Duration::from_secs_f64(self.stall_timeout_secs),
            max_weight: if self.mode == SyncMode::Fedavg {
                f32::INFINITY
            } else {
                1.0
            },
            piece_bytes: crate::wire::RING_PIECE_BYTES,
            outer_values: self.outer_values,
            overlap_steps: if self.mode == SyncMode::Diloco {
                self.overlap_steps
            } else {
                0
            },
        })
    }

    /// DiLoCo's outer optimizer; `None` in the other modes.
    pub fn outer(&self) -> Option<p2ptrain_models::replica::OuterSgd> {
        (self.mode == SyncMode::Diloco).then_some(p2ptrain_models::replica::OuterSgd {
            lr: self.outer_lr as f32,
            momentum: self.outer_momentum as f32,
        })
    }

    /// The update guard's settings these give.
    pub fn guard(&self) -> crate::guard::GuardConfig {
        crate::guard::GuardConfig {
            outlier_factor: self.outlier_factor,
            max_updates_per_sec: self.max_updates_per_sec,
            burst: 2.0 * self.max_updates_per_sec,
            clip_value: self.clip_value,
        }
    }

    /// What serde cannot check: values out of range.
    pub(super) fn check(&self) -> Result<(), String> {
        // At 1 or beyond, a neighbour could replace the model with zeros, random values or
        // its own copy scaled by 2 and still be averaged in.
        if !(self.max_sync_distance > 0.0 && self.max_sync_distance < 1.0) {
            return Err(format!(
                "sync.max_sync_distance = {} must be a number in (0, 1): a reply of zeros or scaled by 2 is at 1",
                self.max_sync_distance
            ));
        }
        // Below a second an honest member still training towards the boundary, or sending a
        // hop of a large model over a home link, would abort every attempt.
        if !(self.stall_timeout_secs >= 1.0 && self.stall_timeout_secs <= 86_400.0) {
            return Err(format!(
                "sync.stall_timeout_secs = {} must be a number of seconds from 1 to 86400",
                self.stall_timeout_secs
            ));
        }
        if !(self.clip_value >= 0.0 && self.clip_value.is_finite()) {
            return Err("sync.clip_value must be 0 (off) or a positive number".into());
        }
        for (key, v) in [
            ("sync.outlier_factor", self.outlier_factor),
            ("sync.max_updates_per_sec", self.max_updates_per_sec),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(format!("{key} must be 0 (off) or a positive number"));
            }
        }
        if self.outlier_factor > 0.0 && self.outlier_factor < 2.0 {
            return Err(
                "sync.outlier_factor below 2 would reject honest updates (0 turns it off)".into(),
            );
        }
        if !(self.density > 0.0 && self.density <= 1.0) {
            return Err(format!("sync.density = {} must be in (0, 1]", self.density));
        }
        if self.min_members == 0 {
            return Err("sync.min_members must be at least 1 (the node itself)".into());
        }
        if self.resync_every < 2 {
            return Err(format!(
                "sync.resync_every = {} must be at least 2 (a parameter round every round leaves no gradient round)",
                self.resync_every
            ));
        }
        if self.staleness_bound == Some(0) {
            return Err(
                "sync.staleness_bound must be at least 1 (0 would make neighbours wait for each other forever)".into(),
            );
        }
        if !(self.publish_early_ratio >= 0.0 && self.publish_early_ratio.is_finite()) {
            return Err("sync.publish_early_ratio must be 0 or a positive number".into());
        }
        if let Some(w) = self.update_weight {
            if !(w > 0.0 && w <= 1.0) {
                return Err(format!("sync.update_weight = {w} must be in (0, 1]"));
            }
            if self.mix == crate::policy::Mixing::Mean {
                return Err(format!(
                    "sync.update_weight = {w} needs sync.mix = \"add\": mean mixing weighs every change by the neighbourhood's size"
                ));
            }
        }
        if self.degree == 0 {
            return Err("sync.degree must be at least 1".into());
        }
        // A node subscribes to its heartbeat topic, its own update topic and one per
        // neighbour; its peers' subscription filters take at most 100 (a message naming more is
        // ignored whole, and its updates would silently stop reaching them).
        if self.degree > MAX_DEGREE {
            return Err(format!(
                "sync.degree = {} must be at most {MAX_DEGREE} (gossipsub takes at most 100 subscriptions of a peer)",
                self.degree
            ));
        }
        if self.inline_max_bytes > crate::network::MAX_TRANSMIT_SIZE - 4096 {
            return Err(format!(
                "sync.inline_max_bytes must stay below the gossip limit ({} bytes) minus framing",
                crate::network::MAX_TRANSMIT_SIZE
            ));
        }
        if !(self.max_update_ratio > 0.0 && self.max_update_ratio.is_finite()) {
            return Err("sync.max_update_ratio must be a positive number".into());
        }
        for (key, v) in [
            ("sync.every", self.every),
            ("sync.inner_steps", self.inner_steps),
            ("sync.local_epochs", self.local_epochs),
        ] {
            if v == 0 {
                return Err(format!("{key} must be at least 1"));
            }
        }
        if !(self.outer_lr > 0.0 && self.outer_lr.is_finite()) {
            return Err(format!(
                "sync.outer_lr = {} must be a positive number",
                self.outer_lr
            ));
        }
        if !(0.0..1.0).contains(&self.outer_momentum) {
            return Err(format!(
                "sync.outer_momentum = {} must be in [0, 1)",
                self.outer_momentum
            ));
        }
        if self.mode == SyncMode::Diloco
            && self.overlap_steps > 0
            && self.overlap_steps >= self.inner_steps
        {
            return Err(format!(
                "sync.overlap_steps = {} must be less than sync.inner_steps = {} (a member trains on at most until its next round)",
                self.overlap_steps, self.inner_steps
            ));
        }
        Ok(())
    }
}

/// Debug knobs (for tests and experiments); all off by default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DebugConfig {
    /// Delay before serving each state chunk, to make transfers slow on purpose.
    pub serve_chunk_delay_ms: u64,
    /// Sleep after every training step: a throttle for tests (pacing, stragglers).
    pub step_delay_ms: u64,
    /// Sleep this many microseconds per sample inside every forward-backward pass: a box
    /// that computes slower, as `ms_per_sample` sees it (tests of `ddp`'s balanced batches).
    pub sample_delay_us: u64,
    /// Seconds between Kademlia random walks (0: the default, 30 s), so that a test which
    /// must see walks happen need not wait half a minute for each.
    pub kad_walk_secs: u64,
    /// Test only: this node sends hostile round hops (`ring_attack::RingAttack`), so a test
    /// can run a rogue round member as a real process. Release builds refuse it.
    pub ring_attack: Option<crate::ring_attack::RingAttack>,
}
