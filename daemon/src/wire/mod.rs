//! What p2ptrain nodes say to each other, byte for byte: the bulk channel's requests and
//! replies (a state to join from, parameters to sync with, a large update) with the size
//! limits both sides enforce, the gossip topics' names, the framing of update messages on a
//! node's gossip topic, the heartbeats every member publishes, and the rounds' ring hops: their
//! values' encodings ([`hop_values`]), how a large hop is cut into pieces
//! ([`RingMessage::into_pieces`]) and the largest an honest one holds
//! ([`largest_hop_values`]). It owns the formats and
//! their version, not the transport: the network carries them and never looks inside.
//!
//! [`WIRE_VERSION`] is part of the bulk protocol name and of the identify protocol version
//! (see `network::protocol_version`), so nodes whose wire formats differ refuse each other
//! at the handshake instead of failing to decode each other's messages. Bump it whenever a
//! type here changes in a way an older node cannot read.

use libp2p::PeerId;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

pub mod hop_values;

pub use hop_values::ValueEncoding;

/// The topic a node publishes its updates on.
pub fn update_topic(run_id: &str, peer: &PeerId) -> String {
    format!("{}{peer}", update_topic_prefix(run_id))
}

/// What every update topic of a run begins with; the owner's peer id follows.
pub fn update_topic_prefix(run_id: &str) -> String {
    format!("p2ptrain/{run_id}/updates/")
}

/// The topic every member publishes its progress on.
pub fn heartbeat_topic(run_id: &str) -> String {
    format!("p2ptrain/{run_id}/heartbeat")
}

/// The names of run `run_id`'s topics, made once, to tell a run's topic from any other name
/// (gossipsub asks for every subscription a peer sends).
#[derive(Debug, Clone)]
pub struct RunTopicNames {
    heartbeat: String,
    update_prefix: String,
}

impl RunTopicNames {
    /// The topic names of run `run_id`.
    pub fn new(run_id: &str) -> Self {
        RunTopicNames {
            heartbeat: heartbeat_topic(run_id),
            update_prefix: update_topic_prefix(run_id),
        }
    }

    /// Whether `topic` is one of the run's: its heartbeat topic, or the update topic of a
    /// well-formed peer id.
    pub fn contains(&self, topic: &str) -> bool {
        topic == self.heartbeat
            || topic
                .strip_prefix(&self.update_prefix)
                .is_some_and(|p| p.parse::<PeerId>().is_ok())
    }
}

/// Version of this wire format. Peers compare it through the protocol names below, so it
/// changes only together with an incompatible change to these types.
/// Version 2: a full sync's parameters travel in the codec's dense format (header naming run,
/// layout, sender and step; checksum) instead of raw little-endian floats.
/// Version 3: ring messages of the synchronous sync modes ([`RingMessage`]); heartbeats say
/// whether their node takes part in rounds.
/// Version 4: heartbeats say whether their node needs the members' round start and velocity
/// (`diloco`), and a diloco ring may carry them beside the parameters; an older node would
/// digest such a ring's members differently and abort every round.
/// Version 5: rounds run as a butterfly all-reduce (hop 0 a member's part of the receiver's
/// chunk, hop 1 the sender's aggregate of its own chunk, each with a weight after the
/// values): an older node's hops would be refused as out of turn or of the wrong size.
/// Version 6: a hop larger than [`RING_PIECE_BYTES`] travels in pieces ([`RingMessage::piece`]):
/// an older node would take each piece for a hop of the wrong size.
/// Version 7: a heartbeat may name a peer whose later round its node found contradicted
/// (`contradicted`); an older node would refuse it as malformed, and blame its author.
/// Version 8: that field is [`Heartbeat::accused`], and names a peer left out for a part it
/// withheld as well; [`Heartbeat::accusations`] says how many times in a row.
/// Version 9: a `diloco` ring whose members share a round start sums their outer changes
/// (round start minus parameters) as bf16, not their parameters: an older node would take
/// the changes for parameters.
/// Version 10: a heartbeat says when its node is still starting ([`Heartbeat::starting`]); an
/// older node would refuse it as malformed.
/// Version 11: a ring hop names its values' encoding ([`RingMessage::encoding`]), which may be
/// int8 in blocks ([`hop_values`]), where it said only whether they were bf16.
pub const WIRE_VERSION: u32 = 11;

