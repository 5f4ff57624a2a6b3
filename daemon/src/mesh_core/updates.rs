//! The update path: judging neighbours' updates (topic owner, rate, framing, header, finiteness,
//! norm bounds, replay and lateness), queueing the ones the policy weighs for the trainer, and
//! encoding this node's own delta with error feedback, inline or announced for neighbours to
//! pull. With mean mixing, what an own update sent is kept until the network has taken it,
//! then handed back for the core to queue with the policy's (negative) own-change weight.
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
/// Fetches of one owner's announced updates under way at once. An honest owner serves only
/// its last [`LARGE_UPDATE_CAP`], so more could not all be answered; one that announces and
/// never serves would otherwise hold a request slot per announcement until each timed out.
pub(super) const FETCHES_PER_OWNER: usize = LARGE_UPDATE_CAP;
/// Updates waiting for a busy trainer before they are merged.
pub(super) const PENDING_CAP: usize = 8;
/// Own updates handed to the network and not yet reported taken; the network reports each in
/// order, so more than a few means reports were lost and the oldest is dropped.
const SENT_CAP: usize = 4;

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
    /// Keep what each own update sent (mean mixing takes part of it back once it is out).
    keep_sent: bool,
    /// What own updates handed to the network sent, oldest first, until it reports them.
    sent: VecDeque<Vec<f32>>,
    guard: UpdateGuard<PeerId>,
    seen_steps: HashMap<PeerId, SeenSteps>,
    /// Fetches of announced updates under way, by owner (at most [`FETCHES_PER_OWNER`]
    /// each); an owner leaves the map when its last one ends, and stays in it when it is
    /// forgotten meanwhile, so reconnecting buys no more.
    fetching: HashMap<PeerId, usize>,
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
        keep_sent: bool,
    ) -> Updates {
        Updates {
            ids: HeaderIds::new(me, run_id, &layout),
            topic_prefix: crate::wire::update_topic_prefix(run_id),
            own_topic: super::update_topic(run_id, me),
            guard: UpdateGuard::new(cfg.guard),
            seen_steps: HashMap::new(),
            fetching: HashMap::new(),
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
            keep_sent,
            sent: VecDeque::new(),
            layout,
            cfg,
        }
    }

    /// The model's parameter count.
    pub(super) fn numel(&self) -> usize {
        self.layout.numel()
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
        // Only the topic's owner may publish on it: a signed author must match. The forger is
        // blamed (the sender, when the message names no author: with validation before
        // forwarding, an honest peer never relays a message not yet judged), never the owner.
        if author != Some(owner) {
            let forger = author.unwrap_or(source);
            return self.reject(forger, "update published on another peer's topic", out);
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
                let under_way = self.fetching.entry(owner).or_default();
                if *under_way >= FETCHES_PER_OWNER {
                    // Dropped for the owner's pace, as an update over its rate is.
                    tracing::debug!(peer = %owner, "dropped an announced update: {FETCHES_PER_OWNER} of its fetches under way");
                    self.counters.rate_limited += 1;
                    return Verdict::Judged(MessageAcceptance::Ignore);
                }
                *under_way += 1;
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
        if let Some(under_way) = self.fetching.get_mut(&owner) {
            *under_way = under_way.saturating_sub(1);
            if *under_way == 0 {
                self.fetching.remove(&owner);
            }
        }
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
        let judged = match self.guard.judge(&author, norm, span, lateness) {
            Ok(judged) => judged,
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
        self.guard.record(&author, judged.bounded_norm, span);
        let mut values = values;
        if judged.beyond_bound {
            tracing::debug!(peer = %author, norm, scale = judged.scale, span, lateness, "large update scaled down to the outlier bound");
            self.counters.scaled_down += 1;
        }
        if judged.beyond_budget {
            tracing::debug!(peer = %author, norm, scale = judged.scale, "update scaled down to its author's budget");
            self.counters.over_budget += 1;
        }
        if judged.scale < 1.0 {
            let scale = judged.scale as f32;
            values.iter_mut().for_each(|v| *v *= scale);
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
        self.queue(values, weight);
    }

    fn queue(&mut self, values: Vec<f32>, weight: f32) {
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
        // Its norm is still remembered (uncompressed: never below what it would have sent),
        // so that the outlier bound stays anchored in this node's own progress: a peer of
        // the run that publishes updates without ever counting as a member would otherwise
        // be the only author the bound is the median of, and could lift it at will.
        if alone {
            self.guard
                .record_own(l2_norm(delta), step.saturating_sub(base_step));
            return;
        }
        let header = self
            .ids
            .header(base_step, step, self.cfg.codec, delta.len() as u32);
        let bytes = match self
            .compressor
            .compress(&header, &self.layout, delta, self.cfg.density)
        {
            Ok(e) => {
                self.guard
                    .record_own(l2_norm(&e.sent), step.saturating_sub(base_step));
                if self.keep_sent {
                    if self.sent.len() == SENT_CAP {
                        self.sent.pop_front();
                    }
                    self.sent.push_back(e.sent);
                }
                e.bytes
            }
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

    /// The network took (`ok`) or refused an own update of `payload` bytes. With mean mixing,
    /// answers what a taken update sent (neighbours will add their share of it; the core
    /// queues the part this node gives back); a refused one's is dropped, as its change
    /// stays here whole.
    pub(super) fn published(&mut self, payload: u64, ok: bool) -> Option<Vec<f32>> {
        let sent = self.sent.pop_front();
        if ok {
            self.counters.sent += 1;
            self.residual_norm = self.compressor.residual_norm();
            self.payload_bytes_sent += payload;
            return sent;
        }
        None
    }

    /// Queues this node's own sent change with `weight` (negative: the part mean mixing
    /// gives back), past the fixed `sync.update_weight`, which weighs neighbours' only.
    pub(super) fn enqueue_own(&mut self, values: Vec<f32>, weight: f32) {
        self.queue(values, weight);
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
        self.sent.clear();
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use p2ptrain_models::codec::{Codec, UpdateHeader, HEADER_LEN};

    use super::*;
    use crate::guard::GuardConfig;

    const RUN: &str = "00aa";

    fn layout() -> Layout {
        Layout {
            entries: vec![("w".into(), vec![4])],
        }
    }

    fn cfg() -> MeshConfig {
        MeshConfig::plain(1 << 20)
    }

    /// No rate limit: a neighbour's updates are judged by norm and budget alone.
    fn unlimited_cfg() -> MeshConfig {
        MeshConfig {
            guard: GuardConfig {
                max_updates_per_sec: 0.0,
                ..cfg().guard
            },
            ..cfg()
        }
    }

    /// One update a second, no burst above it.
    fn slow_cfg() -> MeshConfig {
        MeshConfig {
            guard: GuardConfig {
                max_updates_per_sec: 1.0,
                burst: 1.0,
                ..cfg().guard
            },
            ..cfg()
        }
    }

    fn updates(cfg: MeshConfig) -> (Updates, PeerId) {
        let me = PeerId::random();
        (Updates::new(&me, RUN, layout(), cfg, None, false), me)
    }

    /// A header of `author`'s in this run and layout, covering the step before `step`.
    fn header(author: &PeerId, step: u64) -> UpdateHeader {
        HeaderIds::new(author, RUN, &layout()).header(step.saturating_sub(1), step, Codec::Dense, 4)
    }

    fn encoded(header: &UpdateHeader, values: &[f32]) -> Vec<u8> {
        codec::encode(header, &layout(), values, 1.0)
            .expect("encode")
            .bytes
    }

    fn inline(bytes: &[u8]) -> Vec<u8> {
        wire::encode_update_frame(&UpdateFrame::Inline(bytes))
    }

    /// `author`'s update at `step`, framed inline.
    fn update(author: &PeerId, step: u64, values: &[f32]) -> Vec<u8> {
        inline(&encoded(&header(author, step), values))
    }

    /// `author` publishes `data` on its own topic; our parameters' norm is `param_norm`.
    fn gossip(
        u: &mut Updates,
        author: PeerId,
        data: &[u8],
        param_norm: Option<f64>,
        now: Instant,
    ) -> (Verdict, Vec<Output>) {
        let mut out = Vec::new();
        let id = MessageId::from(vec![1, 2, 3]);
        let v = u.on_gossip(
            author,
            Some(author),
            author,
            &id,
            data,
            param_norm,
            now,
            &mut out,
        );
        (v, out)
    }

    fn is(v: &Verdict, acceptance: MessageAcceptance) -> bool {
        matches!(v, Verdict::Judged(a) if *a == acceptance)
    }

    fn passed(v: &Verdict) -> Option<(PeerId, u64, Vec<f32>)> {
        match v {
            Verdict::Passed {
                author,
                step,
                values,
            } => Some((*author, *step, values.clone())),
            _ => None,
        }
    }

    /// The text of the one offence in `out`, and whom it blames.
    fn offence(out: &[Output]) -> (PeerId, String) {
        match out {
            [Output::Offence { peer, why }] => (*peer, why.clone()),
            other => panic!("not one offence: {other:?}"),
        }
    }

    fn counters(u: &Updates) -> UpdateCounters {
        let mut s = MeshStatus::default();
        u.render(&mut s);
        s.updates
    }

    fn applies(u: &mut Updates) -> Vec<(Vec<f32>, f32)> {
        std::iter::from_fn(|| u.next_apply())
            .map(|cmd| match cmd {
                TrainerCommand::Apply { values, weight } => (values, weight),
                other => panic!("not an apply: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn only_the_topics_owner_may_publish_on_it() {
        let (mut u, _) = updates(cfg());
        let (owner, forger) = (PeerId::random(), PeerId::random());
        let data = update(&forger, 1, &[0.1; 4]);
        for author in [Some(forger), None] {
            let mut out = Vec::new();
            let id = MessageId::from(vec![7]);
            let v = u.on_gossip(
                forger,
                author,
                owner,
                &id,
                &data,
                Some(1.0),
                Instant::now(),
                &mut out,
            );
            assert!(is(&v, MessageAcceptance::Reject), "{v:?}");
            let (blamed, why) = offence(&out);
            assert_eq!(
                blamed, forger,
                "the forger is blamed, never the topic's owner"
            );
            assert_eq!(
                why,
                "rejected update: update published on another peer's topic"
            );
        }
        assert_eq!(counters(&u).rejected, 2);
        // The owner itself passes with the same kind of message.
        let (v, out) = gossip(
            &mut u,
            owner,
            &update(&owner, 1, &[0.1; 4]),
            Some(1.0),
            Instant::now(),
        );
        assert!(passed(&v).is_some(), "{v:?} {out:?}");
    }

    #[test]
    fn owner_of_reads_only_this_runs_update_topics() {
        let (u, me) = updates(cfg());
        let p = PeerId::random();
        assert_eq!(
            u.owner_of(&crate::mesh_core::update_topic(RUN, &p)),
            Some(p)
        );
        assert_eq!(
            u.owner_of(&crate::mesh_core::update_topic(RUN, &me)),
            Some(me)
        );
        assert_eq!(
            u.owner_of(&crate::mesh_core::update_topic("00bb", &p)),
            None
        );
        assert_eq!(u.owner_of(&crate::mesh_core::heartbeat_topic(RUN)), None);
        assert_eq!(
            u.owner_of(&format!("p2ptrain/{RUN}/updates/not-a-peer")),
            None
        );
    }

    #[test]
    fn while_not_training_an_update_is_ignored_unjudged() {
        let (mut u, _) = updates(cfg());
        let (owner, forger) = (PeerId::random(), PeerId::random());
        let now = Instant::now();
        // Not even a forged author or garbage is judged.
        let mut out = Vec::new();
        let id = MessageId::from(vec![7]);
        let v = u.on_gossip(
            forger,
            Some(forger),
            owner,
            &id,
            b"junk",
            None,
            now,
            &mut out,
        );
        assert!(is(&v, MessageAcceptance::Ignore), "{v:?}");
        let (v, out2) = gossip(&mut u, owner, &update(&owner, 1, &[0.1; 4]), None, now);
        assert!(is(&v, MessageAcceptance::Ignore), "{v:?}");
        assert!(out.is_empty() && out2.is_empty(), "{out:?} {out2:?}");
        assert_eq!(counters(&u), UpdateCounters::default());
    }

    #[test]
    fn the_rate_limit_drops_before_decoding_without_blame() {
        let (mut u, _) = updates(slow_cfg());
        let a = PeerId::random();
        let t0 = Instant::now();
        let (v, _) = gossip(&mut u, a, &update(&a, 1, &[0.1; 4]), Some(1.0), t0);
        assert!(passed(&v).is_some(), "{v:?}");
        // Garbage within the same second: dropped unread, nobody blamed.
        let (v, out) = gossip(&mut u, a, b"junk", Some(1.0), t0);
        assert!(is(&v, MessageAcceptance::Ignore), "{v:?}");
        assert!(out.is_empty(), "{out:?}");
        let c = counters(&u);
        assert_eq!((c.rate_limited, c.rejected), (1, 0));
        // A second later the same garbage is read, and rejected.
        let (v, out) = gossip(&mut u, a, b"junk", Some(1.0), t0 + Duration::from_secs(1));
        assert!(is(&v, MessageAcceptance::Reject), "{v:?}");
        assert_eq!(offence(&out).0, a);
    }

    #[test]
    fn an_oversized_announce_is_rejected_and_a_normal_one_is_fetched_from_its_author() {
        let (mut u, _) = updates(cfg());
        let (a, relay) = (PeerId::random(), PeerId::random());
        let max = codec::max_len(&layout()) as u64;
        let hash = [9u8; 32];
        let announce = |size| {
            wire::encode_update_frame(&UpdateFrame::Announce {
                hash,
                size,
                step: 3,
            })
        };
        let id = MessageId::from(vec![4, 2]);
        let now = Instant::now();

        let mut out = Vec::new();
        let v = u.on_gossip(
            relay,
            Some(a),
            a,
            &id,
            &announce(max + 1),
            Some(1.0),
            now,
            &mut out,
        );
        assert!(is(&v, MessageAcceptance::Reject), "{v:?}");
        let (peer, why) = offence(&out);
        assert_eq!(peer, a);
        assert_eq!(
            why,
            "rejected update: announced update larger than any valid update"
        );

        let mut out = Vec::new();
        let v = u.on_gossip(
            relay,
            Some(a),
            a,
            &id,
            &announce(max),
            Some(1.0),
            now,
            &mut out,
        );
        assert!(matches!(v, Verdict::Fetching), "{v:?}");
        match &out[..] {
            [Output::Fetch {
                owner,
                source,
                id: fetch_id,
                hash: h,
            }] => {
                assert_eq!((*owner, *source, *h), (a, relay, hash));
                assert_eq!(*fetch_id, id);
            }
            other => panic!("no fetch: {other:?}"),
        }
    }

    /// An owner's announced updates are fetched a few at a time: one that announces and never
    /// serves holds at most [`FETCHES_PER_OWNER`] of the node's request slots (which syncs,
    /// ring hops and fetches from other owners need too); its further announcements are
    /// dropped unjudged and unblamed until one of its fetches ends.
    #[test]
    fn an_owner_holds_at_most_a_few_fetches_at_once() {
        let (mut u, _) = updates(cfg());
        let (a, b, relay) = (PeerId::random(), PeerId::random(), PeerId::random());
        let announce = |k: u8| {
            wire::encode_update_frame(&UpdateFrame::Announce {
                hash: [k; 32],
                size: 64,
                step: u64::from(k),
            })
        };
        let now = Instant::now();
        let offer = |u: &mut Updates, owner: PeerId, k: u8| {
            let mut out = Vec::new();
            let v = u.on_gossip(
                relay,
                Some(owner),
                owner,
                &MessageId::from(vec![k]),
                &announce(k),
                Some(1.0),
                now,
                &mut out,
            );
            let fetched = matches!(v, Verdict::Fetching);
            if !fetched {
                assert!(is(&v, MessageAcceptance::Ignore), "{v:?}");
                assert!(out.is_empty(), "{out:?}");
            }
            fetched
        };
        let fetched = (0..12u8).filter(|&k| offer(&mut u, a, k)).count();
        assert_eq!(fetched, FETCHES_PER_OWNER);
        assert!(offer(&mut u, b, 50), "another owner is held back");
        let mut out = Vec::new();
        let v = u.on_fetched(a, [0; 32], FetchAnswer::Unavailable, 1.0, &mut out);
        assert!(is(&v, MessageAcceptance::Ignore), "{v:?}");
        assert!(
            offer(&mut u, a, 20),
            "a fetch ended: the owner has a slot again"
        );
        assert!(!offer(&mut u, a, 21));
        assert_eq!(counters(&u).rejected, 0);
    }

    #[test]
    fn fetched_bytes_that_miss_the_hash_blame_the_author_and_an_unavailable_fetch_does_not() {
        let (mut u, _) = updates(cfg());
        let a = PeerId::random();
        let bytes = encoded(&header(&a, 1), &[0.1; 4]);
        let hash: [u8; 32] = Sha256::digest(&bytes).into();
        let other = encoded(&header(&a, 1), &[0.2; 4]);

        let mut out = Vec::new();
        let v = u.on_fetched(a, hash, FetchAnswer::Bytes(other), 1.0, &mut out);
        assert!(is(&v, MessageAcceptance::Reject), "{v:?}");
        let (peer, why) = offence(&out);
        assert_eq!(peer, a);
        assert!(why.starts_with("rejected update: "), "{why}");

        let mut out = Vec::new();
        let v = u.on_fetched(a, hash, FetchAnswer::WrongKind, 1.0, &mut out);
        assert!(is(&v, MessageAcceptance::Reject), "{v:?}");
        assert_eq!(offence(&out).0, a);

        let mut out = Vec::new();
        let v = u.on_fetched(a, hash, FetchAnswer::Unavailable, 1.0, &mut out);
        assert!(is(&v, MessageAcceptance::Ignore), "{v:?}");
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(counters(&u).rejected, 2);

        let mut out = Vec::new();
        let v = u.on_fetched(a, hash, FetchAnswer::Bytes(bytes), 1.0, &mut out);
        assert_eq!(passed(&v), Some((a, 1, vec![0.1; 4])), "{out:?}");
    }

    #[test]
    fn updates_of_another_run_layout_or_sender_and_nan_values_are_rejected() {
        let a = PeerId::random();
        let other_layout = Layout {
            entries: vec![("v".into(), vec![4])],
        };
        let mut nan = encoded(&header(&a, 1), &[0.1; 4]);
        nan[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        codec::reseal(&mut nan);
        let cases = [
            (
                encoded(
                    &HeaderIds::new(&a, "00bb", &layout()).header(0, 1, Codec::Dense, 4),
                    &[0.1; 4],
                ),
                "update of another run",
            ),
            (
                encoded(
                    &HeaderIds::new(&a, RUN, &other_layout).header(0, 1, Codec::Dense, 4),
                    &[0.1; 4],
                ),
                "update for another parameter layout",
            ),
            (
                encoded(&header(&PeerId::random(), 1), &[0.1; 4]),
                "update names another sender",
            ),
            (nan, "update holds NaN or infinite values"),
        ];
        for (bytes, text) in cases {
            let (mut u, _) = updates(cfg());
            let (v, out) = gossip(&mut u, a, &inline(&bytes), Some(1.0), Instant::now());
            assert!(is(&v, MessageAcceptance::Reject), "{text}: {v:?}");
            assert_eq!(offence(&out), (a, format!("rejected update: {text}")));
            let mut s = MeshStatus::default();
            u.render(&mut s);
            assert_eq!(s.last_rejection, Some(format!("{a}: {text}")));
            assert_eq!(s.rejected_by_peer.get(&a.to_string()), Some(&1));
        }
    }

    #[test]
    fn the_norm_bound_scales_with_our_parameters_norm() {
        let (mut u, _) = updates(cfg());
        let a = PeerId::random();
        let now = Instant::now();
        // Norm 3 against 2 x max(param_norm, 1).
        let big = [3.0, 0.0, 0.0, 0.0];
        let (v, out) = gossip(&mut u, a, &update(&a, 1, &big), Some(1.0), now);
        assert!(is(&v, MessageAcceptance::Reject), "{v:?}");
        assert!(offence(&out).1.contains("exceeds the bound"), "{out:?}");
        // Below a norm of 1 the bound stays at 2 x 1.
        let (v, _) = gossip(&mut u, a, &update(&a, 2, &big), Some(0.01), now);
        assert!(is(&v, MessageAcceptance::Reject), "{v:?}");
        let (v, _) = gossip(
            &mut u,
            a,
            &update(&a, 3, &[1.9, 0.0, 0.0, 0.0]),
            Some(0.01),
            now,
        );
        assert!(passed(&v).is_some(), "{v:?}");
        // Larger parameters, a larger bound.
        let (v, out) = gossip(&mut u, a, &update(&a, 4, &big), Some(1.6), now);
        assert_eq!(passed(&v), Some((a, 4, big.to_vec())), "{out:?}");
    }

    /// A neighbour that grows its updates ratchets no bound. Each update beyond the outlier
    /// bound is scaled down to it and applied, and the guard remembers what was applied, by
    /// author, so one author's updates move the median no further than one honest author's
    /// word; after [`crate::guard::SCALED_IN_A_ROW`] such updates in a row, each further one
    /// beyond the bound is refused, an offence. (Remembered unscaled in one window shared by
    /// every author, updates each 50 times the last bound, under the 100 times where they are
    /// refused, lifted the median past a thousand times the honest one within about 40
    /// updates, and that neighbour's next updates near `max_update_ratio` x the parameters'
    /// norm were applied whole.)
    #[test]
    fn a_neighbour_growing_its_updates_ratchets_no_bound() {
        use crate::guard::SCALED_IN_A_ROW;
        let (mut u, _) = updates(unlimited_cfg());
        let (honest, rogue) = (PeerId::random(), PeerId::random());
        let now = Instant::now();
        // Parameters this large keep the bound by their norm out of the way.
        let params = Some(1e12);
        let mut honest_step = 0;
        let mut honest_update = |u: &mut Updates| {
            honest_step += 1;
            let data = update(&honest, honest_step, &[1.0, 0.0, 0.0, 0.0]);
            let (v, out) = gossip(u, honest, &data, params, now);
            assert!(passed(&v).is_some(), "{v:?} {out:?}");
        };
        for _ in 0..32 {
            honest_update(&mut u);
        }
        let honest_median = counters(&u).median_norm.expect("a median");
        let mut norm = 20.0f32;
        let mut refused = 0;
        for step in 1..=200 {
            let data = update(&rogue, step, &[norm, 0.0, 0.0, 0.0]);
            let (v, out) = gossip(&mut u, rogue, &data, params, now);
            match passed(&v) {
                // The next one 50 times what this one was applied at: the bound it met.
                Some((_, _, applied)) => norm = 50.0 * applied[0],
                None => {
                    assert!(is(&v, MessageAcceptance::Reject), "{v:?}");
                    assert!(
                        format!("{out:?}").contains("updates in a row beyond it"),
                        "{out:?}"
                    );
                    refused += 1;
                }
            }
            if step % 10 == 0 {
                honest_update(&mut u);
            }
        }
        assert_eq!(refused, 200 - SCALED_IN_A_ROW as usize);
        let median = counters(&u).median_norm.expect("a median");
        assert!(
            median <= 2.0 * honest_median,
            "the median went from {honest_median} to {median}"
        );
        // Back under the bound, the neighbour's updates pass whole again...
        let data = update(&rogue, 201, &[2.0, 0.0, 0.0, 0.0]);
        let (v, out) = gossip(&mut u, rogue, &data, params, now);
        assert_eq!(
            passed(&v),
            Some((rogue, 201, vec![2.0, 0.0, 0.0, 0.0])),
            "{out:?}"
        );
        // ...and one 900 times the honest norm, under the 100 x 10 where it is refused, is
        // scaled down to the honest bound.
        let data = update(&rogue, 202, &[900.0, 0.0, 0.0, 0.0]);
        let (v, out) = gossip(&mut u, rogue, &data, params, now);
        let (_, _, applied) = passed(&v).unwrap_or_else(|| panic!("{v:?} {out:?}"));
        assert!(
            applied[0] <= 10.0 * 2.0 * honest_median as f32,
            "applied at {}",
            applied[0]
        );
    }

    /// A neighbour pushing one way, each update just under the outlier bound and far faster
    /// than this node makes its own, moves the model no further than its budget: what this
    /// node's own updates refill (four times their norm), whatever its rate.
    #[test]
    fn a_neighbour_pushing_under_the_bound_moves_no_further_than_its_budget() {
        use crate::guard::BUDGET_PER_OWN;
        let (mut u, _) = updates(unlimited_cfg());
        let rogue = PeerId::random();
        let now = Instant::now();
        let params = Some(1e12);
        let own = [1.0f32, 0.0, 0.0, 0.0];
        let mut out = Vec::new();
        let mut step = 0;
        for _ in 0..20 {
            u.publish(step, step + 1, &own, false, &mut out);
            step += 1;
        }
        let mut moved = 0.0f64;
        let mut own_norms = 0.0f64;
        for k in 1..=400u64 {
            // Ten neighbour updates of 9 (the bound is 10 x the own median of 1) for each
            // own update of norm 1.
            let data = update(&rogue, k, &[0.0, 9.0, 0.0, 0.0]);
            let (v, o) = gossip(&mut u, rogue, &data, params, now);
            let (_, _, applied) = passed(&v).unwrap_or_else(|| panic!("{v:?} {o:?}"));
            moved += f64::from(applied[1]);
            if k % 10 == 0 {
                u.publish(step, step + 1, &own, false, &mut out);
                step += 1;
                own_norms += 1.0;
            }
        }
        let c = counters(&u);
        let budget = BUDGET_PER_OWN * (1.0 + own_norms);
        assert!(
            moved <= budget + 1e-3,
            "moved {moved}, budget {budget} (own norms {own_norms})"
        );
        assert!(
            moved >= 0.9 * budget,
            "moved {moved}: the budget is all spent"
        );
        assert_eq!(c.scaled_down, 0, "{c:?}");
        assert!(c.over_budget > 300, "{c:?}");
        assert_eq!(c.rejected, 0, "scaled, never punished: {c:?}");
    }

    #[test]
    fn a_duplicate_step_is_ignored_and_not_blamed() {
        let (mut u, _) = updates(cfg());
        let a = PeerId::random();
        let now = Instant::now();
        let (v, _) = gossip(&mut u, a, &update(&a, 5, &[0.1; 4]), Some(1.0), now);
        assert!(passed(&v).is_some(), "{v:?}");
        let (v, out) = gossip(&mut u, a, &update(&a, 5, &[0.2; 4]), Some(1.0), now);
        assert!(is(&v, MessageAcceptance::Ignore), "{v:?}");
        assert!(out.is_empty(), "{out:?}");
        let c = counters(&u);
        assert_eq!((c.duplicates, c.rejected, c.received), (1, 0, 1));
    }

    #[test]
    fn a_late_update_still_remembered_passes_and_is_counted_late() {
        let (mut u, _) = updates(cfg());
        let a = PeerId::random();
        let now = Instant::now();
        let (v, _) = gossip(&mut u, a, &update(&a, 9, &[0.1; 4]), Some(1.0), now);
        assert!(passed(&v).is_some(), "{v:?}");
        let (v, out) = gossip(&mut u, a, &update(&a, 7, &[0.2; 4]), Some(1.0), now);
        assert_eq!(passed(&v), Some((a, 7, vec![0.2; 4])), "{out:?}");
        assert!(out.is_empty(), "{out:?}");
        let c = counters(&u);
        assert_eq!((c.late, c.duplicates, c.received), (1, 0, 2));
        // Remembered now: the same step again is a duplicate.
        let (v, _) = gossip(&mut u, a, &update(&a, 7, &[0.2; 4]), Some(1.0), now);
        assert!(is(&v, MessageAcceptance::Ignore), "{v:?}");
    }

    #[test]
    fn beyond_the_cap_the_queue_merges_into_its_newest_entry() {
        let (mut u, _) = updates(cfg());
        for _ in 0..PENDING_CAP {
            u.enqueue(vec![1.0, 0.0, 0.0, 0.0], 0.5);
        }
        // Added with its weight relative to the queued one's: 0.5 x queued + 0.25 x new.
        u.enqueue(vec![0.0, 2.0, 0.0, 0.0], 0.25);
        assert_eq!(u.pending_len(), PENDING_CAP);
        let got = applies(&mut u);
        assert_eq!(got.len(), PENDING_CAP);
        assert_eq!(got[PENDING_CAP - 2], (vec![1.0, 0.0, 0.0, 0.0], 0.5));
        assert_eq!(got[PENDING_CAP - 1], (vec![1.0, 1.0, 0.0, 0.0], 0.5));

        // A newest entry of weight 0 counts for nothing: the new update replaces it.
        for _ in 0..PENDING_CAP {
            u.enqueue(vec![9.0; 4], 0.0);
        }
        u.enqueue(vec![1.0, 2.0, 3.0, 4.0], 0.5);
        let got = applies(&mut u);
        assert_eq!(got.len(), PENDING_CAP);
        assert_eq!(got[PENDING_CAP - 1], (vec![1.0, 2.0, 3.0, 4.0], 0.5));
    }

    #[test]
    fn a_configured_update_weight_overrides_the_policys() {
        let mut u = Updates::new(&PeerId::random(), RUN, layout(), cfg(), Some(0.3), false);
        u.enqueue(vec![0.1; 4], 0.9);
        assert_eq!(applies(&mut u), vec![(vec![0.1; 4], 0.3)]);
        let (mut plain, _) = updates(cfg());
        plain.enqueue(vec![0.1; 4], 0.9);
        assert_eq!(applies(&mut plain), vec![(vec![0.1; 4], 0.9)]);
    }

    #[test]
    fn the_trainer_is_asked_for_its_delta_once_until_it_answers() {
        let (mut u, _) = updates(cfg());
        let mut out = Vec::new();
        u.want_delta(&mut out);
        u.want_delta(&mut out);
        assert!(
            matches!(&out[..], [Output::Trainer(TrainerCommand::TakeDelta)]),
            "{out:?}"
        );
        u.delta_answered();
        u.want_delta(&mut out);
        assert_eq!(out.len(), 2, "asked again once answered: {out:?}");
        assert!(matches!(out[1], Output::Trainer(TrainerCommand::TakeDelta)));
    }

    #[test]
    fn a_requeued_update_goes_back_to_the_front() {
        let (mut u, _) = updates(cfg());
        u.enqueue(vec![1.0; 4], 0.5);
        u.enqueue(vec![2.0; 4], 0.5);
        u.requeue(vec![3.0; 4], 0.7);
        assert_eq!(
            applies(&mut u),
            vec![
                (vec![3.0; 4], 0.7),
                (vec![1.0; 4], 0.5),
                (vec![2.0; 4], 0.5)
            ]
        );
    }

    #[test]
    fn nothing_is_published_while_alone() {
        let (mut u, _) = updates(cfg());
        let mut out = Vec::new();
        u.publish(0, 5, &[0.1; 4], true, &mut out);
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(u.sizes().0, 0);
        u.publish(0, 5, &[0.1; 4], false, &mut out);
        assert_eq!(out.len(), 1, "{out:?}");
    }

    #[test]
    fn mean_mixing_gets_back_what_a_taken_update_sent_and_nothing_of_a_refused_one() {
        let me = PeerId::random();
        let mut topk = cfg();
        topk.codec = Codec::TopK(codec::ValueFormat::F32);
        topk.density = 0.5;
        let mut u = Updates::new(&me, RUN, layout(), topk, None, true);
        let mut out = Vec::new();
        // Top-k keeps the two largest; error feedback keeps the rest for the next update.
        u.publish(0, 5, &[0.1, -0.4, 0.3, 0.0], false, &mut out);
        u.publish(5, 10, &[0.0, 0.0, 0.0, 0.0], false, &mut out);
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(u.published(40, true), Some(vec![0.0, -0.4, 0.3, 0.0]));
        assert_eq!(
            u.published(40, false),
            None,
            "a refused update gives nothing back"
        );
        assert_eq!(u.published(40, true), None, "nothing more was handed over");
        // Queued with the weight the core gives, whatever sync.update_weight says.
        u.enqueue_own(vec![0.0, -0.4, 0.3, 0.0], -0.5);
        assert_eq!(applies(&mut u), vec![(vec![0.0, -0.4, 0.3, 0.0], -0.5)]);
        // Adding mixing keeps nothing.
        let (mut plain, _) = updates(cfg());
        plain.publish(0, 5, &[0.1; 4], false, &mut out);
        assert_eq!(plain.published(16, true), None);
    }

    #[test]
    fn a_small_own_update_goes_inline_on_the_own_topic_and_passes_a_peers_judgement() {
        let (mut u, me) = updates(cfg());
        let mut out = Vec::new();
        u.publish(3, 5, &[0.1, -0.2, 0.3, -0.4], false, &mut out);
        let data = match &out[..] {
            [Output::PublishUpdate { topic, data }] => {
                assert_eq!(*topic, crate::mesh_core::update_topic(RUN, &me));
                data.clone()
            }
            other => panic!("nothing published: {other:?}"),
        };
        assert!(matches!(
            wire::decode_update_frame(&data),
            Ok(UpdateFrame::Inline(_))
        ));
        assert_eq!(u.sizes().0, 0, "nothing kept for pulling");
        let (mut peer, _) = updates(cfg());
        let (v, out) = gossip(&mut peer, me, &data, Some(1.0), Instant::now());
        assert_eq!(
            passed(&v),
            Some((me, 5, vec![0.1, -0.2, 0.3, -0.4])),
            "{out:?}"
        );
    }

    #[test]
    fn a_large_own_update_is_announced_and_kept_for_pulling_up_to_the_cap() {
        let (mut u, me) = updates(MeshConfig {
            inline_max: 8,
            ..cfg()
        });
        let mut hashes = Vec::new();
        for step in 1..=LARGE_UPDATE_CAP as u64 + 1 {
            let mut out = Vec::new();
            u.publish(step - 1, step, &[step as f32 * 0.01; 4], false, &mut out);
            let hash = match &out[..] {
                [Output::PublishUpdate { data, .. }] => match wire::decode_update_frame(data) {
                    Ok(UpdateFrame::Announce {
                        hash,
                        size,
                        step: s,
                    }) => {
                        assert_eq!(s, step);
                        let kept = u.large_update(&hash).expect("kept for pulling");
                        assert_eq!(kept.len() as u64, size);
                        assert_eq!(Sha256::digest(&kept[..])[..], hash[..]);
                        let (header, values) = codec::decode(&kept, &layout()).expect("an update");
                        assert_eq!(header.sender, codec::sender_bytes(&me.to_bytes()));
                        assert_eq!(values, vec![step as f32 * 0.01; 4]);
                        hash
                    }
                    other => panic!("not an announce: {other:?}"),
                },
                other => panic!("nothing published: {other:?}"),
            };
            hashes.push(hash);
        }
        assert_eq!(u.sizes().0, LARGE_UPDATE_CAP);
        assert!(u.large_update(&hashes[0]).is_none(), "the oldest is gone");
        assert!(hashes[1..].iter().all(|h| u.large_update(h).is_some()));
        assert!(u.large_update(&[0u8; 32]).is_none());
    }

    #[test]
    fn a_restore_clears_the_queue_and_the_residual_and_rearms_the_delta_request() {
        let (mut u, _) = updates(MeshConfig {
            codec: Codec::TopK(codec::ValueFormat::F32),
            density: 0.25,
            ..cfg()
        });
        let mut out = Vec::new();
        u.publish(0, 1, &[1.0, 2.0, 3.0, 4.0], false, &mut out);
        u.published(10, true);
        let residual = |u: &Updates| {
            let mut s = MeshStatus::default();
            u.render(&mut s);
            s.residual_norm
        };
        assert!(residual(&u) > 0.0, "top-k owes the rest");
        u.enqueue(vec![0.1; 4], 0.5);
        u.want_delta(&mut out);
        out.clear();

        u.restored();
        assert_eq!(u.pending_len(), 0);
        assert_eq!(residual(&u), 0.0);
        u.want_delta(&mut out);
        assert!(
            matches!(&out[..], [Output::Trainer(TrainerCommand::TakeDelta)]),
            "{out:?}"
        );
        // The compressor itself forgot what it owed: a zero delta leaves nothing owed.
        u.publish(1, 2, &[0.0; 4], false, &mut out);
        u.published(10, true);
        assert_eq!(residual(&u), 0.0);
    }

    #[test]
    fn forgetting_a_peer_makes_its_step_numbers_news_again() {
        let (mut u, _) = updates(slow_cfg());
        let a = PeerId::random();
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(2);
        let (v, _) = gossip(&mut u, a, &update(&a, 5, &[0.1; 4]), Some(1.0), t0);
        assert!(passed(&v).is_some(), "{v:?}");
        let (v, _) = gossip(&mut u, a, &update(&a, 5, &[0.1; 4]), Some(1.0), t1);
        assert!(is(&v, MessageAcceptance::Ignore), "a duplicate: {v:?}");
        assert_eq!(u.sizes().1, 1);
        u.forget(&a);
        assert_eq!(u.sizes().1, 0);
        // At the same instant: its rate budget was forgotten too.
        let (v, out) = gossip(&mut u, a, &update(&a, 5, &[0.1; 4]), Some(1.0), t1);
        assert_eq!(passed(&v), Some((a, 5, vec![0.1; 4])), "{out:?}");
    }
}
