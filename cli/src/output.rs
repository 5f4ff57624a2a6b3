//! Human-readable renderings of what the daemon reports.

use p2ptrain_daemon::status::{CheckpointView, Status};

fn duration(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}"))
        .unwrap_or_else(|| "-".into())
}

/// The multi-line report of `p2ptrain status`.
pub fn status_text(s: &Status) -> String {
    let mut out = String::new();
    out.push_str(&format!("node      {}\n", s.node.peer_id));
    out.push_str(&format!(
        "run       {}  ({:?})\n",
        s.node.run_id, s.training.phase
    ));
    out.push_str(&format!(
        "model     {} ({} parameters, {}) on {}\n",
        s.node.model.name, s.node.model.params, s.node.optimizer, s.node.device
    ));
    out.push_str(&format!("data      {}", s.node.data));
    let classes = &s.node.train_classes;
    if !classes.is_empty() {
        let held: Vec<String> = (0..classes.len())
            .filter(|&c| classes[c] > 0)
            .map(|c| c.to_string())
            .collect();
        out.push_str(&format!(
            "; trains on {} samples of classes {} (of {})",
            classes.iter().sum::<u64>(),
            held.join(" "),
            classes.len()
        ));
    }
    out.push('\n');
    out.push_str(&format!(
        "progress  step {}, {} samples, loss {}, {:.0} samples/s\n",
        s.training.step,
        s.training.samples_seen,
        opt(s.training.loss, 4),
        s.training.samples_per_sec
    ));
    match &s.training.eval {
        Some(e) => match (e.bits_per_byte, e.perplexity) {
            (Some(bpb), Some(ppl)) => out.push_str(&format!(
                "eval      {bpb:.3} bits per byte, perplexity {ppl:.2}, next-byte accuracy {:.2}%, loss {:.4} (step {})\n",
                e.accuracy * 100.0,
                e.loss,
                e.step
            )),
            _ => out.push_str(&format!(
                "eval      accuracy {:.2}%, loss {:.4} (step {})\n",
                e.accuracy * 100.0,
                e.loss,
                e.step
            )),
        },
        None => out.push_str("eval      none yet\n"),
    }
    match &s.checkpoints.last_checkpoint {
        Some(c) => out.push_str(&format!(
            "checkpoint {} at step {}: {}\n",
            c.id, c.step, c.path
        )),
        None => out.push_str("checkpoint none yet\n"),
    }
    if let Some(r) = &s.checkpoints.resumed_from {
        out.push_str(&format!(
            "resumed   from checkpoint {} (step {})\n",
            r.id, r.step
        ));
    }
    out.push_str(&format!(
        "mesh      {} peers ({} neighbours), updates sent {} received {} applied {} rejected {}\n",
        s.peers.count,
        s.mesh.neighbours.len(),
        s.mesh.updates.sent,
        s.mesh.updates.received,
        s.mesh.updates.applied,
        s.mesh.updates.rejected
    ));
    out.push_str(&format!(
        "traffic   {} bytes sent, {} received{}\n",
        s.network.bytes_sent,
        s.network.bytes_received,
        s.mesh
            .consensus_distance
            .map(|d| format!(", consensus distance {:.2}%", d * 100.0))
            .unwrap_or_default()
    ));
    if let Some(r) = &s.mesh.rounds {
        let aborted: u64 = r.aborted.values().sum();
        out.push_str(&format!(
            "rounds    {} ({}): round {}, ring of {}, {} completed, {} attempts aborted, last {:.1} ms{}\n",
            s.sync.mode,
            if r.synced { "synced" } else { "joining" },
            r.round.map_or_else(|| "-".to_string(), |n| n.to_string()),
            r.ring_size,
            r.completed,
            aborted,
            r.last_round_ms,
            r.digests
                .last()
                .map(|(n, d, _)| format!(", parameters {d} after round {n}"))
                .unwrap_or_default()
        ));
    }
    let f = &s.mesh.full_syncs;
    if f.accepted + f.refused + f.failed > 0 {
        out.push_str(&format!(
            "syncs     {} accepted, {} refused (bound {:.2}), {} without a reply\n",
            f.accepted, f.refused, f.bound, f.failed
        ));
    }
    for a in &s.network.listen_addrs {
        out.push_str(&format!("listen    {a}\n"));
    }
    if !s.network.nat.reachability.is_empty() {
        out.push_str(&format!("reach     {}", s.network.nat.reachability));
        if let Some(a) = &s.network.nat.public_addr {
            out.push_str(&format!(" at {a}"));
        }
        for a in &s.network.nat.relay_addrs {
            out.push_str(&format!(", through relay {a}"));
        }
        out.push_str(&format!(
            "; {} relayed connections, {} hole punches ({} failed)\n",
            s.network.nat.relayed_connections,
            s.network.nat.hole_punches,
            s.network.nat.hole_punch_failures
        ));
    }
    if let Some(f) = &s.network.psk_fingerprint {
        out.push_str(&format!(
            "private   PSK fingerprint {f}, {} failed handshakes\n",
            s.network.handshake_failures
        ));
    }
    if let Some(n) = s.network.allowlist {
        out.push_str(&format!(
            "allowlist {n} peers, {} connections refused\n",
            s.network.denied_connections
        ));
    }
    for b in &s.network.banned_peers {
        out.push_str(&format!("banned    {}\n", banned_line(b)));
    }
    out.push_str(&format!("uptime    {}\n", duration(s.node.uptime_s)));
    let memory: Vec<String> = [
        ("heap", s.node.memory.heap_bytes),
        ("resident", s.node.memory.resident_bytes),
    ]
    .iter()
    .filter_map(|(what, bytes)| Some(format!("{what} {:.1} MB", (*bytes)? as f64 / 1e6)))
    .collect();
    if !memory.is_empty() {
        out.push_str(&format!("memory    {}\n", memory.join(", ")));
    }
    out.push_str(&format!("data dir  {}\n", s.node.data_dir));
    out.push_str(&format!("api       {}\n", s.node.api));
    out
}