/// The most bytes of values one ring request carries: a larger hop (a share of a model of
/// more than ~8 M parameters, or a `diloco` share with its round anchor and velocity) travels
/// as several requests of this size, the last one shorter, and its receiver puts them
/// together (`mesh_core::rounds::pieces`). So no request a node reads before it knows whether
/// the sender is a member is larger than this, whatever the model, and no one request takes
/// longer on a slow link than a piece does. A multiple of 4: a piece holds whole values,
/// `f32` or bf16 (int8 blocks are cut anywhere: the receiver decodes the whole hop).
pub const RING_PIECE_BYTES: usize = 16 * 1024 * 1024;

/// Largest request on the bulk channel a node reads before it knows its model (and in the
/// fuzz tests); once it does, `network::BulkLimits::for_model` bounds each kind, a ring
/// request to one piece ([`RING_PIECE_BYTES`]) at most.
pub const BULK_REQUEST_MAX: u64 = BULK_RESPONSE_MAX;
/// Largest response on the bulk channel a node reads before it knows its model; once it
/// does, each answer is bounded by what its request asked for
/// (`network::BulkLimits::for_model`): a full sync's parameters fit whatever the model's size,
/// a state chunk's answer holds one chunk.
pub const BULK_RESPONSE_MAX: u64 = 64 * 1024 * 1024;

/// Bytes per chunk of a state a joiner downloads (the last may be shorter): small enough that
/// a dead donor costs little, large enough to be cheap. A manifest names any other size, and
/// the joiner refuses it.
pub const STATE_CHUNK_BYTES: usize = 256 * 1024;

/// Bytes a checkpoint holds beyond its tensors' values, at most: the safetensors header (names,
/// shapes, offsets) and our metadata. Generous: a digits MLP's whole checkpoint is 120 KB.
const STATE_OVERHEAD_BYTES: u64 = 1024 * 1024;

/// The largest state (a checkpoint file) of a model of `params` scalars: its parameters and at
/// most two optimizer slots per parameter (AdamW's moments; SGD's momentum is one), `f32` each,
/// and [`STATE_OVERHEAD_BYTES`]. A joiner refuses a manifest claiming more, and the network
/// reads a manifest only as long as this many bytes' chunk hashes make it.
pub fn largest_state_bytes(params: usize) -> u64 {
    (params as u64)
        .saturating_mul(4 * 3)
        .saturating_add(STATE_OVERHEAD_BYTES)
}

/// The bulk channel's protocol name; peers negotiate it, so it carries [`WIRE_VERSION`].
pub fn bulk_protocol() -> String {
    format!("/p2ptrain/bulk/{WIRE_VERSION}")
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
    /// One hop of a synchronous round's ring (answered with [`BulkResponse::RingTaken`]).
    Ring(RingMessage),
}

/// One hop of a round's butterfly all-reduce: the sender's part of the receiver's chunk, or the
/// sender's aggregate of its own chunk. See `mesh_core::rounds`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RingMessage {
    /// The round (rounds completed before it, mesh-wide).
    pub round: u64,
    /// The attempt at that round: an aborted attempt is retried with the next number.
    pub attempt: u32,
    /// Digest of the sorted member list the sender built its ring from: members whose lists
    /// differ cannot combine, and abort.
    pub members: u64,
    /// The hop: 0 a part (the values, then the sender's weight), 1 an aggregate (the values,
    /// then the weight total of the parts it aggregated).
    pub hop: u32,
    /// The chunk's values and the weight after them, as [`RingMessage::encoding`] says
    /// ([`hop_values`]).
    pub values: ByteBuf,
    /// The highest trainer step among the contributions the sender has seen this round: a
    /// node that was not synced takes the members' step with their mean (0 from a sender
    /// that predates this field).
    #[serde(default)]
    pub step: u64,
    /// How the values travel: `f32`, bf16 (the gradient rounds of `ddp`, `diloco`'s outer
    /// changes) or int8 in blocks (`diloco`'s outer changes, `sync.outer_values = "int8"`).
    #[serde(default)]
    pub encoding: ValueEncoding,
    /// Which piece of its hop this message is: `values` are the bytes of that piece only
    /// (see [`RING_PIECE_BYTES`]); [`Piece::WHOLE`] for a hop that fits one request.
    #[serde(default)]
    pub piece: Piece,
}

