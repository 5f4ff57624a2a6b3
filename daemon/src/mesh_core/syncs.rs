//! The full-sync path: the neighbour sync the policy asks for, from request to the trainer's
//! averaging. It judges the neighbour's reply (its answer's kind, header, codec and
//! finiteness here; its distance from our parameters in the trainer, which holds them),
//! keeps the distance bound ([`SyncGuard`]), and counts, scores and reports how each sync
//! ended. Parameters travel in the codec's dense format.
//!
//! How a sync ended goes back to the core as a [`SyncDone`], for the policy to hear.

use std::collections::BTreeMap;
use std::time::Instant;

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
            Ok(BulkResponse::StateManifest(_)) => {
                return self.wrong_answer(peer, "a state manifest", now, out)
            }
            Ok(BulkResponse::StateChunk(_)) => {
                return self.wrong_answer(peer, "a state chunk", now, out)
            }
            Ok(BulkResponse::Update(_)) => return self.wrong_answer(peer, "an update", now, out),
            Ok(BulkResponse::RingTaken) => {
                return self.wrong_answer(peer, "a ring hop's receipt", now, out)
            }
        };
        out.push(Output::Trainer(TrainerCommand::Average {
            seq: sync.seq,
            theirs: values,
            bound: self.guard.bound(),
        }));
        None
    }

    /// A reply of another kind than parameters: a refusal.
    fn wrong_answer(
        &mut self,
        peer: PeerId,
        what: &str,
        now: Instant,
        out: &mut Vec<Output>,
    ) -> Option<SyncDone> {
        let refusal = SyncRefusal::WrongAnswer(what.into());
        self.end(peer, SyncEnd::Refused(refusal), now, out)
    }

    /// Decodes a dense parameter message and checks that it is of our run and layout, from
    /// the neighbour asked, dense, and finite.
    fn judge(&self, peer: PeerId, bytes: &[u8]) -> Result<Vec<f32>, SyncRefusal> {
        let (header, values) =
            codec::decode(bytes, &self.layout).map_err(|e| SyncRefusal::Layout(e.to_string()))?;
        // Faults in the order a reply was always judged: run, layout, codec, sender.
        let fault = self.ids.check(&header, &peer);
        match fault {
            Err(HeaderFault::Run) => {
                return Err(SyncRefusal::Layout("parameters of another run".into()))
            }
            Err(HeaderFault::Layout(theirs)) => {
                return Err(SyncRefusal::Layout(format!(
                    "layout {}, ours is {}",
                    hex::encode(theirs),
                    self.layout.hash()
                )))
            }
            Err(HeaderFault::Sender) | Ok(()) => {}
        }
        if header.codec != Codec::Dense {
            return Err(SyncRefusal::Layout(format!(
                "parameters encoded with {}, not dense",
                header.codec.name()
            )));
        }
        if fault.is_err() {
            return Err(SyncRefusal::WrongAnswer(
                "parameters that name another sender".into(),
            ));
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

    /// A checkpoint replaced the parameters: a sync under way measured the old ones, and its
    /// answer is ignored.
    pub(super) fn restored(&mut self) {
        self.in_flight = None;
    }

    /// Counts a sync that did not average; the policy then picks the least recently synced
    /// other neighbour at its next step, and asks this one again only after
    /// [`crate::policy::SYNC_RETRY_PAUSE`]. A refusal lowers the neighbour's score and names
    /// the offence.
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
                out.push(Output::Penalise(peer));
            }
        }
        Some(SyncDone { peer, ok: false })
    }

    /// Per-peer refusal counts kept.
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use p2ptrain_models::codec::HEADER_LEN;
    use serde_bytes::ByteBuf;

    use super::*;
    use crate::wire::StateManifest;

    const RUN: &str = "00aa";

    fn layout() -> Layout {
        Layout {
            entries: vec![("w".into(), vec![4])],
        }
    }

    /// Node `me`'s syncs, its wall clock at Unix second 1000 at `t0`.
    fn syncs(me: &PeerId, t0: Instant) -> Syncs {
        let clock = WallClock {
            unix_secs: 1_000,
            at: t0,
        };
        Syncs::new(me, RUN, layout(), 0.85, clock)
    }

    /// A dense parameter message under `header`.
    fn message(header: &UpdateHeader, values: &[f32]) -> Vec<u8> {
        codec::encode(header, &layout(), values, 1.0)
            .expect("encode")
            .bytes
    }

    /// A reply carrying `bytes`.
    fn reply(bytes: Vec<u8>) -> Result<BulkResponse, RequestFailed> {
        Ok(BulkResponse::Params {
            step: 7,
            layout: layout().hash(),
            values: ByteBuf::from(bytes),
        })
    }

    /// `peer`'s honest reply with `values`.
    fn params(peer: &PeerId, values: &[f32]) -> Result<BulkResponse, RequestFailed> {
        let header = HeaderIds::new(peer, RUN, &layout()).header(7, 7, Codec::Dense, 4);
        reply(message(&header, values))
    }

    /// The seq and bound of the one average command in `out`, and what it averages with.
    fn average(out: &[Output]) -> (u64, f64, Vec<f32>) {
        match out {
            [Output::Trainer(TrainerCommand::Average { seq, theirs, bound })] => {
                (*seq, *bound, theirs.clone())
            }
            other => panic!("not one average: {other:?}"),
        }
    }

    fn status(s: &Syncs) -> MeshStatus {
        let mut st = MeshStatus::default();
        s.render(&mut st);
        st
    }

    #[test]
    fn each_sync_is_numbered_and_asks_the_peer_for_its_params() {
        let t0 = Instant::now();
        let mut s = syncs(&PeerId::random(), t0);
        let (p, q) = (PeerId::random(), PeerId::random());
        for (peer, seq) in [(p, 1), (q, 2), (p, 3)] {
            let mut out = Vec::new();
            s.start(peer, 10, t0, &mut out);
            assert!(
                matches!(&out[..], [Output::RequestParams(asked)] if *asked == peer),
                "{out:?}"
            );
            let mut out = Vec::new();
            assert_eq!(
                s.on_reply(peer, params(&peer, &[1.0; 4]), t0, &mut out),
                None
            );
            assert_eq!(average(&out).0, seq);
        }
    }

    #[test]
    fn a_reply_from_a_peer_not_asked_or_after_a_restore_is_ignored() {
        let t0 = Instant::now();
        let mut s = syncs(&PeerId::random(), t0);
        let (p, q) = (PeerId::random(), PeerId::random());
        let mut out = Vec::new();
        s.start(p, 0, t0, &mut out);
        out.clear();
        assert_eq!(s.on_reply(q, params(&q, &[1.0; 4]), t0, &mut out), None);
        let failed = Err(RequestFailed::Network("gone".into()));
        assert_eq!(s.on_reply(q, failed, t0, &mut out), None);
        assert!(out.is_empty(), "{out:?}");
        // The sync with p is still under way.
        assert_eq!(s.on_reply(p, params(&p, &[1.0; 4]), t0, &mut out), None);
        assert_eq!(average(&out).0, 1);

        s.start(p, 0, t0, &mut out);
        out.clear();
        s.restored();
        assert_eq!(s.on_reply(p, params(&p, &[1.0; 4]), t0, &mut out), None);
        let failed = Err(RequestFailed::Network("gone".into()));
        assert_eq!(s.on_reply(p, failed, t0, &mut out), None);
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(status(&s).full_syncs.failed, 0);
    }

    #[test]
    fn a_network_failure_ends_the_sync_at_once_unblamed() {
        let t0 = Instant::now();
        let mut s = syncs(&PeerId::random(), t0);
        let p = PeerId::random();
        let mut out = Vec::new();
        s.start(p, 0, t0, &mut out);
        out.clear();
        let failed = Err(RequestFailed::Network("stream closed".into()));
        assert_eq!(
            s.on_reply(p, failed, t0, &mut out),
            Some(SyncDone { peer: p, ok: false })
        );
        assert!(out.is_empty(), "no offence: {out:?}");
        let st = status(&s);
        assert_eq!((st.full_syncs.failed, st.full_syncs.refused), (1, 0));
        assert!(st.sync_refusals.is_empty());
    }

    #[test]
    fn a_decline_ends_the_sync_unblamed() {
        let t0 = Instant::now();
        let mut s = syncs(&PeerId::random(), t0);
        let p = PeerId::random();
        let mut out = Vec::new();
        s.start(p, 0, t0, &mut out);
        out.clear();
        let declined = Ok(BulkResponse::Refused("still downloading".into()));
        assert_eq!(
            s.on_reply(p, declined, t0, &mut out),
            Some(SyncDone { peer: p, ok: false })
        );
        assert!(out.is_empty(), "no offence: {out:?}");
        let st = status(&s);
        assert_eq!((st.full_syncs.failed, st.full_syncs.refused), (1, 0));
    }

    #[test]
    fn a_reply_that_fails_a_check_is_a_refusal() {
        let p = PeerId::random();
        let ids = HeaderIds::new(&p, RUN, &layout());
        let other_layout = Layout {
            entries: vec![("v".into(), vec![4])],
        };
        let mut nan = message(&ids.header(7, 7, Codec::Dense, 4), &[1.0; 4]);
        nan[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        codec::reseal(&mut nan);
        let cases = [
            (
                message(
                    &HeaderIds::new(&p, "00bb", &layout()).header(7, 7, Codec::Dense, 4),
                    &[1.0; 4],
                ),
                "another run",
            ),
            (
                message(
                    &HeaderIds::new(&p, RUN, &other_layout).header(7, 7, Codec::Dense, 4),
                    &[1.0; 4],
                ),
                "ours is",
            ),
            (
                message(
                    &HeaderIds::new(&PeerId::random(), RUN, &layout()).header(
                        7,
                        7,
                        Codec::Dense,
                        4,
                    ),
                    &[1.0; 4],
                ),
                "another sender",
            ),
            (
                message(&ids.header(7, 7, Codec::F16, 4), &[1.0; 4]),
                "not dense",
            ),
            (nan, "NaN"),
        ];
        for (bytes, text) in cases {
            let t0 = Instant::now();
            let mut s = syncs(&PeerId::random(), t0);
            let mut out = Vec::new();
            s.start(p, 0, t0, &mut out);
            out.clear();
            let now = t0 + Duration::from_secs(5);
            assert_eq!(
                s.on_reply(p, reply(bytes), now, &mut out),
                Some(SyncDone { peer: p, ok: false }),
                "{text}"
            );
            match &out[..] {
                [Output::Offence { peer, why }, Output::Penalise(refused)] => {
                    assert_eq!((*peer, *refused), (p, p));
                    assert!(why.starts_with("refused full-sync reply: "), "{why}");
                    assert!(why.contains(text), "{text}: {why}");
                }
                other => panic!("{text}: not a refusal: {other:?}"),
            }
            let st = status(&s);
            assert_eq!(st.sync_refusals.get(&p.to_string()), Some(&1), "{text}");
            assert_eq!(st.full_syncs.refused, 1, "{text}");
            assert_eq!(st.full_syncs.failed, 0, "{text}");
            let last = st.full_syncs.last_refusal.expect("the refusal recorded");
            assert_eq!(last.peer, p.to_string());
            assert!(last.reason.contains(text), "{text}: {}", last.reason);
            assert_eq!(last.at, 1_005, "dated by the wall clock");
        }
    }

    #[test]
    fn an_answer_of_the_wrong_kind_is_a_refusal() {
        let manifest = StateManifest {
            hash: ByteBuf::from(vec![0; 32]),
            step: 3,
            total: 10,
            chunk_size: 10,
            chunk_hashes: vec![ByteBuf::from(vec![0; 32])],
            load: 0,
            cached: Vec::new(),
        };
        for (answer, what) in [
            (BulkResponse::StateManifest(manifest), "a state manifest"),
            (
                BulkResponse::StateChunk(ByteBuf::from(vec![1, 2])),
                "a state chunk",
            ),
            (BulkResponse::Update(ByteBuf::from(vec![1, 2])), "an update"),
        ] {
            let t0 = Instant::now();
            let mut s = syncs(&PeerId::random(), t0);
            let p = PeerId::random();
            let mut out = Vec::new();
            s.start(p, 0, t0, &mut out);
            out.clear();
            assert_eq!(
                s.on_reply(p, Ok(answer), t0, &mut out),
                Some(SyncDone { peer: p, ok: false })
            );
            match &out[..] {
                [Output::Offence { peer, why }, Output::Penalise(refused)] => {
                    assert_eq!((*peer, *refused), (p, p));
                    assert_eq!(
                        *why,
                        format!("refused full-sync reply: answered with {what}")
                    );
                }
                other => panic!("{what}: not a refusal: {other:?}"),
            }
            assert_eq!(status(&s).full_syncs.refused, 1);
        }
    }

    #[test]
    fn a_good_reply_goes_to_the_trainer_with_the_current_bound_and_its_seq() {
        let t0 = Instant::now();
        let mut s = syncs(&PeerId::random(), t0);
        let p = PeerId::random();
        let mut out = Vec::new();
        s.start(p, 0, t0, &mut out);
        out.clear();
        assert_eq!(
            s.on_reply(p, params(&p, &[1.0, 2.0, 3.0, 4.0]), t0, &mut out),
            None
        );
        let (seq, bound, theirs) = average(&out);
        assert_eq!((seq, bound), (1, 0.85), "the cap before any sync");
        assert_eq!(theirs, vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(
            status(&s).full_syncs.bytes_received,
            codec::dense_len(&layout()) as u64
        );
        out.clear();
        assert!(s
            .on_averaged(1, AverageOutcome::Averaged(0.1), t0, &mut out)
            .is_some());
        // The bound follows the accepted distance: 4 x 0.1, no lower than 0.8 x the cap.
        s.start(p, 0, t0, &mut out);
        out.clear();
        s.on_reply(p, params(&p, &[1.0; 4]), t0, &mut out);
        let (seq, bound, _) = average(&out);
        assert_eq!(seq, 2);
        assert!((bound - 0.68).abs() < 1e-12, "{bound}");
        assert_eq!(bound, status(&s).full_syncs.bound);
    }

    #[test]
    fn an_averaged_sync_ends_well_and_is_dated_by_the_wall_clock() {
        let t0 = Instant::now();
        let mut s = syncs(&PeerId::random(), t0);
        let p = PeerId::random();
        let mut out = Vec::new();
        s.start(p, 17, t0, &mut out);
        s.on_reply(p, params(&p, &[1.0; 4]), t0, &mut out);
        out.clear();
        let done = s.on_averaged(
            1,
            AverageOutcome::Averaged(0.1),
            t0 + Duration::from_secs(3),
            &mut out,
        );
        assert_eq!(done, Some(SyncDone { peer: p, ok: true }));
        assert!(out.is_empty(), "{out:?}");
        let st = status(&s);
        assert_eq!(st.consensus_distance, Some(0.1));
        assert_eq!(
            st.last_sync,
            Some(SyncInfo {
                peer: p.to_string(),
                step: 17,
                at: 1_003
            })
        );
        let c = &st.full_syncs;
        assert_eq!((c.accepted, c.refused, c.failed), (1, 0, 0));
        assert_eq!((c.last_secs, c.secs_total), (Some(3.0), 3.0));
        assert_eq!(c.largest_accepted, Some(0.1));
        // Done: a second answer for it is not taken.
        assert_eq!(
            s.on_averaged(1, AverageOutcome::Averaged(0.2), t0, &mut out),
            None
        );
    }

    #[test]
    fn the_trainers_answer_to_an_older_sync_is_ignored() {
        let t0 = Instant::now();
        let mut s = syncs(&PeerId::random(), t0);
        let (p, q) = (PeerId::random(), PeerId::random());
        let mut out = Vec::new();
        s.start(p, 0, t0, &mut out);
        s.on_reply(p, params(&p, &[1.0; 4]), t0, &mut out);
        // The policy moved on to q before the trainer answered sync 1.
        s.start(q, 0, t0, &mut out);
        out.clear();
        assert_eq!(
            s.on_averaged(1, AverageOutcome::Averaged(0.1), t0, &mut out),
            None
        );
        assert!(out.is_empty(), "{out:?}");
        let st = status(&s);
        assert_eq!((st.full_syncs.accepted, st.consensus_distance), (0, None));
        assert_eq!(
            s.on_averaged(2, AverageOutcome::Averaged(0.2), t0, &mut out),
            Some(SyncDone { peer: q, ok: true })
        );
    }

    #[test]
    fn a_nodes_params_encoder_writes_a_reply_its_peers_syncs_accept() {
        let t0 = Instant::now();
        let (a, b) = (PeerId::random(), PeerId::random());
        let (mut sa, sb) = (syncs(&a, t0), syncs(&b, t0));
        let encoder = sb.params_encoder();
        assert_eq!(encoder.layout_hash(), layout().hash());
        let values = [0.5, -1.5, 2.25, 1e-3];
        let bytes = encoder.encode(42, &values).expect("encode");
        let (header, _) = codec::decode(&bytes, &layout()).expect("decode");
        assert_eq!(
            (header.base_step, header.step, header.codec),
            (42, 42, Codec::Dense)
        );
        let mut out = Vec::new();
        sa.start(b, 40, t0, &mut out);
        out.clear();
        let answer = Ok(BulkResponse::Params {
            step: 42,
            layout: encoder.layout_hash(),
            values: ByteBuf::from(bytes),
        });
        assert_eq!(sa.on_reply(b, answer, t0, &mut out), None);
        let (seq, _, theirs) = average(&out);
        assert_eq!(seq, 1);
        assert_eq!(theirs, values.to_vec());
    }
}
