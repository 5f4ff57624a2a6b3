//! The full-sync path: the neighbour sync the policy asks for, from request to the trainer's
//! averaging. It judges the neighbour's reply (its answer's kind, header, codec and
//! finiteness here; its distance from our parameters in the trainer, which holds them),
//! keeps the distance bound ([`SyncGuard`]), and counts, scores and reports how each sync
//! ended. Parameters travel in the codec's dense format.
//!
//! How a sync ended goes back to the core as a [`SyncDone`], for the policy to hear.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use libp2p::PeerId;
use p2ptrain_models::codec::{self, Codec, UpdateHeader};
use p2ptrain_models::params::Layout;

use super::header::{all_finite, HeaderFault, HeaderIds};
use super::{
    count_for, AverageOutcome, FullSyncCounters, MeshStatus, Output, RequestFailed, SyncInfo,
    SyncRefusalInfo, TrainerCommand, WallClock,
};
use crate::sync_guard::{SyncGuard, SyncRefusal};
use crate::wire::BulkResponse;

/// Pause after a neighbour declined a sync, before the policy may start the next one: without
/// it a lone neighbour that declines (a joiner still downloading) was asked ~300 times a second.
pub(super) const SYNC_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Encodes this node's parameters for a neighbour that syncs with it: the codec's dense
/// format, whose header names run, layout, sender and step. Cheap to clone into the task that
/// answers the request.
#[derive(Debug, Clone)]
pub struct ParamsEncoder {
    header: UpdateHeader,
    layout: Layout,
    layout_hash: String,
}

impl ParamsEncoder {
    /// The dense message of `values` at `step`.
    pub fn encode(&self, step: u64, values: &[f32]) -> Result<Vec<u8>, codec::CodecError> {
        let header = UpdateHeader {
            base_step: step,
            step,
            numel: values.len() as u32,
            ..self.header
        };
        codec::encode(&header, &self.layout, values, 1.0).map(|e| e.bytes)
    }

    /// The layout's hash, which the reply also names in words.
    pub fn layout_hash(&self) -> String {
        self.layout_hash.clone()
    }
}

/// A sync that ended: the policy hears of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SyncDone {
    /// The neighbour.
    pub(super) peer: PeerId,
    /// Whether it averaged.
    pub(super) ok: bool,
}

/// How a sync ended, when it did not average.
enum SyncEnd {
    /// The neighbour's reply was judged and refused: its fault.
    Refused(SyncRefusal),
    /// No reply to judge (network, our own trainer): nobody's fault.
    Failed(String),
    /// The neighbour declined (a joiner still downloading, a node stopping): not its fault.
    Declined(String),
}

/// One neighbour sync under way.
#[derive(Debug, Clone)]
struct SyncInFlight {
    peer: PeerId,
    /// Numbers the trainer's answer, so one for an older sync is not taken for this one.
    seq: u64,
    /// Our step when it started.
    step: u64,
    /// When it was asked for: a sync's latency runs from here to the averaging.
    started: Instant,
}

/// A refused sync, as recorded until status renders it.
#[derive(Debug, Clone)]
struct Refusal {
    peer: PeerId,
    reason: String,
    distance: Option<f64>,
    bound: f64,
    at: u64,
}

/// Full syncs; see the module docs.
pub(super) struct Syncs {
    ids: HeaderIds,
    layout: Layout,
    wall_clock: WallClock,
    guard: SyncGuard,
    in_flight: Option<SyncInFlight>,
    seq: u64,
    /// A declined sync reported to the policy only after [`SYNC_RETRY_PAUSE`].
    finish_at: Option<(PeerId, Instant)>,
    counters: FullSyncCounters,
    last_refusal: Option<Refusal>,
    /// The latest averaged sync: neighbour, our step, Unix seconds.
    last_sync: Option<(PeerId, u64, u64)>,
    consensus_distance: Option<f64>,
    refusals: BTreeMap<PeerId, u64>,
}