/// One line for `p2ptrain status --watch`.
pub fn status_line(s: &Status) -> String {
    let acc = s
        .training
        .eval
        .map(|e| e.headline())
        .unwrap_or_else(|| "-".into());
    format!(
        "{:>8}  step {:>8}  loss {:>7}  eval {:>9}  {:>8.0} samples/s  {:?}",
        duration(s.node.uptime_s),
        s.training.step,
        opt(s.training.loss, 4),
        acc,
        s.training.samples_per_sec,
        s.training.phase
    )
}

/// The table of `p2ptrain checkpoint list`.
pub fn checkpoint_table(list: &[CheckpointView]) -> String {
    if list.is_empty() {
        return "no checkpoints yet\n".into();
    }
    let mut out = format!("{:>6} {:>10} {:>10}  {}\n", "id", "step", "bytes", "path");
    for c in list {
        out.push_str(&format!(
            "{:>6} {:>10} {:>10}  {}\n",
            c.meta.id, c.meta.info.step, c.meta.bytes, c.path
        ));
    }
    out
}

/// The table of `p2ptrain peers`, then the banned peers with why and until when.
pub fn peers_table(s: &Status) -> String {
    let mut out = String::new();
    if s.peers.list.is_empty() {
        out.push_str("no peers\n");
    } else {
        out.push_str(&format!(
            "{:<54} {:>9} {:>8} {:>8} {:>8} {:>9} {:>7} {:>8}  {}\n",
            "peer", "neighbour", "rtt ms", "step", "loss", "samples/s", "score", "path", "address"
        ));
    }
    for p in &s.peers.list {
        let (link, hb) = (&p.link, p.heartbeat.as_ref());
        out.push_str(&format!(
            "{:<54} {:>9} {:>8} {:>8} {:>8} {:>9} {:>7} {:>8}  {}\n",
            link.peer_id,
            if p.neighbour { "yes" } else { "" },
            opt(link.rtt_ms, 1),
            hb.map(|h| h.step.to_string()).unwrap_or_else(|| "-".into()),
            opt(hb.and_then(|h| h.loss), 4),
            opt(hb.map(|h| h.samples_per_sec), 0),
            opt(link.score, 1),
            link.path.as_deref().unwrap_or("-"),
            link.remote.as_deref().unwrap_or(&link.address)
        ));
    }
    let offenders: Vec<_> = s
        .peers
        .list
        .iter()
        .filter(|p| p.link.offences > 0)
        .collect();
    if !offenders.is_empty() {
        out.push_str("\noffences (what a ban would name):\n");
        for p in offenders {
            out.push_str(&format!(
                "  {}: {} (last: {})\n",
                p.link.peer_id,
                p.link.offences,
                p.link.last_offence.as_deref().unwrap_or("-")
            ));
        }
    }
    if !s.network.banned_peers.is_empty() {
        out.push_str("\nbanned:\n");
        for b in &s.network.banned_peers {
            out.push_str(&format!("  {}\n", banned_line(b)));
        }
    }
    out
}

/// One banned peer: who, until when, and why.
fn banned_line(b: &p2ptrain_daemon::network::BannedPeer) -> String {
    format!(
        "{} until {} ({} left, score {:.1}): {}",
        b.peer_id,
        utc_time(b.until),
        duration(b.secs_left),
        b.score,
        if b.reason.is_empty() {
            "no reason recorded"
        } else {
            &b.reason
        }
    )
}

/// `HH:MM:SS UTC` of a Unix time, for ban ends (a home lab reads its own clock).
fn utc_time(unix: u64) -> String {
    let secs = unix % 86_400;
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600,
        (secs % 3600) / 60,
        secs % 60
    )
}

/// Bytes in B, kB, MB or GB (powers of 1000), for people.
pub(crate) fn human_bytes(b: f64) -> String {
    match b {
        b if b >= 1e9 => format!("{:.1} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}
