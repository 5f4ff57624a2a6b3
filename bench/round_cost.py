#!/usr/bin/env python3
"""Where a synchronous step's time goes: a pinned pair of nodes against one node alone.

Starts one node alone (pinned to core 0), then N nodes of a synchronous mode (node k pinned to
core k, `min_members = N`, so they take every step together), each for `--steps` steps with
`join --timeline`, no evaluations and no checkpoints on a clock. It reads the trainer's and the
mesh actor's spans from each node's timeline and prints one JSON object (and writes it to
`--out`): per run, the step period (from one optimizer step's end to the next), the
forward-backward pass, and for the mesh:

- `wait_ms`: from a node's own forward-backward end to its optimizer step (the round, seen
  by the trainer);
- `straggler_ms`: how far apart the members' forward-backward passes end (the faster waits
  that long for the slower one);
- `critical_ms`: from the later member's forward-backward end to the first optimizer step
  (the round's own cost: encoding, the exchange, summing, handing the mean back);
- `gap_ms`: from a node's optimizer step to its next forward-backward (parameter rounds every
  `resync_every` steps show here);
- the mesh actor's spans (`round_contribute`, `round_hop`) and the overhead of a mesh step over
  a lone one, `mesh_period / alone_period`.

Steps are matched across nodes by their step number; two nodes' clocks are aligned on the
optimizer steps, which every member takes when the same mean arrives. The first `--skip` steps
are left out (start-up). Medians, means and 90th percentiles are over steps.

  python3 bench/round_cost.py --bin target/release/p2ptrain --config configs/text-gpt.toml \
      --steps 200 --out /tmp/round_cost.json [--mode ddp] [--nodes 2] [--extra 'resync_every = 100']
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def config(base, out, node_seed, mode, nodes, extra):
    """The base config without evaluations or checkpoints on a clock, with this node's seed and,
    for a mesh node, its `[sync]` section."""
    text = open(base).read()
    text = re.sub(r"(?m)^eval_every_secs\s*=.*$", "eval_every_secs = 0", text)
    text = re.sub(r"(?m)^eval_every\s*=.*$", "eval_every = 0", text)
    text = re.sub(r"(?m)^every_secs\s*=.*$", "every_secs = 0", text)
    text = re.sub(r"(?m)^every_steps\s*=.*$", "every_steps = 0", text)
    text = re.sub(r"(?m)^init_seed\s*=(.*)$", "init_seed =\\1\nnode_seed = %d" % node_seed, text, count=1)
    if mode:
        text += '\n[sync]\nmode = "%s"\nmin_members = %d\n%s\n' % (mode, nodes, extra.replace(";", "\n"))
    with open(out, "w") as f:
        f.write(text)


def start(binary, cfg, data_dir, core, steps, bootstrap=None):
    args = ["taskset", "-c", str(core), binary, "join", "--config", cfg, "--data-dir", data_dir,
            "--api", "127.0.0.1:0", "--listen", "/ip4/127.0.0.1/tcp/0", "--threads", "1",
            "--max-steps", str(steps), "--timeline", data_dir + ".trace"]
    if bootstrap:
        args += ["--bootstrap", bootstrap]
    log = open(data_dir + ".log", "w")
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)


def listen_addr(log, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", open(log).read())
        if m:
            return m.group(0)
        time.sleep(0.1)
    sys.exit("no listen address in " + log)


def spans(path):
    text = open(path).read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return [e for e in json.loads(text) if e.get("ph") == "X"]


def by_step(events, name):
    return {e["args"]["step"]: e for e in events
            if e["name"] == name and e.get("args", {}).get("step") is not None}


def end(e):
    return e["ts"] + e["dur"]


def summary(values):
    if not values:
        return None
    v = sorted(values)
    return {"median": round(statistics.median(v), 2), "mean": round(statistics.mean(v), 2),
            "p90": round(v[int(0.9 * (len(v) - 1))], 2), "n": len(v)}


def node_figures(events, skip):
    """A node's own figures: step period, forward-backward, wait and gap, in ms."""
    fb, opt = by_step(events, "forward_backward"), by_step(events, "optimizer")
    steps = sorted(s for s in opt if s in fb and s > skip)
    period = [(end(opt[b]) - end(opt[a])) / 1e3 for a, b in zip(steps, steps[1:]) if b == a + 1]
    wait = [(opt[s]["ts"] - end(fb[s])) / 1e3 for s in steps]
    gap = [(fb[b]["ts"] - end(opt[a])) / 1e3 for a, b in zip(steps, steps[1:]) if b == a + 1]
    mesh = {}
    for name in ("round_contribute", "round_hop"):
        durs = [e["dur"] / 1e3 for e in events if e["name"] == name]
        mesh[name + "_ms"] = summary(durs[skip:])
    return {"period_ms": summary(period), "forward_backward_ms": summary([fb[s]["dur"] / 1e3 for s in steps]),
            "wait_ms": summary(wait), "gap_ms": summary(gap), **mesh}