impl Syncs {
    /// The sync path of node `me` in run `run_id`; replies farther than `max_sync_distance`
    /// are refused; `wall_clock` dates what status records.
    pub(super) fn new(
        me: &PeerId,
        run_id: &str,
        layout: Layout,
        max_sync_distance: f64,
        wall_clock: WallClock,
    ) -> Syncs {
        let guard = SyncGuard::new(max_sync_distance);
        Syncs {
            ids: HeaderIds::new(me, run_id, &layout),
            layout,
            wall_clock,
            counters: FullSyncCounters {
                bound: guard.bound(),
                ..FullSyncCounters::default()
            },
            guard,
            in_flight: None,
            seq: 0,
            finish_at: None,
            last_refusal: None,
            last_sync: None,
            consensus_distance: None,
            refusals: BTreeMap::new(),
        }
    }

    /// What the actor needs to answer a neighbour's sync request.
    pub(super) fn params_encoder(&self) -> ParamsEncoder {
        ParamsEncoder {
            header: self.ids.header(0, 0, Codec::Dense, 0),
            layout: self.layout.clone(),
            layout_hash: self.layout.hash(),
        }
    }

    /// Asks `peer` for its parameters, numbering the sync; `step` is ours now.
    pub(super) fn start(&mut self, peer: PeerId, step: u64, now: Instant, out: &mut Vec<Output>) {
        self.seq = self.seq.wrapping_add(1);
        self.in_flight = Some(SyncInFlight {
            peer,
            seq: self.seq,
            step,
            started: now,
        });
        out.push(Output::RequestParams(peer));
    }

    /// Judges what the neighbour sent; a reply that passes goes to the trainer to be measured
    /// against our parameters and averaged.
    pub(super) fn on_reply(
        &mut self,
        peer: PeerId,
        answer: Result<BulkResponse, RequestFailed>,
        now: Instant,
        out: &mut Vec<Output>,
    ) -> Option<SyncDone> {
        let Some(sync) = self.in_flight.clone().filter(|s| s.peer == peer) else {
            // Not the sync under way (a restore voided it): nothing to judge.
            return None;
        };
        let values = match answer {
            Err(e) => return self.end(peer, SyncEnd::Failed(e.to_string()), now, out),
            // An honest neighbour declines while it has no state or is stopping.
            Ok(BulkResponse::Refused(why)) => {
                return self.end(peer, SyncEnd::Declined(why), now, out)
            }
            Ok(BulkResponse::Params { values, .. }) => {
                self.counters.bytes_received += values.len() as u64;
                match self.judge(peer, &values) {
                    Ok(v) => v,
                    Err(refusal) => return self.end(peer, SyncEnd::Refused(refusal), now, out),
                }
            }
            Ok(other) => {
                let what = match other {
                    BulkResponse::StateManifest(_) => "a state manifest",
                    BulkResponse::StateChunk(_) => "a state chunk",
                    _ => "an update",
                };
                let refusal = SyncRefusal::WrongAnswer(what.into());
                return self.end(peer, SyncEnd::Refused(refusal), now, out);
            }
        };
        out.push(Output::Trainer(TrainerCommand::Average {
            seq: sync.seq,
            theirs: values,
            bound: self.guard.bound(),
        }));
        None
    }

    /// Decodes a dense parameter message and checks that it is of our run and layout, from
    /// the neighbour asked, dense, and finite.
    fn judge(&self, peer: PeerId, bytes: &[u8]) -> Result<Vec<f32>, SyncRefusal> {
        let (header, values) =
            codec::decode(bytes, &self.layout).map_err(|e| SyncRefusal::Layout(e.to_string()))?;
        self.ids
            .check(&header, &peer)
            .map_err(|fault| match fault {
                HeaderFault::Run => SyncRefusal::Layout("parameters of another run".into()),
                HeaderFault::Layout(theirs) => SyncRefusal::Layout(format!(
                    "layout {}, ours is {}",
                    hex::encode(theirs),
                    self.layout.hash()
                )),
                HeaderFault::Sender => {
                    SyncRefusal::WrongAnswer("parameters that name another sender".into())
                }
            })?;
        if header.codec != Codec::Dense {
            return Err(SyncRefusal::Layout(format!(
                "parameters encoded with {}, not dense",
                header.codec.name()
            )));
        }
        if !all_finite(&values) {
            return Err(SyncRefusal::NotFinite);
        }
        Ok(values)
    }

