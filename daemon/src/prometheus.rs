//! `GET /metrics`: the node in the OpenMetrics text format Prometheus scrapes.
//!
//! p2ptrain's own series are read off a [`Status`] at scrape time (the same numbers
//! `status --json` shows, so the two cannot disagree) into a fresh prometheus-client registry;
//! libp2p's and gossipsub's metrics follow from the registry the network fills as events
//! happen. Names follow Prometheus conventions: a `p2ptrain_` prefix, the unit in the name,
//! `_total` on counters; a peer's id and a reason are labels.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry, Unit};

use crate::mesh_core::status::RoundSeconds;
use crate::status::Status;

/// The content type of the exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of a series: name and value pairs.
type Labels = Vec<(String, String)>;

/// A float gauge.
type FloatGauge = Gauge<f64, AtomicU64>;
/// A float counter (seconds).
type FloatCounter = Counter<f64, AtomicU64>;

/// Adds families to a registry under construction, one call a series.
struct Builder {
    reg: Registry,
}

impl Builder {
    /// Registers `metric` under `name`, with `unit` appended to the name when given.
    fn add(&mut self, name: &str, help: &str, unit: Option<Unit>, metric: impl Metric) {
        match unit {
            Some(u) => self.reg.register_with_unit(name, help, u, metric),
            None => self.reg.register(name, help, metric),
        }
    }

    fn gauge(&mut self, name: &str, help: &str, unit: Option<Unit>, value: f64) {
        let g = FloatGauge::default();
        g.set(value);
        self.add(name, help, unit, g);
    }

    fn counter(&mut self, name: &str, help: &str, unit: Option<Unit>, value: u64) {
        let c = Counter::<u64>::default();
        c.inc_by(value);
        self.add(name, help, unit, c);
    }

    fn seconds_counter(&mut self, name: &str, help: &str, value: f64) {
        let c = FloatCounter::default();
        c.inc_by(value.max(0.0));
        self.add(name, help, Some(Unit::Seconds), c);
    }

    /// A labelled counter family, one series per `(labels, value)`.
    fn counters(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        series: impl IntoIterator<Item = (Labels, u64)>,
    ) {
        let family = Family::<Labels, Counter>::default();
        for (labels, v) in series {
            family.get_or_create(&labels).inc_by(v);
        }
        self.add(name, help, unit, family);
    }

    /// A labelled gauge family, one series per `(labels, value)`.
    fn gauges(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        series: impl IntoIterator<Item = (Labels, f64)>,
    ) {
        let family = Family::<Labels, FloatGauge>::default();
        for (labels, v) in series {
            family.get_or_create(&labels).set(v);
        }
        self.add(name, help, unit, family);
    }
}

/// A histogram read off a status at scrape time (prometheus-client's own `Histogram` only
/// counts observations as they happen): its buckets, sum and count as the status holds them.
#[derive(Debug)]
struct HistogramSnapshot {
    /// Each bucket's upper bound and its count, not cumulative (the encoder sums them).
    buckets: Vec<(f64, u64)>,
    sum: f64,
    count: u64,
}

