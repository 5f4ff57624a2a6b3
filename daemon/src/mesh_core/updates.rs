//! The update path: judging neighbours' updates (topic owner, rate, framing, header, finiteness,
//! norm bounds, replay and lateness), queueing the ones the policy weighs for the trainer, and
//! encoding this node's own delta with error feedback, inline or announced for neighbours to
//! pull.
//!
//! The sync policy's weighing is the core's: an update that passes every check comes back as
//! [`Verdict::Passed`], and the core hands the weight the policy gives it to
//! [`Updates::enqueue`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use libp2p::gossipsub::{MessageAcceptance, MessageId};
use libp2p::PeerId;
use p2ptrain_models::codec::{self, ErrorFeedback};
use p2ptrain_models::params::{l2_norm, Layout};
use sha2::{Digest, Sha256};

use super::header::{all_finite, HeaderFault, HeaderIds};
use super::{
    count_for, FetchAnswer, MeshConfig, MeshStatus, Output, TrainerCommand, UpdateCounters,
};
use crate::guard::{Arrival, SeenSteps, UpdateGuard};
use crate::wire::{self, UpdateFrame};

/// Large updates kept for neighbours to pull.
pub(super) const LARGE_UPDATE_CAP: usize = 4;
/// Updates waiting for a busy trainer before they are merged.
pub(super) const PENDING_CAP: usize = 8;

/// What became of a neighbour's update.
#[derive(Debug)]
pub(super) enum Verdict {
    /// Judged: gossip is told so and nothing is queued.
    Judged(MessageAcceptance),
    /// Announced: the verdict waits for the fetch from its author.
    Fetching,
    /// Passed every check: for the policy to weigh and [`Updates::enqueue`] to queue.
    Passed {
        /// Its author.
        author: PeerId,
        /// The author's step when it published.
        step: u64,
        /// The change, scaled and clipped as the guard asked.
        values: Vec<f32>,
    },
}

/// Neighbours' updates in, this node's out; see the module docs.
pub(super) struct Updates {
    ids: HeaderIds,
    layout: Layout,
    /// Topics of the run's updates start so; the rest names their owner.
    topic_prefix: String,
    /// This node's own update topic.
    own_topic: String,
    cfg: MeshConfig,
    /// Fixed weight for neighbours' updates instead of the policy's (`sync.update_weight`).
    update_weight: Option<f32>,
    guard: UpdateGuard<PeerId>,
    seen_steps: HashMap<PeerId, SeenSteps>,
    compressor: ErrorFeedback,
    large: VecDeque<([u8; 32], Arc<Vec<u8>>)>,
    pending: VecDeque<(Vec<f32>, f32)>,
    /// A delta was asked of the trainer and not yet answered.
    delta_asked: bool,
    counters: UpdateCounters,
    rejected_by_peer: BTreeMap<PeerId, u64>,
    last_rejection: Option<(PeerId, String)>,
    residual_norm: f64,
    payload_bytes_sent: u64,
    dropped_stale: u64,
}

impl Updates {
    /// The update path of node `me` in run `run_id`.
    pub(super) fn new(
        me: &PeerId,
        run_id: &str,
        layout: Layout,
        cfg: MeshConfig,
        update_weight: Option<f32>,
    ) -> Updates {
        Updates {
            ids: HeaderIds::new(me, run_id, &layout),
            topic_prefix: format!("p2ptrain/{run_id}/updates/"),
            own_topic: super::update_topic(run_id, me),
            guard: UpdateGuard::new(cfg.guard),
            seen_steps: HashMap::new(),
            compressor: ErrorFeedback::new(layout.numel(), cfg.error_feedback),
            large: VecDeque::new(),
            pending: VecDeque::new(),
            delta_asked: false,
            counters: UpdateCounters::default(),
            rejected_by_peer: BTreeMap::new(),
            last_rejection: None,
            residual_norm: 0.0,
            payload_bytes_sent: 0,
            dropped_stale: 0,
            update_weight,
            layout,
            cfg,
        }
    }

    /// The peer whose updates `topic` carries, if it is an update topic of this run.
    pub(super) fn owner_of(&self, topic: &str) -> Option<PeerId> {
        topic
            .strip_prefix(&self.topic_prefix)
            .and_then(|p| p.parse::<PeerId>().ok())
    }