    /// The trainer measured and averaged (or refused) the reply to sync `seq`.
    pub(super) fn on_averaged(
        &mut self,
        seq: u64,
        outcome: AverageOutcome,
        now: Instant,
        out: &mut Vec<Output>,
    ) -> Option<SyncDone> {
        let sync = self.in_flight.clone().filter(|s| s.seq == seq)?;
        match outcome {
            AverageOutcome::Averaged(distance) => {
                tracing::debug!(peer = %sync.peer, distance, bound = self.guard.bound(), "neighbour sync");
                self.guard.record(distance);
                self.consensus_distance = Some(distance);
                let c = &mut self.counters;
                c.accepted += 1;
                c.bound = self.guard.bound();
                c.largest_accepted = self.guard.largest_accepted();
                let secs = now.saturating_duration_since(sync.started).as_secs_f64();
                c.last_secs = Some(secs);
                c.secs_total += secs;
                self.last_sync = Some((sync.peer, sync.step, self.wall_clock.unix_at(now)));
                self.in_flight = None;
                Some(SyncDone {
                    peer: sync.peer,
                    ok: true,
                })
            }
            AverageOutcome::Refused(refusal) => {
                self.end(sync.peer, SyncEnd::Refused(refusal), now, out)
            }
            AverageOutcome::Failed(e) => self.end(sync.peer, SyncEnd::Failed(e), now, out),
        }
    }

    /// A declined sync whose pause is over, for the policy to hear of.
    pub(super) fn tick(&mut self, now: Instant) -> Option<SyncDone> {
        let (peer, at) = self.finish_at?;
        if now < at {
            return None;
        }
        self.finish_at = None;
        Some(SyncDone { peer, ok: false })
    }

    /// A checkpoint replaced the parameters: a sync under way measured the old ones, and its
    /// answer is ignored.
    pub(super) fn restored(&mut self) {
        self.in_flight = None;
        self.finish_at = None;
    }

    /// Counts a sync that did not average; the policy then picks the least recently synced
    /// other neighbour at its next step. A refusal lowers the neighbour's score and names the
    /// offence; a decline is reported only after a pause.
    fn end(
        &mut self,
        peer: PeerId,
        end: SyncEnd,
        now: Instant,
        out: &mut Vec<Output>,
    ) -> Option<SyncDone> {
        self.in_flight = None;
        match end {
            SyncEnd::Failed(e) => {
                tracing::info!(%peer, "neighbour sync skipped: {e}");
                self.counters.failed += 1;
            }
            SyncEnd::Declined(e) => {
                tracing::info!(%peer, "neighbour sync skipped: the neighbour declined: {e}");
                self.counters.failed += 1;
                self.finish_at = Some((peer, now + SYNC_RETRY_PAUSE));
                return None;
            }
            SyncEnd::Refused(why) => {
                let bound = why.bound().unwrap_or(self.guard.bound());
                tracing::warn!(
                    %peer,
                    distance = why.distance(),
                    bound,
                    "refused neighbour sync: {why}; the peer's score is lowered"
                );
                self.counters.refused += 1;
                count_for(&mut self.refusals, &peer);
                self.last_refusal = Some(Refusal {
                    peer,
                    reason: why.to_string(),
                    distance: why.distance(),
                    bound,
                    at: self.wall_clock.unix_at(now),
                });
                out.push(Output::Offence {
                    peer,
                    why: format!("refused full-sync reply: {why}"),
                });
                out.push(Output::SyncRefused(peer));
            }
        }
        Some(SyncDone { peer, ok: false })
    }

    /// Per-peer refusal counts kept.
    #[cfg(test)]
    pub(super) fn refusals_len(&self) -> usize {
        self.refusals.len()
    }

    /// This path's part of the status, peers named as strings.
    pub(super) fn render(&self, status: &mut MeshStatus) {
        status.full_syncs = FullSyncCounters {
            last_refusal: self.last_refusal.as_ref().map(|r| SyncRefusalInfo {
                peer: r.peer.to_string(),
                reason: r.reason.clone(),
                distance: r.distance,
                bound: r.bound,
                at: r.at,
            }),
            ..self.counters.clone()
        };
        status.sync_refusals = self
            .refusals
            .iter()
            .map(|(p, n)| (p.to_string(), *n))
            .collect();
        status.last_sync = self.last_sync.map(|(peer, step, at)| SyncInfo {
            peer: peer.to_string(),
            step,
            at,
        });
        status.consensus_distance = self.consensus_distance;
    }
}