impl EncodeMetric for HistogramSnapshot {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

impl From<&RoundSeconds> for HistogramSnapshot {
    fn from(h: &RoundSeconds) -> Self {
        HistogramSnapshot {
            buckets: h.buckets(),
            sum: h.sum,
            count: h.count,
        }
    }
}

fn label(k: &str, v: impl ToString) -> Labels {
    vec![(k.to_string(), v.to_string())]
}

/// p2ptrain's own metrics of `s`, as a registry: one section per part of the node.
fn own_metrics(s: &Status) -> Registry {
    let mut b = Builder {
        reg: Registry::with_prefix("p2ptrain"),
    };
    node_metrics(&mut b, s);
    training_metrics(&mut b, s);
    updates_metrics(&mut b, s);
    bytes_metrics(&mut b, s);
    full_syncs_metrics(&mut b, s);
    rounds_metrics(&mut b, s);
    peers_metrics(&mut b, s);
    transfer_metrics(&mut b, s);
    b.reg
}

/// Who this node is and what it trains, its uptime and memory.
fn node_metrics(b: &mut Builder, s: &Status) {
    b.reg.register(
        "node",
        "Who this node is and what it trains",
        Info::new(vec![
            ("version".to_string(), s.node.version.clone()),
            ("peer_id".to_string(), s.node.peer_id.clone()),
            ("run_id".to_string(), s.node.run_id.clone()),
            ("model".to_string(), s.node.model.name.clone()),
            ("optimizer".to_string(), s.node.optimizer.clone()),
            ("device".to_string(), s.node.device.clone()),
            ("sync_mode".to_string(), s.sync.mode.clone()),
            ("codec".to_string(), s.sync.codec.clone()),
        ]),
    );
    b.gauge(
        "uptime",
        "Seconds since the daemon started",
        Some(Unit::Seconds),
        s.node.uptime_s,
    );
    b.gauge(
        "model_parameters",
        "Scalar parameters of the model",
        None,
        s.node.model.params as f64,
    );
    if let Some(h) = s.node.memory.heap_bytes {
        b.gauge(
            "heap",
            "Bytes the node's allocations hold",
            Some(Unit::Bytes),
            h as f64,
        );
    }
    if let Some(r) = s.node.memory.resident_bytes {
        b.gauge(
            "resident_memory",
            "Resident memory (VmRSS)",
            Some(Unit::Bytes),
            r as f64,
        );
    }
}

/// The trainer's progress: steps, samples, loss, evaluations, speed, waits.
fn training_metrics(b: &mut Builder, s: &Status) {
    let t = &s.training;
    b.counter("training_steps", "Training steps taken", None, t.step);
    b.counter(
        "training_samples",
        "Samples trained on",
        None,
        t.samples_seen,
    );
    b.gauge(
        "training_samples_per_second",
        "Recent training throughput",
        None,
        t.samples_per_sec,
    );
    if let Some(loss) = t.loss {
        b.gauge(
            "training_loss",
            "Mean training loss over the last 50 steps",
            None,
            loss,
        );
    }
    if let Some(lr) = t.learning_rate {
        b.gauge(
            "training_learning_rate",
            "The learning rate of the next step, after the schedule",
            None,
            lr,
        );
    }
    if let Some(norm) = t.grad_norm {
        b.gauge(
            "training_gradient_norm",
            "Global L2 norm of a recent step's gradients, before clipping (every step's where clipping is on, else one every 10 s)",
            None,
            norm,
        );
    }
    b.gauge(
        "training_staleness_held",
        "1 while the staleness bound holds this node back for its slowest neighbour, else 0",
        None,
        if s.sync.held { 1.0 } else { 0.0 },
    );
    b.seconds_counter(
        "training_staleness_held",
        "Time the staleness bound held this node back",
        s.sync.held_secs,
    );
    if let Some(e) = t.eval {
        b.gauge(
            "eval_accuracy_ratio",
            "Held-out accuracy (next-byte accuracy for a language model)",
            None,
            e.accuracy,
        );
        b.gauge("eval_loss", "Held-out mean cross-entropy", None, e.loss);
        b.gauge(
            "eval_step",
            "The step the latest evaluation was taken at",
            None,
            e.step as f64,
        );
        if let Some(bpb) = e.bits_per_byte {
            b.gauge(
                "eval_bits_per_byte",
                "Held-out loss of a language model in bits per byte",
                None,
                bpb,
            );
        }
    }
}

/// Synchronous rounds (`allreduce`, `ddp`, `diloco`, `fedavg`): completed, aborted and why,
/// how long each took. Absent in modes without rounds.
fn rounds_metrics(b: &mut Builder, s: &Status) {
    let Some(r) = &s.mesh.rounds else {
        return;
    };
    b.counter(
        "rounds_completed",
        "Rounds this node completed",
        None,
        r.completed,
    );
    b.counters(
        "rounds_aborted",
        "Round attempts aborted, by reason",
        None,
        r.aborted
            .iter()
            .map(|(why, n)| (label("reason", why.replace(' ', "_")), *n)),
    );
    b.add(
        "round_duration",
        "Seconds from this node's contribution to a round's mean, per completed round",
        Some(Unit::Seconds),
        HistogramSnapshot::from(&r.round_seconds),
    );
    b.gauge(
        "round_ring_members",
        "Members in the last ring this node built",
        None,
        r.ring_size as f64,
    );
}

/// Neighbours' updates: published, received, applied, rejected and why.
fn updates_metrics(b: &mut Builder, s: &Status) {
    let u = &s.mesh.updates;
    b.counter("updates_sent", "Own updates published", None, u.sent);
    b.counter(
        "updates_received",
        "Neighbours' updates received",
        None,
        u.received,
    );
    b.counter(
        "updates_applied",
        "Neighbours' updates applied to the model",
        None,
        u.applied,
    );
    b.counters(
        "updates_rejected",
        "Neighbours' updates rejected as broken or hostile (each costs the author score), by reason",
        None,
        [
            (label("reason", "outlier_norm"), u.outliers),
            (label("reason", "invalid"), u.rejected.saturating_sub(u.outliers)),
        ],
    );
    b.counters(
        "updates_dropped",
        "Neighbours' updates dropped without blame, by reason",
        None,
        [
            (label("reason", "duplicate"), u.duplicates),
            (label("reason", "too_old"), u.too_old),
            (label("reason", "rate_limited"), u.rate_limited),
            (label("reason", "stale"), s.sync.dropped_stale),
        ],
    );
    b.counter(
        "updates_late",
        "Updates accepted although older than their author's newest",
        None,
        u.late,
    );
    b.counter(
        "updates_scaled_down",
        "Updates accepted but scaled down to the outlier bound",
        None,
        u.scaled_down,
    );
    b.counter(
        "updates_over_budget",
        "Updates accepted but scaled down to their author's budget",
        None,
        u.over_budget,
    );
    b.counters(
        "update_rejections_by_peer",
        "Rejected updates by author",
        None,
        s.mesh
            .rejected_by_peer
            .iter()
            .map(|(p, n)| (label("peer", p), *n)),
    );
    b.counter(
        "requests_declined",
        "Peers' bulk requests declined because the peer asked beyond its share",
        None,
        s.mesh.requests_declined,
    );
}

/// Bytes: in all, by kind of message, per topic.
fn bytes_metrics(b: &mut Builder, s: &Status) {
    b.counter(
        "network_sent",
        "Bytes sent on all connections",
        Some(Unit::Bytes),
        s.network.bytes_sent,
    );
    b.counter(
        "network_received",
        "Bytes received on all connections",
        Some(Unit::Bytes),
        s.network.bytes_received,
    );
    let sent_by_kind = [(
        vec![
            ("kind".to_string(), "updates".to_string()),
            ("codec".to_string(), s.sync.codec.clone()),
        ],
        s.sync.update_bytes_sent,
    )];
    b.counters(
        "sent",
        "Bytes this node sent, by kind and codec (updates: gossip copies, envelope included)",
        Some(Unit::Bytes),
        sent_by_kind,
    );
    let mut received_by_kind = vec![(
        vec![
            ("kind".to_string(), "full_sync".to_string()),
            ("codec".to_string(), "dense".to_string()),
        ],
        s.mesh.full_syncs.bytes_received,
    )];
    if let Some(d) = &s.mesh.state_download {
        received_by_kind.push((
            vec![
                ("kind".to_string(), "state_transfer".to_string()),
                ("codec".to_string(), "checkpoint".to_string()),
            ],
            d.bytes,
        ));
    }
    b.counters(
        "received",
        "Bytes this node received, by kind (full syncs' parameters, the state download)",
        Some(Unit::Bytes),
        received_by_kind,
    );
    if let Some(bpu) = s.sync.bytes_per_update {
        b.gauge(
            "update_message_size",
            "Mean bytes of one own update message on the wire",
            Some(Unit::Bytes),
            bpu,
        );
    }
    b.gauge(
        "dense_update_size",
        "Bytes a dense f32 update of this model takes",
        Some(Unit::Bytes),
        s.sync.dense_update_bytes as f64,
    );
    b.gauge(
        "residual_norm",
        "L2 norm of what error feedback still owes the mesh",
        None,
        s.sync.residual_norm,
    );
}

/// Full syncs with neighbours, and refusals.
fn full_syncs_metrics(b: &mut Builder, s: &Status) {
    let f = &s.mesh.full_syncs;
    b.counters(
        "full_syncs",
        "Full neighbour syncs, by outcome",
        None,
        [
            (label("outcome", "accepted"), f.accepted),
            (label("outcome", "refused"), f.refused),
            (label("outcome", "failed"), f.failed),
        ],
    );
    b.seconds_counter(
        "full_sync_duration",
        "Seconds accepted full syncs took, from asking to averaged (divide by accepted syncs for the mean)",
        f.secs_total,
    );
    if let Some(secs) = f.last_secs {
        b.gauge(
            "full_sync_last_duration",
            "Seconds the latest accepted full sync took",
            Some(Unit::Seconds),
            secs,
        );
    }
    if let Some(d) = s.mesh.consensus_distance {
        b.gauge(
            "consensus_distance_ratio",
            "Relative L2 distance to the last synced neighbour, before averaging",
            None,
            d,
        );
    }
}

/// Peers, bans, the network's refusals, and bytes per peer.
fn peers_metrics(b: &mut Builder, s: &Status) {
    b.gauge(
        "peers",
        "Connected peers of this run",
        None,
        s.peers.count as f64,
    );
    b.gauge(
        "neighbours",
        "Current neighbours",
        None,
        s.mesh.neighbours.len() as f64,
    );
    b.gauge(
        "banned_peers",
        "Peers banned now",
        None,
        s.network.banned_peers.len() as f64,
    );
    b.counter(
        "peer_drops",
        "Members lost without a goodbye",
        None,
        s.network.peer_drops,
    );
    b.counter(
        "handshake_failures",
        "Connections that failed in the security handshake",
        None,
        s.network.handshake_failures,
    );
    let peers = &s.peers.list;
    b.gauges(
        "peer_step",
        "A peer's step, from its last heartbeat",
        None,
        peers.iter().filter_map(|p| {
            Some((
                label("peer", &p.link.peer_id),
                p.heartbeat.as_ref()?.step as f64,
            ))
        }),
    );
    b.gauges(
        "peer_training_loss",
        "A peer's recent training loss, from its last heartbeat",
        None,
        peers
            .iter()
            .filter_map(|p| Some((label("peer", &p.link.peer_id), p.heartbeat.as_ref()?.loss?))),
    );
    b.gauges(
        "peer_eval_accuracy_ratio",
        "A peer's latest held-out accuracy, from its last heartbeat",
        None,
        peers.iter().filter_map(|p| {
            Some((
                label("peer", &p.link.peer_id),
                p.heartbeat.as_ref()?.accuracy?,
            ))
        }),
    );
    b.gauges(
        "peer_rtt",
        "Latest ping round trip to a peer",
        Some(Unit::Seconds),
        peers
            .iter()
            .filter_map(|p| Some((label("peer", &p.link.peer_id), p.link.rtt_ms? / 1000.0))),
    );
    b.gauges(
        "peer_score",
        "A peer's gossipsub score here",
        None,
        peers
            .iter()
            .filter_map(|p| Some((label("peer", &p.link.peer_id), p.link.score?))),
    );
    b.counters(
        "peer_sent",
        "Bytes sent to a peer over all its connections",
        Some(Unit::Bytes),
        peers
            .iter()
            .filter_map(|p| Some((label("peer", &p.link.peer_id), p.link.bytes_sent?))),
    );
    b.counters(
        "peer_received",
        "Bytes received from a peer over all its connections",
        Some(Unit::Bytes),
        peers
            .iter()
            .filter_map(|p| Some((label("peer", &p.link.peer_id), p.link.bytes_received?))),
    );
}

/// The state download, serving joiners, and checkpoints.
fn transfer_metrics(b: &mut Builder, s: &Status) {
    let t = &s.training;
    if let Some(d) = &s.mesh.state_download {
        b.gauge(
            "state_download",
            "Bytes of the state this node downloaded when it joined",
            Some(Unit::Bytes),
            d.bytes as f64,
        );
        b.gauge(
            "state_download_duration",
            "Seconds the state download took",
            Some(Unit::Seconds),
            d.secs,
        );
    }
    if let Some(p) = s.mesh.state_download_progress {
        b.gauge(
            "state_download_done",
            "Bytes of the state under download verified so far",
            Some(Unit::Bytes),
            p.bytes_done as f64,
        );
        b.gauge(
            "state_download_total",
            "Bytes of the state under download",
            Some(Unit::Bytes),
            p.bytes_total as f64,
        );
    }
    let progress = match (&s.mesh.state_download_progress, &s.mesh.state_download) {
        (Some(p), _) => p.bytes_done as f64 / p.bytes_total.max(1) as f64,
        (None, Some(_)) => 1.0,
        // A founder holds its state from the start; a joiner before it chose a state has none.
        (None, None) if matches!(t.phase, crate::trainer::Phase::Starting) => 0.0,
        (None, None) => 1.0,
    };
    b.gauge(
        "state_download_progress_ratio",
        "How much of the mesh's state this node holds: 1 once downloaded (or for a founder)",
        None,
        progress,
    );
    b.gauge(
        "state_serving",
        "Joiners downloading this node's state now",
        None,
        f64::from(s.state_serving),
    );
    if let Some(c) = &s.checkpoints.last_checkpoint {
        b.gauge(
            "last_checkpoint_step",
            "The step the newest checkpoint holds",
            None,
            c.step as f64,
        );
    }
}

/// The exposition: p2ptrain's series for `status`, then those in `libp2p` (the network's
/// registry), then the end marker.
pub fn render(status: &Status, libp2p: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::with_capacity(16 * 1024);
    encode_registry(&mut out, &own_metrics(status))?;
    encode_registry(&mut out, libp2p)?;
    encode_eof(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_renders_with_units_and_totals() {
        let mut s = crate::status::tests::sample();
        s.training.step = 42;
        s.mesh.updates.rejected = 5;
        s.mesh.updates.outliers = 2;
        s.peers.list.push(crate::status::PeerStatus {
            link: crate::network::PeerInfo {
                peer_id: "peer-a".into(),
                address: String::new(),
                rtt_ms: Some(12.5),
                agent: None,
                score: Some(-1.0),
                path: None,
                remote: None,
                connections: 1,
                bytes_sent: Some(1000),
                bytes_received: Some(2000),
                offences: 0,
                last_offence: None,
            },
            neighbour: true,
            heartbeat: Some(crate::wire::Heartbeat {
                step: 40,
                loss: Some(0.5),
                samples_per_sec: 0.0,
                accuracy: None,
                ms_per_sample: None,
                leaving: false,
                in_rounds: false,
                round: None,
                needs_state: false,
                starting: false,
                seq: 0,
                accused: None,
                accusations: 0,
            }),
        });
        s.training.learning_rate = Some(0.25);
        s.training.grad_norm = Some(1.5);
        s.sync.held = true;
        s.sync.held_secs = 2.5;
        let mut rounds = crate::mesh_core::status::RoundStatus {
            completed: 3,
            ring_size: 2,
            ..Default::default()
        };
        rounds.aborted.insert("member lists differ".into(), 4);
        for secs in [0.04, 0.3, 200.0] {
            rounds.round_seconds.observe(secs);
        }
        s.mesh.rounds = Some(rounds);
        let text = render(&s, &Registry::default()).expect("render");
        for line in [
            "p2ptrain_training_learning_rate 0.25",
            "p2ptrain_training_gradient_norm 1.5",
            "p2ptrain_training_staleness_held 1.0",
            "p2ptrain_training_staleness_held_seconds_total 2.5",
            "p2ptrain_rounds_completed_total 3",
            "p2ptrain_rounds_aborted_total{reason=\"member_lists_differ\"} 4",
            "# TYPE p2ptrain_round_duration_seconds histogram",
            "p2ptrain_round_duration_seconds_count 3",
            "p2ptrain_round_duration_seconds_bucket{le=\"0.05\"} 1",
            "p2ptrain_round_duration_seconds_bucket{le=\"0.5\"} 2",
            "p2ptrain_round_duration_seconds_bucket{le=\"120.0\"} 2",
            "p2ptrain_round_duration_seconds_bucket{le=\"+Inf\"} 3",
            "p2ptrain_training_steps_total 42",
            "p2ptrain_updates_rejected_total{reason=\"outlier_norm\"} 2",
            "p2ptrain_updates_rejected_total{reason=\"invalid\"} 3",
            "p2ptrain_peer_rtt_seconds{peer=\"peer-a\"} 0.0125",
            "p2ptrain_peer_sent_bytes_total{peer=\"peer-a\"} 1000",
            "# TYPE p2ptrain_network_sent_bytes counter",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
        assert_eq!(text.matches("# EOF").count(), 1);
    }
}
