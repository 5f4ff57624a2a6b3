//! The core's update path: judging neighbours' updates (gossip framing, run, layout, author,
//! finiteness, norm bounds, replay and lateness), weighing them with the sync policy and
//! queueing them for the trainer, and encoding this node's own delta with error feedback.

use std::sync::Arc;
use std::time::Instant;

use libp2p::gossipsub::{MessageAcceptance, MessageId};
use libp2p::PeerId;
use p2ptrain_models::codec::{self, UpdateHeader};
use p2ptrain_models::params::l2_norm;
use sha2::{Digest, Sha256};

use super::{count_for, FetchAnswer, MeshCore, Output, LARGE_UPDATE_CAP, PENDING_CAP};
use crate::guard::Arrival;
use crate::policy::{Action, PolicyEvent};
use crate::wire::{self, UpdateFrame};

impl MeshCore {
    /// Validates a gossip message; `None` means the verdict is given later (an announced
    /// update, once fetched).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_gossip(
        &mut self,
        source: PeerId,
        author: Option<PeerId>,
        id: &MessageId,
        topic: &str,
        data: Vec<u8>,
        now: Instant,
        out: &mut Vec<Output>,
    ) -> Option<MessageAcceptance> {
        if topic == self.heartbeat_topic {
            return Some(self.on_heartbeat(author, &data, now, out));
        }
        let Some(owner) = topic
            .strip_prefix(&self.update_topic_prefix)
            .and_then(|p| p.parse::<PeerId>().ok())
        else {
            return Some(MessageAcceptance::Reject);
        };
        // A node still waiting for its state (a joiner) has nothing to apply an update to,
        // and no parameters yet to bound its norm by: such updates are dropped unjudged.
        if !self.is_training() {
            return Some(MessageAcceptance::Ignore);
        }
        // Only the topic's owner may publish on it: a signed author must match.
        if author != Some(owner) {
            self.reject(owner, "update published on another peer's topic", out);
            return Some(MessageAcceptance::Reject);
        }
        // Before any decoding, so a flood costs little. Dropped, not rejected: a box
        // configured to publish very often is not hostile.
        if let Err(why) = self.guard.admit(&owner, now) {
            tracing::debug!(peer = %owner, "dropped update: {why}");
            self.status.updates.rate_limited += 1;
            return Some(MessageAcceptance::Ignore);
        }
        match wire::decode_update_frame(&data) {
            Ok(UpdateFrame::Inline(bytes)) => Some(self.accept_update(owner, bytes, now, out)),
            Ok(UpdateFrame::Announce { hash, size, .. }) => {
                if size > codec::max_len(&self.cfg.layout) as u64 {
                    self.reject(owner, "announced update larger than any valid update", out);
                    return Some(MessageAcceptance::Reject);
                }
                out.push(Output::Fetch {
                    owner,
                    source,
                    id: id.clone(),
                    hash,
                });
                None
            }
            Err(why) => {
                self.reject(owner, why, out);
                Some(MessageAcceptance::Reject)
            }
        }
    }

    /// The verdict on an announced update, once its fetch ended. Only bytes that contradict
    /// the announced hash (or an answer of the wrong kind) blame the author: an honest author
    /// keeps just its last few large updates, so a fetch that arrives late on a slow link is
    /// refused through no fault of its own, as is one lost to the network.
    pub(super) fn on_fetched(
        &mut self,
        owner: PeerId,
        hash: [u8; 32],
        answer: FetchAnswer,
        now: Instant,
        out: &mut Vec<Output>,
    ) -> MessageAcceptance {
        match answer {
            FetchAnswer::Bytes(bytes) if Sha256::digest(&bytes)[..] == hash[..] => {
                self.accept_update(owner, &bytes, now, out)
            }
            FetchAnswer::Unavailable => MessageAcceptance::Ignore,
            FetchAnswer::Bytes(_) | FetchAnswer::WrongKind => {
                self.reject(
                    owner,
                    "announced update does not match its hash, or the answer was no update",
                    out,
                );
                MessageAcceptance::Reject
            }
        }
    }

    /// The network took (`ok`) or refused an own update of `payload` bytes.
    pub(super) fn on_update_published(&mut self, payload: u64, ok: bool) {
        if ok {
            self.status.updates.sent += 1;
            self.status.residual_norm = self.compressor.residual_norm();
            self.status.payload_bytes_sent += payload;
        }
    }

    /// Counts a rejected update and names the offence, so a ban can say why.
    pub(super) fn reject(&mut self, author: PeerId, why: &str, out: &mut Vec<Output>) {
        tracing::warn!(peer = %author, "rejected update: {why}");
        out.push(Output::Offence {
            peer: author,
            why: format!("rejected update: {why}"),
        });
        self.status.updates.received += 1;
        self.status.updates.rejected += 1;
        count_for(&mut self.status.rejected_by_peer, &author);
        self.status.last_rejection = Some(format!("{author}: {why}"));
    }

    /// Checks an encoded update and, if it passes, weighs it and queues it for the trainer.
    pub(super) fn accept_update(
        &mut self,
        author: PeerId,
        bytes: &[u8],
        now: Instant,
        out: &mut Vec<Output>,
    ) -> MessageAcceptance {
        let (header, values) = match codec::decode(bytes, &self.cfg.layout) {
            Ok(v) => v,
            Err(e) => {
                self.reject(author, &e.to_string(), out);
                return MessageAcceptance::Reject;
            }
        };
        if header.run_id != self.run_bytes {
            self.reject(author, "update of another run", out);
            return MessageAcceptance::Reject;
        }
        if header.layout != self.layout_bytes {
            self.reject(author, "update for another parameter layout", out);
            return MessageAcceptance::Reject;
        }
        if header.sender != codec::sender_bytes(&author.to_bytes()) {
            self.reject(author, "update names another sender", out);
            return MessageAcceptance::Reject;
        }
        if values.iter().any(|v| !v.is_finite()) {
            self.reject(author, "update holds NaN or infinite values", out);
            return MessageAcceptance::Reject;
        }
        let norm = l2_norm(&values);
        let param_norm = self.progress.param_norm;
        let bound = self.cfg.mesh.max_update_ratio * param_norm.max(1.0);
        if norm > bound {
            let why = format!(
                "update norm {norm:.3e} exceeds the bound {bound:.3e} ({} x the parameters' norm {param_norm:.3e})",
                self.cfg.mesh.max_update_ratio
            );
            self.reject(author, &why, out);
            return MessageAcceptance::Reject;
        }
        // Order proves nothing (gossip reorders honest messages): a late update is applied
        // with the policy's staleness discount, a repeated one dropped, neither punished.
        let seen = self.seen_steps.entry(author).or_default();
        let arrival = seen.classify(header.step);
        let lateness = seen
            .newest()
            .map_or(0, |newest| newest.saturating_sub(header.step));
        if matches!(arrival, Arrival::Duplicate | Arrival::TooOld) {
            tracing::debug!(peer = %author, step = header.step, ?arrival, "update dropped unapplied");
            match arrival {
                Arrival::Duplicate => self.status.updates.duplicates += 1,
                _ => self.status.updates.too_old += 1,
            }
            return MessageAcceptance::Ignore;
        }
        let span = header.step.saturating_sub(header.base_step);
        let scale = match self.guard.judge_norm(norm, span, lateness) {
            Ok(scale) => scale,
            Err(why) => {
                self.status.updates.outliers += 1;
                self.reject(author, &why.to_string(), out);
                return MessageAcceptance::Reject;
            }
        };
        self.seen_steps
            .entry(author)
            .or_default()
            .remember(header.step);
        if arrival == Arrival::Late {
            self.status.updates.late += 1;
        }
        self.guard.record(norm, span);
        let mut values = values;
        if scale < 1.0 {
            tracing::debug!(peer = %author, norm, scale, span, lateness, "large update scaled down to the outlier bound");
            values.iter_mut().for_each(|v| *v *= scale as f32);
            self.status.updates.scaled_down += 1;
        }
        let clipped = crate::guard::clip(&mut values, self.cfg.mesh.guard.clip_value) as u64;
        self.status.updates.received += 1;
        self.status.updates.median_norm = self.guard.median();
        self.status.updates.clipped_values += clipped;
        self.weigh_and_queue(author, header.step, values, now);
        // Valid, applied, and not forwarded: the author publishes straight to every subscriber
        // of its topic (its neighbours, all connected to it), so relaying among them would only
        // add copies, and more of them the more popular the author. `Ignore` drops the message
        // from gossip without penalising anyone.
        MessageAcceptance::Ignore
    }

    /// Weighs an accepted update by the policy (neighbourhood size, staleness) and queues it
    /// for the trainer. While the trainer is busy the queue is short; beyond it, an update is
    /// merged into the newest entry rather than queued as another copy.
    fn weigh_and_queue(&mut self, author: PeerId, step: u64, values: Vec<f32>, now: Instant) {
        let actions = self
            .policy
            .handle(PolicyEvent::UpdateArrived { peer: author, step }, now);
        for action in actions {
            match action {
                Action::Apply { weight, .. } => {
                    let weight = self.cfg.update_weight.unwrap_or(weight);
                    let full = self.pending_apply.len() >= PENDING_CAP;
                    match self.pending_apply.back_mut() {
                        Some((queued, w)) if full => {
                            if *w == 0.0 {
                                queued.clone_from(&values);
                                *w = weight;
                            } else {
                                let k = weight / *w;
                                queued
                                    .iter_mut()
                                    .zip(&values)
                                    .for_each(|(a, b)| *a += k * b);
                            }
                        }
                        _ => self.pending_apply.push_back((values.clone(), weight)),
                    }
                }
                Action::Drop { peer, staleness } => {
                    tracing::debug!(%peer, staleness, "stale update dropped");
                    self.status.dropped_stale += 1;
                }
                // Hold and resume are read through the step limit; nothing else follows an
                // arrival.
                _ => {}
            }
        }
    }

    /// Encodes this node's own delta (with error feedback) and publishes it: inline when
    /// small, else announced by hash and kept for neighbours to pull.
    pub(super) fn publish_update(
        &mut self,
        base_step: u64,
        step: u64,
        delta: &[f32],
        out: &mut Vec<Output>,
    ) {
        // No other member of the run is known, so nobody subscribes to this node's updates:
        // gossip would refuse the message after it was compressed, checksummed and signed
        // (signing hashes the whole message; on a lone MNIST node that was 6% of its steps'
        // time). The delta is dropped, as a refused publish drops it; the trainer's base for
        // the next delta has moved on, and whoever joins later takes these parameters whole.
        if self.members.is_empty() {
            return;
        }
        let header = UpdateHeader {
            run_id: self.run_bytes,
            layout: self.layout_bytes,
            sender: self.me_bytes,
            base_step,
            step,
            codec: self.cfg.mesh.codec,
            numel: delta.len() as u32,
        };
        let bytes =
            match self
                .compressor
                .compress(&header, &self.cfg.layout, delta, self.cfg.mesh.density)
            {
                Ok(e) => e.bytes,
                Err(e) => {
                    tracing::warn!("own update not published: {e}");
                    return;
                }
            };
        let msg = if bytes.len() <= self.cfg.mesh.inline_max {
            wire::encode_update_frame(&UpdateFrame::Inline(&bytes))
        } else {
            let hash: [u8; 32] = Sha256::digest(&bytes).into();
            let msg = wire::encode_update_frame(&UpdateFrame::Announce {
                hash,
                size: bytes.len() as u64,
                step,
            });
            if self.large.len() == LARGE_UPDATE_CAP {
                self.large.pop_front();
            }
            self.large.push_back((hash, Arc::new(bytes)));
            msg
        };
        out.push(Output::PublishUpdate {
            topic: super::update_topic(&self.cfg.run_id, &self.cfg.me),
            data: msg,
        });
    }
}
