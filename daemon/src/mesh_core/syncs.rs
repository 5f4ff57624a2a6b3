//! The core's full-sync path: starting the neighbour sync the policy asks for, judging the
//! neighbour's reply (its answer's kind, run, layout and finiteness here; its distance from
//! our parameters in the trainer, which holds them), and counting, scoring and reporting how
//! each sync ended. Parameters travel in the codec's dense format.

use std::time::Instant;

use libp2p::PeerId;
use p2ptrain_models::codec::{self, Codec, UpdateHeader};
use p2ptrain_models::params::Layout;

use super::{
    count_for, AverageOutcome, MeshCore, Output, RequestFailed, SyncInFlight, SyncInfo,
    SyncRefusalInfo, TrainerCommand, SYNC_RETRY_PAUSE,
};
use crate::policy::PolicyEvent;
use crate::sync_guard::SyncRefusal;
use crate::wire::BulkResponse;

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

/// How a sync ended, when it did not average.
enum SyncEnd {
    /// The neighbour's reply was judged and refused: its fault.
    Refused(SyncRefusal),
    /// No reply to judge (network, our own trainer): nobody's fault.
    Failed(String),
    /// The neighbour declined (a joiner still downloading, a node stopping): not its fault.
    Declined(String),
}

impl MeshCore {
    /// What the actor needs to answer a neighbour's sync request.
    pub fn params_encoder(&self) -> ParamsEncoder {
        ParamsEncoder {
            header: UpdateHeader {
                run_id: self.run_bytes,
                layout: self.layout_bytes,
                sender: self.me_bytes,
                base_step: 0,
                step: 0,
                codec: Codec::Dense,
                numel: 0,
            },
            layout: self.cfg.layout.clone(),
            layout_hash: self.cfg.layout.hash(),
        }
    }

    pub(super) fn start_sync(&mut self, peer: PeerId, now: Instant, out: &mut Vec<Output>) {
        self.sync_seq = self.sync_seq.wrapping_add(1);
        self.sync = Some(SyncInFlight {
            peer,
            seq: self.sync_seq,
            step: self.progress.step,
            started: now,
        });
        out.push(Output::RequestParams(peer));
    }

    /// Judges what the neighbour sent; a reply that passes goes to the trainer to be measured
    /// against our parameters and averaged.
    pub(super) fn on_params_reply(
        &mut self,
        peer: PeerId,
        answer: Result<BulkResponse, RequestFailed>,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let Some(sync) = self.sync.clone().filter(|s| s.peer == peer) else {
            // Not the sync under way (a restore voided it): nothing to judge.
            return;
        };
        let values = match answer {
            Err(e) => return self.end_sync(peer, SyncEnd::Failed(e.to_string()), now, out),
            // An honest neighbour declines while it has no state or is stopping.
            Ok(BulkResponse::Refused(why)) => {
                return self.end_sync(peer, SyncEnd::Declined(why), now, out)
            }
            Ok(BulkResponse::Params { values, .. }) => {
                self.status.full_syncs.bytes_received += values.len() as u64;
                match self.judge_params(peer, &values) {
                    Ok(v) => v,
                    Err(refusal) => {
                        return self.end_sync(peer, SyncEnd::Refused(refusal), now, out)
                    }
                }
            }
            Ok(other) => {
                let what = match other {
                    BulkResponse::StateManifest(_) => "a state manifest",
                    BulkResponse::StateChunk(_) => "a state chunk",
                    _ => "an update",
                };
                let refusal = SyncRefusal::WrongAnswer(what.into());
                return self.end_sync(peer, SyncEnd::Refused(refusal), now, out);
            }
        };
        out.push(Output::Trainer(TrainerCommand::Average {
            seq: sync.seq,
            theirs: values,
            bound: self.sync_guard.bound(),
        }));
    }