impl RingMessage {
    /// This hop cut into messages of at most `piece_bytes` bytes of values each (rounded down
    /// to a multiple of 4, at least 4), in order; a hop that fits one is sent whole, as it is.
    /// Every member must cut alike: at [`RING_PIECE_BYTES`] (smaller only in tests).
    pub fn into_pieces(self, piece_bytes: usize) -> Vec<RingMessage> {
        let piece_bytes = piece_bytes.max(4) / 4 * 4;
        if self.values.len() <= piece_bytes {
            return vec![self];
        }
        let count = self.values.len().div_ceil(piece_bytes) as u32;
        self.values
            .chunks(piece_bytes)
            .enumerate()
            .map(|(index, bytes)| RingMessage {
                values: ByteBuf::from(bytes.to_vec()),
                piece: Piece {
                    index: index as u32,
                    count,
                },
                ..self.piece_head()
            })
            .collect()
    }

    /// What every piece of this hop says alike: the message without its values, as piece 0.
    pub fn piece_head(&self) -> RingMessage {
        RingMessage {
            round: self.round,
            attempt: self.attempt,
            members: self.members,
            hop: self.hop,
            values: ByteBuf::new(),
            step: self.step,
            encoding: self.encoding,
            piece: Piece {
                index: 0,
                count: self.piece.count,
            },
        }
    }
}

/// The most values one honest hop of a model of `params` parameters holds: a whole `diloco`
/// contribution (the parameters, their round anchor and outer velocity) and the weight after
/// it, as a ring of one chunk would carry (a ring's chunks are smaller). The network bounds
/// ring requests and the rounds their inbox by it.
pub fn largest_hop_values(params: usize) -> usize {
    params.saturating_mul(3).saturating_add(1)
}

/// Where a ring message's bytes lie in its hop: piece `index` of `count`, every piece but the
/// last [`RING_PIECE_BYTES`] long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// The piece's place, from 0.
    pub index: u32,
    /// How many pieces the hop travels in.
    pub count: u32,
}

impl Piece {
    /// A hop in one message.
    pub const WHOLE: Piece = Piece { index: 0, count: 1 };
}

impl Default for Piece {
    /// [`Piece::WHOLE`]: a message that does not say is a whole hop.
    fn default() -> Piece {
        Piece::WHOLE
    }
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
    /// See [`BulkRequest::Params`]: the step and the parameters as one dense message of
    /// `p2ptrain_models::codec` (header naming run, layout, sender and step).
    Params {
        /// The donor's step.
        step: u64,
        /// Its parameter layout hash.
        layout: String,
        /// The dense message.
        values: ByteBuf,
    },
    /// See [`BulkRequest::Update`]: the encoded update.
    Update(ByteBuf),
    /// See [`BulkRequest::Ring`]: the hop was handed to the round (which judges it).
    RingTaken,
    /// The peer cannot or will not answer.
    Refused(String),
}

/// First byte of an update message that carries the encoded update itself.
const INLINE: u8 = b'U';
/// First byte of an update message that announces a large update by hash.
const ANNOUNCE: u8 = b'A';
/// Length of an announcement after its kind byte: hash, size, step.
const ANNOUNCE_LEN: usize = 32 + 8 + 8;

/// A message on a node's update topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateFrame<'a> {
    /// The encoded update (see `p2ptrain_models::codec`), small enough for gossip.
    Inline(&'a [u8]),
    /// A larger update, to be pulled from its author over the bulk channel by hash.
    Announce {
        /// SHA-256 of the encoded update.
        hash: [u8; 32],
        /// Its length in bytes.
        size: u64,
        /// The author's step.
        step: u64,
    },
}