    /// Judges a gossip message on `owner`'s update topic. `param_norm` is this node's
    /// parameters' norm, which bounds the update's; `None` while this node does not train.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_gossip(
        &mut self,
        source: PeerId,
        author: Option<PeerId>,
        owner: PeerId,
        id: &MessageId,
        data: &[u8],
        param_norm: Option<f64>,
        now: Instant,
        out: &mut Vec<Output>,
    ) -> Verdict {
        // A node still waiting for its state (a joiner) has nothing to apply an update to,
        // and no parameters yet to bound its norm by: such updates are dropped unjudged.
        let Some(param_norm) = param_norm else {
            return Verdict::Judged(MessageAcceptance::Ignore);
        };
        // Only the topic's owner may publish on it: a signed author must match.
        if author != Some(owner) {
            return self.reject(owner, "update published on another peer's topic", out);
        }
        // Before any decoding, so a flood costs little. Dropped, not rejected: a box
        // configured to publish very often is not hostile.
        if let Err(why) = self.guard.admit(&owner, now) {
            tracing::debug!(peer = %owner, "dropped update: {why}");
            self.counters.rate_limited += 1;
            return Verdict::Judged(MessageAcceptance::Ignore);
        }
        match wire::decode_update_frame(data) {
            Ok(UpdateFrame::Inline(bytes)) => self.judge(owner, bytes, param_norm, out),
            Ok(UpdateFrame::Announce { hash, size, .. }) => {
                if size > codec::max_len(&self.layout) as u64 {
                    return self.reject(
                        owner,
                        "announced update larger than any valid update",
                        out,
                    );
                }
                out.push(Output::Fetch {
                    owner,
                    source,
                    id: id.clone(),
                    hash,
                });
                Verdict::Fetching
            }
            Err(why) => self.reject(owner, why, out),
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
        param_norm: f64,
        out: &mut Vec<Output>,
    ) -> Verdict {
        match answer {
            FetchAnswer::Bytes(bytes) if Sha256::digest(&bytes)[..] == hash[..] => {
                self.judge(owner, &bytes, param_norm, out)
            }
            FetchAnswer::Unavailable => Verdict::Judged(MessageAcceptance::Ignore),
            FetchAnswer::Bytes(_) | FetchAnswer::WrongKind => self.reject(
                owner,
                "announced update does not match its hash, or the answer was no update",
                out,
            ),
        }
    }

    /// Counts a rejected update and names the offence, so a ban can say why.
    fn reject(&mut self, author: PeerId, why: &str, out: &mut Vec<Output>) -> Verdict {
        tracing::warn!(peer = %author, "rejected update: {why}");
        out.push(Output::Offence {
            peer: author,
            why: format!("rejected update: {why}"),
        });
        self.counters.received += 1;
        self.counters.rejected += 1;
        count_for(&mut self.rejected_by_peer, &author);
        self.last_rejection = Some((author, why.to_string()));
        Verdict::Judged(MessageAcceptance::Reject)
    }

    /// Checks an encoded update of `author`'s: header, finiteness, norm against ours
    /// (`param_norm`) and against recent updates, replay and lateness.
    fn judge(
        &mut self,
        author: PeerId,
        bytes: &[u8],
        param_norm: f64,
        out: &mut Vec<Output>,
    ) -> Verdict {
        let (header, values) = match codec::decode(bytes, &self.layout) {
            Ok(v) => v,
            Err(e) => return self.reject(author, &e.to_string(), out),
        };
        if let Err(fault) = self.ids.check(&header, &author) {
            let why = match fault {
                HeaderFault::Run => "update of another run",
                HeaderFault::Layout(_) => "update for another parameter layout",
                HeaderFault::Sender => "update names another sender",
            };
            return self.reject(author, why, out);
        }
        if !all_finite(&values) {
            return self.reject(author, "update holds NaN or infinite values", out);
        }
        let norm = l2_norm(&values);
        let bound = self.cfg.max_update_ratio * param_norm.max(1.0);
        if norm > bound {
            let why = format!(
                "update norm {norm:.3e} exceeds the bound {bound:.3e} ({} x the parameters' norm {param_norm:.3e})",
                self.cfg.max_update_ratio
            );
            return self.reject(author, &why, out);
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
                Arrival::Duplicate => self.counters.duplicates += 1,
                _ => self.counters.too_old += 1,
            }
            return Verdict::Judged(MessageAcceptance::Ignore);
        }
        let span = header.step.saturating_sub(header.base_step);
        let scale = match self.guard.judge_norm(norm, span, lateness) {
            Ok(scale) => scale,
            Err(why) => {
                self.counters.outliers += 1;
                return self.reject(author, &why.to_string(), out);
            }
        };
        self.seen_steps
            .entry(author)
            .or_default()
            .remember(header.step);
        if arrival == Arrival::Late {
            self.counters.late += 1;
        }
        self.guard.record(norm, span);
        let mut values = values;
        if scale < 1.0 {
            tracing::debug!(peer = %author, norm, scale, span, lateness, "large update scaled down to the outlier bound");
            values.iter_mut().for_each(|v| *v *= scale as f32);
            self.counters.scaled_down += 1;
        }
        let clipped = crate::guard::clip(&mut values, self.cfg.guard.clip_value) as u64;
        self.counters.received += 1;
        self.counters.median_norm = self.guard.median();
        self.counters.clipped_values += clipped;
        Verdict::Passed {
            author,
            step: header.step,
            values,
        }
    }

    /// Queues a passed update with the weight the policy gave it (or `sync.update_weight`).
    /// While the trainer is busy the queue is short; beyond it, an update is merged into the
    /// newest entry rather than queued as another copy.
    pub(super) fn enqueue(&mut self, values: Vec<f32>, weight: f32) {
        let weight = self.update_weight.unwrap_or(weight);
        let full = self.pending.len() >= PENDING_CAP;
        match self.pending.back_mut() {
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
            _ => self.pending.push_back((values, weight)),
        }
    }

    /// The policy dropped a passed update as too stale.
    pub(super) fn dropped_stale(&mut self, peer: PeerId, staleness: u64) {
        tracing::debug!(%peer, staleness, "stale update dropped");
        self.dropped_stale += 1;
    }

    /// The policy finds a publish due: asks the trainer for its delta, once until answered.
    pub(super) fn want_delta(&mut self, out: &mut Vec<Output>) {
        if !self.delta_asked {
            self.delta_asked = true;
            out.push(Output::Trainer(TrainerCommand::TakeDelta));
        }
    }

    /// The trainer answered (or could not take) the delta: the next publish asks again.
    pub(super) fn delta_answered(&mut self) {
        self.delta_asked = false;
    }

    /// Encodes this node's own delta (with error feedback) and publishes it: inline when
    /// small, else announced by hash and kept for neighbours to pull. Nothing while `alone`.
    pub(super) fn publish(
        &mut self,
        base_step: u64,
        step: u64,
        delta: &[f32],
        alone: bool,
        out: &mut Vec<Output>,
    ) {
        // No other member of the run is known, so nobody subscribes to this node's updates:
        // gossip would refuse the message after it was compressed, checksummed and signed
        // (signing hashes the whole message; on a lone MNIST node that was 6% of its steps'
        // time). The delta is dropped, as a refused publish drops it; the trainer's base for
        // the next delta has moved on, and whoever joins later takes these parameters whole.
        if alone {
            return;
        }
        let header = self
            .ids
            .header(base_step, step, self.cfg.codec, delta.len() as u32);
        let bytes = match self
            .compressor
            .compress(&header, &self.layout, delta, self.cfg.density)
        {
            Ok(e) => e.bytes,
            Err(e) => {
                tracing::warn!("own update not published: {e}");
                return;
            }
        };
        let msg = if bytes.len() <= self.cfg.inline_max {
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
            topic: self.own_topic.clone(),
            data: msg,
        });
    }

    /// The network took (`ok`) or refused an own update of `payload` bytes.
    pub(super) fn published(&mut self, payload: u64, ok: bool) {
        if ok {
            self.counters.sent += 1;
            self.residual_norm = self.compressor.residual_norm();
            self.payload_bytes_sent += payload;
        }
    }

    /// The trainer's queue was full for an update: it goes back to the front.
    pub(super) fn requeue(&mut self, values: Vec<f32>, weight: f32) {
        self.pending.push_front((values, weight));
    }

    /// A checkpoint replaced the parameters: the residual and the queue referred to the old
    /// ones, and a delta asked for will not come.
    pub(super) fn restored(&mut self) {
        self.compressor.reset();
        self.residual_norm = 0.0;
        self.pending.clear();
        self.delta_asked = false;
    }

    /// A member that comes back may have restarted from an older checkpoint: its step
    /// numbers repeat, and its updates are news again.
    pub(super) fn forget(&mut self, peer: &PeerId) {
        self.seen_steps.remove(peer);
        self.guard.forget(peer);
    }

    /// The next update waiting for the trainer, with its weight.
    pub(super) fn next_apply(&mut self) -> Option<TrainerCommand> {
        self.pending
            .pop_front()
            .map(|(values, weight)| TrainerCommand::Apply { values, weight })
    }

    /// Updates waiting for the trainer.
    pub(super) fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// A large update of ours that a neighbour asks for by hash.
    pub(super) fn large_update(&self, hash: &[u8]) -> Option<Arc<Vec<u8>>> {
        self.large
            .iter()
            .find(|(h, _)| h[..] == hash[..])
            .map(|(_, b)| b.clone())
    }

    /// How many large updates, authors' step records and per-peer counts are kept.
    #[cfg(test)]
    pub(super) fn sizes(&self) -> (usize, usize, usize) {
        (
            self.large.len(),
            self.seen_steps.len(),
            self.rejected_by_peer.len(),
        )
    }

    /// This path's part of the status: counters, rejections by author, the residual.
    pub(super) fn render(&self, status: &mut MeshStatus) {
        status.updates = self.counters.clone();
        status.rejected_by_peer = self
            .rejected_by_peer
            .iter()
            .map(|(p, n)| (p.to_string(), *n))
            .collect();
        status.last_rejection = self
            .last_rejection
            .as_ref()
            .map(|(p, why)| format!("{p}: {why}"));
        status.residual_norm = self.residual_norm;
        status.payload_bytes_sent = self.payload_bytes_sent;
        status.dropped_stale = self.dropped_stale;
    }
}