    /// Decodes a dense parameter message and checks that it is of our run and layout, from
    /// the neighbour asked, and finite.
    fn judge_params(&self, peer: PeerId, bytes: &[u8]) -> Result<Vec<f32>, SyncRefusal> {
        let (header, values) = codec::decode(bytes, &self.cfg.layout)
            .map_err(|e| SyncRefusal::Layout(e.to_string()))?;
        if header.run_id != self.run_bytes {
            return Err(SyncRefusal::Layout("parameters of another run".into()));
        }
        if header.layout != self.layout_bytes {
            return Err(SyncRefusal::Layout(format!(
                "layout {}, ours is {}",
                hex::encode(header.layout),
                self.cfg.layout.hash()
            )));
        }
        if header.codec != Codec::Dense {
            return Err(SyncRefusal::Layout(format!(
                "parameters encoded with {}, not dense",
                header.codec.name()
            )));
        }
        if header.sender != codec::sender_bytes(&peer.to_bytes()) {
            return Err(SyncRefusal::WrongAnswer(
                "parameters that name another sender".into(),
            ));
        }
        if values.iter().any(|v| !v.is_finite()) {
            return Err(SyncRefusal::NotFinite);
        }
        Ok(values)
    }

    /// The trainer measured and averaged (or refused) the reply.
    pub(super) fn on_averaged(
        &mut self,
        seq: u64,
        outcome: AverageOutcome,
        now: Instant,
        out: &mut Vec<Output>,
    ) {
        let Some(sync) = self.sync.clone().filter(|s| s.seq == seq) else {
            return;
        };
        match outcome {
            AverageOutcome::Averaged(distance) => {
                tracing::debug!(peer = %sync.peer, distance, bound = self.sync_guard.bound(), "neighbour sync");
                self.sync_guard.record(distance);
                let s = &mut self.status;
                s.consensus_distance = Some(distance);
                s.full_syncs.accepted += 1;
                s.full_syncs.bound = self.sync_guard.bound();
                s.full_syncs.largest_accepted = self.sync_guard.largest_accepted();
                let secs = now.saturating_duration_since(sync.started).as_secs_f64();
                s.full_syncs.last_secs = Some(secs);
                s.full_syncs.secs_total += secs;
                s.last_sync = Some(SyncInfo {
                    peer: sync.peer.to_string(),
                    step: sync.step,
                    at: self.cfg.wall_clock.unix_at(now),
                });
                self.sync = None;
                self.feed(
                    PolicyEvent::SyncFinished {
                        peer: sync.peer,
                        ok: true,
                    },
                    now,
                    out,
                );
            }
            AverageOutcome::Refused(refusal) => {
                self.end_sync(sync.peer, SyncEnd::Refused(refusal), now, out)
            }
            AverageOutcome::Failed(e) => self.end_sync(sync.peer, SyncEnd::Failed(e), now, out),
        }
    }

    /// Counts a sync that did not average and tells the policy, which then picks the least
    /// recently synced other neighbour at its next step. A refusal lowers the neighbour's
    /// score and names the offence; a decline is reported only after a pause.
    fn end_sync(&mut self, peer: PeerId, end: SyncEnd, now: Instant, out: &mut Vec<Output>) {
        self.sync = None;
        match end {
            SyncEnd::Failed(e) => {
                tracing::info!(%peer, "neighbour sync skipped: {e}");
                self.status.full_syncs.failed += 1;
            }
            SyncEnd::Declined(e) => {
                tracing::info!(%peer, "neighbour sync skipped: the neighbour declined: {e}");
                self.status.full_syncs.failed += 1;
                self.sync_finish_at = Some((peer, now + SYNC_RETRY_PAUSE));
                return;
            }
            SyncEnd::Refused(why) => {
                let bound = why.bound().unwrap_or(self.sync_guard.bound());
                tracing::warn!(
                    %peer,
                    distance = why.distance(),
                    bound,
                    "refused neighbour sync: {why}; the peer's score is lowered"
                );
                let s = &mut self.status;
                s.full_syncs.refused += 1;
                count_for(&mut s.sync_refusals, &peer);
                s.full_syncs.last_refusal = Some(SyncRefusalInfo {
                    peer: peer.to_string(),
                    reason: why.to_string(),
                    distance: why.distance(),
                    bound,
                    at: self.cfg.wall_clock.unix_at(now),
                });
                out.push(Output::Offence {
                    peer,
                    why: format!("refused full-sync reply: {why}"),
                });
                out.push(Output::SyncRefused(peer));
            }
        }
        self.feed(PolicyEvent::SyncFinished { peer, ok: false }, now, out);
    }
}