/// Frames an update message.
pub fn encode_update_frame(frame: &UpdateFrame<'_>) -> Vec<u8> {
    match frame {
        UpdateFrame::Inline(bytes) => {
            let mut msg = Vec::with_capacity(bytes.len() + 1);
            msg.push(INLINE);
            msg.extend_from_slice(bytes);
            msg
        }
        UpdateFrame::Announce { hash, size, step } => {
            let mut msg = Vec::with_capacity(1 + ANNOUNCE_LEN);
            msg.push(ANNOUNCE);
            msg.extend_from_slice(hash);
            msg.extend_from_slice(&size.to_le_bytes());
            msg.extend_from_slice(&step.to_le_bytes());
            msg
        }
    }
}

/// Reads an update message's frame; the error says what is wrong, for the rejection.
pub fn decode_update_frame(data: &[u8]) -> Result<UpdateFrame<'_>, &'static str> {
    match data.split_first() {
        Some((&INLINE, bytes)) => Ok(UpdateFrame::Inline(bytes)),
        Some((&ANNOUNCE, rest)) if rest.len() == ANNOUNCE_LEN => {
            let mut hash = [0u8; 32];
            hash.copy_from_slice(&rest[..32]);
            let word = |r: &[u8]| u64::from_le_bytes(r.try_into().unwrap_or([0; 8]));
            Ok(UpdateFrame::Announce {
                hash,
                size: word(&rest[32..40]),
                step: word(&rest[40..48]),
            })
        }
        _ => Err("unknown update message kind"),
    }
}

/// What a peer last told the mesh about itself. A field this version does not know makes
/// the heartbeat malformed: nodes of one wire version write the same fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// Its step.
    pub step: u64,
    /// Its recent loss.
    pub loss: Option<f64>,
    /// Its throughput.
    pub samples_per_sec: f64,
    /// Its latest held-out accuracy.
    pub accuracy: Option<f64>,
    /// Its forward-backward milliseconds per sample: `ddp` members size their batches by
    /// the fastest member's (`rounds::balanced_batch`). Absent from older nodes.
    #[serde(default)]
    pub ms_per_sample: Option<f64>,
    /// Set in the last heartbeat of a node that leaves gracefully.
    #[serde(default)]
    pub leaving: bool,
    /// Set by a node of a synchronous sync mode that is ready for rounds: its peers put it in
    /// their rings.
    #[serde(default)]
    pub in_rounds: bool,
    /// The round that node works on, once it knows it.
    #[serde(default)]
    pub round: Option<u64>,
    /// Set by a `diloco` member whose round anchor and outer velocity are not the members'
    /// (a joiner, a node resumed from a checkpoint, a ring founding its state): its ring's
    /// parameter rounds carry them until one has made it a member like the others. Sent
    /// only when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub needs_state: bool,
    /// Set while the node has no state to train from yet (a joiner downloading one, a node
    /// loading its checkpoint): its step says nothing of where it will train, so no neighbour
    /// holds itself to it (the staleness bound) or counts a lead over it. Sent only when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub starting: bool,
    /// Rises with each of the node's heartbeats, across its restarts too (it starts from the
    /// node's start time, see `Membership`). Gossip addresses messages by content and drops
    /// one it has seen in the last two minutes: without it, a node whose progress stands still
    /// (held at a round's boundary, stopped) went unheard. Receivers ignore a heartbeat whose
    /// number is not above the last they took from its author, so an old one replayed (a
    /// goodbye, to make the mesh forget an honest peer) says nothing.
    #[serde(default)]
    pub seq: u64,
    /// A peer (its id) that named this node a later round most members' hops of the
    /// attempt under way contradicted, or that alone withheld its part of an attempt this
    /// node then left it out of, in the last minute (`rounds::Rounds::accuse`): a peer most
    /// members say so of, or one member says so of again, is left out of their rounds.
    /// Sent only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accused: Option<String>,
    /// How many times in a row this node accused that peer (each within a minute of the
    /// one before). Sent only when not 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub accusations: u32,
}

impl Heartbeat {
    /// The step a neighbour may be held to: the node's step once it trains, nothing while
    /// it starts.
    pub fn training_step(&self) -> Option<u64> {
        (!self.starting).then_some(self.step)
    }
}

/// Whether a count is 0, so a heartbeat leaves it out.
fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The largest heartbeat a node reads: one has a dozen short fields (about 200 bytes).
pub const HEARTBEAT_MAX_BYTES: usize = 1024;

