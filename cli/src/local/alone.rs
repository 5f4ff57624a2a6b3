//! The controls beside a mesh: each node's part trained alone, and one node alone on the whole
//! data raced to a target.

use super::*;

/// Trains each node's part of the data alone, here, from the run's initial weights, and
/// evaluates it on the same held-out set: the control that shows what the mesh added. Nodes
/// with the same part (the same config and shard) share one control, trained for as many steps
/// as the furthest of them took (at most [`ALONE_MAX_STEPS`]), so the control never trained
/// less than a node it is set beside.
pub(super) fn compare_alone(args: &LocalArgs, summary: &mut LocalSummary) -> Result<()> {
    type Part = (Option<String>, PathBuf);
    let mut parts: BTreeMap<Part, (Config, u64)> = BTreeMap::new();
    let mut part_of = Vec::new();
    for node in &summary.per_node {
        let i = node.index;
        let path = args
            .node_configs
            .get(&i)
            .or(args.config.as_ref())
            .cloned()
            .ok_or_else(|| anyhow!("no config for node {i}"))?;
        let config = Config::load(Some(&path))?;
        let part = (shard_for(&config, i, args.nodes), path);
        let steps = node.step.clamp(1, ALONE_MAX_STEPS);
        let entry = parts.entry(part.clone()).or_insert((config, steps));
        entry.1 = entry.1.max(steps);
        part_of.push(part);
    }
    let mut controls: BTreeMap<Part, Alone> = BTreeMap::new();
    for (part, (mut config, steps)) in parts {
        config.apply(&Overrides {
            shard: part.0.clone(),
            ..Overrides::default()
        })?;
        crate::runtime::set_compute_threads(config.train.threads);
        let prepared = p2ptrain_daemon::node::prepare(config)?;
        let model = p2ptrain_models::Model::new(
            &prepared.spec,
            prepared.config.train.init_seed,
            &prepared.device,
        )?;
        crate::measure::train_steps(&prepared, &model, steps)?;
        let e = p2ptrain_models::train::evaluate(&model, prepared.data.test(), &prepared.device)?;
        controls.insert(
            part,
            Alone {
                steps,
                accuracy: e.accuracy,
                bits_per_byte: e.bits_per_byte,
            },
        );
    }
    for (node, part) in summary.per_node.iter_mut().zip(&part_of) {
        node.alone = controls.get(part).copied();
    }
    let accs: Vec<f64> = summary
        .per_node
        .iter()
        .filter_map(|n| n.alone.map(|a| a.accuracy))
        .collect();
    summary.mean_alone_accuracy =
        (!accs.is_empty()).then(|| accs.iter().sum::<f64>() / accs.len() as f64);
    Ok(())
}

/// Trains one node alone on the whole data, pinned like node 0, until its evaluations reach
/// the target (or `2 × nodes ×` the mesh's steps, or the time limit): the control that shows
/// what the mesh's other boxes bought, in steps per node and, pinned, in time. It runs after
/// the mesh, so it has the machine to itself as each mesh node had its cores, and as a plain
/// node (`gossip`, no peers): a synchronous mode's `min_members` would hold it forever.
pub(super) async fn lone_to_target(
    args: &LocalArgs,
    config: &Config,
    base: &Path,
    target: f64,
    summary: &LocalSummary,
) -> Result<LoneControl> {
    let furthest = summary
        .per_node
        .iter()
        .map(|n| n.at_target.map_or(n.step, |r| r.step))
        .max()
        .unwrap_or(0);
    let cap = (2 * args.nodes as u64 * furthest).clamp(1000, ALONE_MAX_STEPS);
    let dir = base.join("alone-whole-data");
    let _ = std::fs::remove_dir_all(&dir);
    let config_path = args
        .config
        .as_deref()
        .map(std::path::absolute)
        .transpose()?;
    let cores = args.cores_per_node.map(|per| core_set(0, per));
    if !args.json {
        eprintln!("one node alone on the whole data, to the target (at most {cap} steps)");
    }
    let started_ms = unix_ms();
    let started = Instant::now();
    let flags = NodeFlags {
        // A partition that cuts the set between nodes, cut in one part: all of it.
        shard: (config.data.partition != PartitionKind::Iid).then_some("0/1"),
        steps: Some(cap),
        bootstrap: None,
        sync_mode: Some("gossip"),
        min_members: None,
        target: Some(target),
    };
    let mut child = Children(vec![spawn_node(
        &dir,
        config_path.as_deref(),
        flags,
        cores.as_deref(),
    )?]);
    let api = wait_api(&dir, &mut child.0[0]).await?;
    let client = Client::new(&api, p2ptrain_daemon::control::token::read(&dir))?;
    let limit = args
        .duration
        .map_or(TARGET_TIMEOUT, |d| Duration::from_secs_f64(d.max(0.0)));
    let exit = loop {
        let exited = child.0[0].try_wait()?;
        let reached = first_at_target(&dir, Some(target), started_ms).is_some();
        if exited.is_some() || reached || started.elapsed() > limit {
            if exited.is_none() {
                let _ = client.post::<serde_json::Value>("/v1/stop").await;
            }
            break exited;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.0[0].try_wait()?.is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(child);
    // Read after it stopped: an evaluation written as it exited counts.
    let reached = first_at_target(&dir, Some(target), started_ms);
    if let Some(status) = exit.filter(|s| !s.success() && reached.is_none()) {
        bail!(
            "the lone control node failed ({status}); see {}",
            dir.with_extension("log").display()
        );
    }
    Ok(LoneControl {
        reached,
        cap,
        last: read_evals(&dir)
            .iter()
            .rfind(|e| e.unix_ms >= started_ms)
            .map(|e| (e.step, e.bits_per_byte.unwrap_or(e.accuracy))),
    })
}

/// The race to the target, summarised: each mesh node's step and time beside the lone
/// control's (none with `--no-alone`), and the ratios.
pub(super) fn target_summary(
    args: &LocalArgs,
    config: &Config,
    target: f64,
    summary: &LocalSummary,
    alone: Option<LoneControl>,
) -> TargetSummary {
    let mesh: Option<Vec<Reached>> = summary.per_node.iter().map(|n| n.at_target).collect();
    let slowest =
        |f: fn(&Reached) -> f64| mesh.as_ref().and_then(|m| m.iter().map(f).reduce(f64::max));
    let (mesh_steps, mesh_secs) = (slowest(|r| r.step as f64), slowest(|r| r.secs));
    let lone = alone.and_then(|a| a.reached);
    TargetSummary {
        target,
        metric: if config.model.is_language_model() {
            "bits_per_byte"
        } else {
            "accuracy"
        },
        cores_per_node: args.cores_per_node,
        alone,
        steps_ratio: lone
            .zip(mesh_steps)
            .map(|(a, m)| a.step as f64 / m.max(1.0)),
        speedup: args
            .cores_per_node
            .and(lone.zip(mesh_secs))
            .map(|(a, m)| a.secs / m.max(1e-3)),
    }
}
