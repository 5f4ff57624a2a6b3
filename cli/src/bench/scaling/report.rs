//! What `bench scaling` reports: each run's curve and figures, their median and spread over
//! seeds per kind of run, and the report as JSON.

use super::*;

/// Whether a metric value reaches a target.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Metric {
    /// Held-out bits per byte: lower is better.
    BitsPerByte,
    /// Held-out accuracy: higher is better.
    Accuracy,
}

impl Metric {
    pub(super) fn value(self, e: &EvalRecord) -> Option<f64> {
        match self {
            Metric::BitsPerByte => e.bits_per_byte,
            Metric::Accuracy => Some(e.accuracy),
        }
    }

    pub(super) fn reaches(self, value: f64, target: f64) -> bool {
        match self {
            Metric::BitsPerByte => value <= target,
            Metric::Accuracy => value >= target,
        }
    }
}

/// One run: a lone node or a mesh, one seed.
#[derive(Debug, Serialize, serde::Deserialize)]
pub(super) struct Run {
    /// `alone`, `alone_xN`, `alone_<mode>`, `alone_loaded` or the sync mode.
    pub(super) kind: String,
    pub(super) seed: u64,
    pub(super) lr: f64,
    pub(super) batch_size: i64,
    pub(super) nodes: usize,
    /// Per target: the step (per node) at which every node's evaluation first reached it.
    pub(super) steps_to_target: BTreeMap<String, Option<u64>>,
    /// Per target: seconds from the first node's start until every node had reached it.
    pub(super) seconds_to_target: BTreeMap<String, Option<f64>>,
    /// The same less each node's own seconds of evaluation up to then (the latest node's):
    /// training time to the target, which the evaluation period chosen here does not
    /// inflate. A member's wait for another's evaluation still counts.
    pub(super) train_seconds_to_target: BTreeMap<String, Option<f64>>,
    /// Training steps per second of node 0 over the run, evaluations included.
    pub(super) steps_per_sec: f64,
    /// Mean over nodes of all bytes each sent (libp2p's counters).
    pub(super) bytes_sent_per_node: f64,
    /// Synchronous modes: the share of the run's seconds a node spent in rounds (completed
    /// rounds times their mean duration), the mean over nodes: what waiting for the network
    /// and the other members cost. `None` where nodes hold no rounds.
    #[serde(default)]
    pub(super) round_share: Option<f64>,
    /// Node 0's evaluations: `[seconds since the start, step, value]`.
    pub(super) curve: Vec<[f64; 3]>,
    /// Peers, rejected updates and bans seen at the end, per node.
    pub(super) mesh: Vec<serde_json::Value>,
}

/// Median and spread of one figure over seeds.
#[derive(Debug, Serialize)]
pub(super) struct Spread {
    pub(super) median: Option<f64>,
    pub(super) min: Option<f64>,
    pub(super) max: Option<f64>,
    /// Seeds that reached it (of all that ran).
    pub(super) reached: usize,
    pub(super) runs: usize,
}

pub(super) fn spread(values: &[Option<f64>]) -> Spread {
    let got: Vec<f64> = values.iter().flatten().copied().collect();
    // A run that never reached the target counts as slower than any that did: with fewer
    // than half reaching, there is no median.
    let median = (got.len() * 2 > values.len()).then(|| {
        let mut all: Vec<f64> = values.iter().map(|v| v.unwrap_or(f64::INFINITY)).collect();
        all.sort_by(f64::total_cmp);
        median(&all)
    });
    Spread {
        median: median.filter(|m| m.is_finite()),
        min: got.iter().copied().reduce(f64::min),
        max: got.iter().copied().reduce(f64::max),
        reached: got.len(),
        runs: values.len(),
    }
}

/// One kind of run summarised over seeds (at its best learning rate, for the lone runs).
#[derive(Debug, Serialize)]
pub(super) struct KindSummary {
    pub(super) kind: String,
    pub(super) lr: f64,
    pub(super) steps_to_target: BTreeMap<String, Spread>,
    pub(super) seconds_to_target: BTreeMap<String, Spread>,
    /// Seconds less the nodes' own evaluations (see [`Run::train_seconds_to_target`]).
    pub(super) train_seconds_to_target: BTreeMap<String, Spread>,
    pub(super) steps_per_sec: Spread,
    pub(super) bytes_sent_per_node: Spread,
    /// The lone control this kind's speedups are measured against: `alone`, or for a mode
    /// with an outer optimizer whichever of `alone` and `alone_<mode>` (the optimizer with one
    /// replica) reached the last target sooner.
    pub(super) one_box: String,
    /// Median seconds of [`KindSummary::one_box`] ÷ median seconds of this kind, per target.
    pub(super) speedup: BTreeMap<String, Option<f64>>,
    /// The same, in training seconds (evaluations left out on both sides).
    pub(super) train_speedup: BTreeMap<String, Option<f64>>,
    /// `speedup ÷ ideal`, per target (the ideal from `alone` and `alone_xN` steps).
    pub(super) scaling_efficiency: BTreeMap<String, Option<f64>>,
}