/// Why a heartbeat's bytes were not read.
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    /// Larger than [`HEARTBEAT_MAX_BYTES`]: not decoded at all.
    #[error("a heartbeat of {0} bytes, more than {HEARTBEAT_MAX_BYTES}")]
    TooLarge(usize),
    /// Not a heartbeat of this wire version.
    #[error("a malformed heartbeat: {0}")]
    Malformed(#[from] serde_json::Error),
}

/// A heartbeat's bytes (JSON: small, rare, and readable in a packet capture).
pub fn encode_heartbeat(hb: &Heartbeat) -> Vec<u8> {
    serde_json::to_vec(hb).unwrap_or_default()
}

/// Reads a heartbeat, refusing one too large to be honest before decoding anything.
pub fn decode_heartbeat(data: &[u8]) -> Result<Heartbeat, HeartbeatError> {
    if data.len() > HEARTBEAT_MAX_BYTES {
        return Err(HeartbeatError::TooLarge(data.len()));
    }
    Ok(serde_json::from_slice(data)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_protocol_name_carries_the_wire_version() {
        // Peers negotiate exactly this name: one of another wire version is not spoken to.
        assert_eq!(bulk_protocol(), format!("/p2ptrain/bulk/{WIRE_VERSION}"));
        assert_eq!(bulk_protocol(), "/p2ptrain/bulk/11");
    }

    #[test]
    fn update_frames_round_trip_and_odd_bytes_are_refused() {
        let inline = encode_update_frame(&UpdateFrame::Inline(b"abc"));
        assert_eq!(
            decode_update_frame(&inline),
            Ok(UpdateFrame::Inline(b"abc"))
        );
        let announce = UpdateFrame::Announce {
            hash: [7; 32],
            size: 1234,
            step: 99,
        };
        let bytes = encode_update_frame(&announce);
        assert_eq!(decode_update_frame(&bytes), Ok(announce));
        assert!(decode_update_frame(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode_update_frame(b"").is_err());
        assert!(decode_update_frame(b"Zxyz").is_err());
    }

    #[test]
    fn heartbeats_round_trip() {
        let hb = Heartbeat {
            step: 5,
            loss: Some(0.5),
            samples_per_sec: 10.0,
            accuracy: None,
            ms_per_sample: Some(4.2),
            leaving: true,
            in_rounds: true,
            round: Some(3),
            needs_state: true,
            starting: true,
            seq: 9,
            accused: None,
            accusations: 0,
        };
        assert_eq!(
            decode_heartbeat(&encode_heartbeat(&hb)).expect("round trip"),
            hb
        );
        assert!(decode_heartbeat(b"{not json").is_err());
    }

    #[test]
    fn a_heartbeat_with_an_unknown_field_or_too_large_is_refused() {
        let mut value = serde_json::to_value(Heartbeat::default()).expect("json");
        value["shout"] = serde_json::Value::from("x");
        let unknown = serde_json::to_vec(&value).expect("bytes");
        assert!(matches!(
            decode_heartbeat(&unknown),
            Err(HeartbeatError::Malformed(_))
        ));
        // Padding that JSON would skip still makes it too large to read.
        let mut padded = encode_heartbeat(&Heartbeat::default());
        padded.extend(std::iter::repeat_n(b' ', HEARTBEAT_MAX_BYTES));
        assert!(matches!(
            decode_heartbeat(&padded),
            Err(HeartbeatError::TooLarge(_))
        ));
        let full = Heartbeat {
            step: u64::MAX,
            loss: Some(f64::MAX),
            samples_per_sec: f64::MAX,
            accuracy: Some(f64::MAX),
            ms_per_sample: Some(f64::MAX),
            leaving: true,
            in_rounds: true,
            round: Some(u64::MAX),
            needs_state: true,
            starting: true,
            seq: u64::MAX,
            accused: Some(libp2p::PeerId::random().to_string()),
            accusations: 2,
        };
        let bytes = encode_heartbeat(&full);
        assert!(bytes.len() <= HEARTBEAT_MAX_BYTES / 2, "{}", bytes.len());
        assert_eq!(
            decode_heartbeat(&bytes).expect("the largest honest one"),
            full
        );
    }
}