def pair_figures(a, b, skip):
    """Straggler and critical path of two members, their clocks aligned on optimizer starts."""
    fa, fb_ = by_step(a, "forward_backward"), by_step(b, "forward_backward")
    oa, ob = by_step(a, "optimizer"), by_step(b, "optimizer")
    steps = sorted(s for s in set(fa) & set(fb_) & set(oa) & set(ob) if s > skip)
    if not steps:
        return {}
    offset = statistics.median(oa[s]["ts"] - ob[s]["ts"] for s in steps)
    straggler, critical = [], []
    for s in steps:
        ea, eb = end(fa[s]), end(fb_[s]) + offset
        straggler.append(abs(ea - eb) / 1e3)
        critical.append((min(oa[s]["ts"], ob[s]["ts"] + offset) - max(ea, eb)) / 1e3)
    return {"straggler_ms": summary(straggler), "critical_ms": summary(critical)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default="target/release/p2ptrain")
    p.add_argument("--config", default="configs/text-gpt.toml")
    p.add_argument("--mode", default="ddp")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--extra", default="", help="more [sync] lines, ';'-separated")
    p.add_argument("--no-alone", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--keep", action="store_true", help="keep the nodes' directories")
    a = p.parse_args()
    if a.nodes > os.cpu_count():
        sys.exit("more nodes (%d) than cores (%d): each node needs a core of its own" % (a.nodes, os.cpu_count()))
    work = tempfile.mkdtemp(prefix="round_cost.")
    report = {"config": a.config, "mode": a.mode, "nodes": a.nodes, "steps": a.steps, "extra": a.extra}
    try:
        if not a.no_alone:
            cfg = os.path.join(work, "alone.toml")
            config(a.config, cfg, 1, None, 1, "")
            node = start(a.bin, cfg, os.path.join(work, "alone"), 0, a.steps)
            node.wait()
            report["alone"] = node_figures(spans(os.path.join(work, "alone.trace")), a.skip)
        procs, traces = [], []
        for k in range(a.nodes):
            cfg = os.path.join(work, "n%d.toml" % k)
            config(a.config, cfg, k + 1, a.mode, a.nodes, a.extra)
            d = os.path.join(work, "n%d" % k)
            boot = listen_addr(os.path.join(work, "n0.log")) if k > 0 else None
            procs.append(start(a.bin, cfg, d, k, a.steps, boot))
            traces.append(d + ".trace")
        for q in procs:
            q.wait()
        events = [spans(t) for t in traces]
        report["mesh"] = [node_figures(e, a.skip) for e in events]
        report["pair"] = pair_figures(events[0], events[1], a.skip) if a.nodes == 2 else {}
        if "alone" in report:
            alone = report["alone"]["period_ms"]["mean"]
            mesh = statistics.mean(n["period_ms"]["mean"] for n in report["mesh"])
            report["mesh_over_alone_period"] = round(mesh / alone, 4)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            report["dir"] = work
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