/// What a report's runs measured: the settings `--lone-from` compares before it reuses an
/// earlier report's lone runs.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub(super) struct Measured {
    /// Always `scaling`.
    pub(super) benchmark: String,
    /// The config's path, as given.
    pub(super) config: String,
    pub(super) targets: Vec<f64>,
    pub(super) nodes: usize,
    pub(super) cores_per_node: usize,
    pub(super) seeds: u64,
    /// The first seed (`--first-seed`); reports written before it had seeds from 1.
    #[serde(default = "first_seed_before_it_was_chosen")]
    pub(super) first_seed: u64,
    pub(super) eval_every: u64,
    /// `--set` settings of the mesh runs (and `alone_<mode>`), as given.
    pub(super) mesh_settings: Vec<String>,
}

impl Measured {
    /// What this invocation measures.
    pub(super) fn of(args: &ScalingArgs, config_name: &str) -> Measured {
        Measured {
            benchmark: "scaling".into(),
            config: config_name.to_string(),
            targets: args.targets.clone(),
            nodes: args.nodes,
            cores_per_node: args.cores_per_node,
            seeds: args.seeds,
            first_seed: args.first_seed,
            eval_every: args.eval_every,
            mesh_settings: args.settings.clone(),
        }
    }
}

/// The first seed of a report that does not name one.
fn first_seed_before_it_was_chosen() -> u64 {
    1
}

#[derive(Debug, Serialize)]
pub(super) struct Report {
    #[serde(flatten)]
    pub(super) measured: Measured,
    pub(super) metric: Metric,
    /// `--straggler-delay-us`: the sleep per sample of every mesh run's last node (0: none;
    /// the lone runs never sleep).
    pub(super) straggler_delay_us: u64,
    /// What joined the mesh's nodes and DDP's processes: loopback, or the lab's shaping.
    pub(super) links: String,
    /// Per target: median steps of `alone` ÷ median steps of `alone_xN` (best learning rate
    /// of each): what N boxes could at best gain per step.
    pub(super) ideal_speedup: BTreeMap<String, Option<f64>>,
    pub(super) summary: Vec<KindSummary>,
    pub(super) runs: Vec<Run>,
}

/// What `--lone-from` reads of an earlier report: what its runs measured, and the runs.
#[derive(Debug, serde::Deserialize)]
pub(super) struct ReusedReport {
    #[serde(flatten)]
    pub(super) measured: Measured,
    pub(super) runs: Vec<Run>,
}

pub(super) fn target_key(t: f64) -> String {
    format!("{t}")
}

/// The first evaluation of `evals` that reaches `target`.
pub(super) fn first_reaching(
    evals: &[EvalRecord],
    metric: Metric,
    target: f64,
) -> Option<&EvalRecord> {
    evals
        .iter()
        .find(|e| metric.value(e).is_some_and(|v| metric.reaches(v, target)))
}

/// The median curve of one kind of run over its seeds (`runs`, one learning rate): at each
/// step that more than half of the runs evaluated, the median seconds and the median value,
/// as `(seconds, value)` in step order. What `report.svg` draws bold for each kind, so the
/// picture shows each arm once instead of one tangle of lines per seed.
pub(super) fn median_curve(runs: &[&Run]) -> Vec<(f64, f64)> {
    let mut at_step: BTreeMap<u64, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for r in runs {
        for p in &r.curve {
            if !(p[0].is_finite() && p[1].is_finite() && p[1] >= 0.0 && p[2].is_finite()) {
                continue;
            }
            let (secs, values) = at_step.entry(p[1] as u64).or_default();
            secs.push(p[0]);
            values.push(p[2]);
        }
    }
    at_step
        .into_values()
        .filter(|(secs, _)| secs.len() * 2 > runs.len())
        .map(|(secs, values)| (median(&secs), median(&values)))
        .collect()
}

/// Summarises the runs of `kind` at its best learning rate (least median seconds to the last
/// target).
pub(super) fn summarise(kind: &str, runs: &[Run], last: &str) -> Option<KindSummary> {
    let mut by_lr: BTreeMap<String, Vec<&Run>> = BTreeMap::new();
    for r in runs.iter().filter(|r| r.kind == kind) {
        by_lr.entry(format!("{}", r.lr)).or_default().push(r);
    }
    let best = by_lr.values().min_by(|a, b| {
        let m = |rs: &Vec<&Run>| {
            spread(
                &rs.iter()
                    .map(|r| r.seconds_to_target[last])
                    .collect::<Vec<_>>(),
            )
            .median
            .unwrap_or(f64::INFINITY)
        };
        m(a).total_cmp(&m(b))
    })?;
    let keys: Vec<String> = best[0].steps_to_target.keys().cloned().collect();
    let per = |f: &dyn Fn(&Run) -> Option<f64>| -> Spread {
        spread(&best.iter().map(|r| f(r)).collect::<Vec<_>>())
    };
    Some(KindSummary {
        kind: kind.to_string(),
        lr: best[0].lr,
        steps_to_target: keys
            .iter()
            .map(|k| (k.clone(), per(&|r| r.steps_to_target[k].map(|s| s as f64))))
            .collect(),
        seconds_to_target: keys
            .iter()
            .map(|k| (k.clone(), per(&|r| r.seconds_to_target[k])))
            .collect(),
        train_seconds_to_target: keys
            .iter()
            .map(|k| (k.clone(), per(&|r| r.train_seconds_to_target[k])))
            .collect(),
        steps_per_sec: per(&|r| Some(r.steps_per_sec)),
        bytes_sent_per_node: per(&|r| Some(r.bytes_sent_per_node)),
        one_box: "alone".to_string(),
        speedup: BTreeMap::new(),
        train_speedup: BTreeMap::new(),
        scaling_efficiency: BTreeMap::new(),
    })
}
