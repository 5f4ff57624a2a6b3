#!/usr/bin/env python3
"""One rank of PyTorch DDP (gloo backend) on a p2ptrain config: the opponent in
`p2ptrain bench scaling`.

`bench scaling` writes the config's data as p2ptrain loads it (`--data DIR`: `meta.json` and raw
arrays, so both sides train and evaluate on the very same samples and bytes) and starts one
process per rank, each pinned to its own cores (and, with `--link`, on its own namespace-lab
host). Each rank builds the model `--spec` describes (`step_torch.build`: the MLP, the CNN or
the byte-level GPT, layer for layer as models/src builds them), initialised by p2ptrain's rules
(He-uniform hidden layers and Glorot-uniform output layer with zero biases for the MLP and the
CNN; GPT-2's normal(0, 0.02) with the residual projections scaled by 1/sqrt(2 layers) for the
GPT), with the optimizer `--optim` and the learning-rate schedule `--schedule` describe
(p2ptrain's `OptimizerSpec` and `Schedule` as JSON). Rank r draws its batches from its own
seeded permutation of the training samples (seed `--seed`), as a p2ptrain node with its own
node seed does; DDP averages the gradients every step.

Every `--eval-every` steps rank 0 (all replicas hold the same parameters) evaluates on the
held-out set and appends one line to `DIR/evals.jsonl` in p2ptrain's own format (step, wall
clock in ms, loss, accuracy, bits per byte for text, seconds spent evaluating), and rewrites
`DIR/ddp.json` (steps, parameters, torch's version, and the bytes each rank sent: the ring
all-reduce's 2(N-1)/N of the f32 gradients per step, computed, since gloo keeps no counters).
It trains until killed (the benchmark stops it at the target) or until rank 0 has trained
`--max-seconds` and says so to the others.

By hand, two ranks on loopback:
  for r in 0 1; do bench/.venv/bin/python bench/ddp_train.py --rank $r --nodes 2 \\
      --master 127.0.0.1:29517 --data D --spec S --optim O --schedule C --batch 32 \\
      --eval-every 20 --seed $((100 + r)) --dir out$r & done
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_torch  # noqa: E402 (the models, built as p2ptrain builds them)

# Steps between rank 0's stop broadcasts: 4 bytes per 10 steps.
CHECK_EVERY = 10


def schedule_factor(schedule, t):
    """p2ptrain's `Schedule::factor` at optimizer step t (1-based)."""
    if schedule.get("kind", "constant") == "constant":
        return 1.0
    warmup, total, floor = schedule["warmup_steps"], schedule["total_steps"], schedule["min_factor"]
    if t < warmup:
        return t / warmup
    span = max(total - warmup, 1)
    progress = min((t - warmup) / span, 1.0)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def initialise(model, spec, torch):
    nn = torch.nn
    with torch.no_grad():
        if spec["kind"] == "gpt":
            residual = 0.02 / math.sqrt(2 * spec["layers"])
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln" in name or name.startswith("ln_f"):
                    p.fill_(1.0)
                elif name.endswith("proj.weight"):
                    p.normal_(0.0, residual)
                else:
                    p.normal_(0.0, 0.02)
            return
        layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        for i, m in enumerate(layers):
            fan_in = m.weight[0].numel()
            if i + 1 < len(layers):
                bound = math.sqrt(6.0 / fan_in)
            else:
                bound = math.sqrt(6.0 / (fan_in + m.weight.shape[0]))
            m.weight.uniform_(-bound, bound)
            m.bias.zero_()


class Samples:
    """The training or held-out samples of `bench scaling`'s data export."""

    def __init__(self, data, meta, half, torch):
        import numpy as np

        self.kind = meta["kind"]
        if self.kind == "text":
            raw = np.fromfile(os.path.join(data, f"{half}.bytes"), dtype=np.uint8)
            self.bytes = torch.from_numpy(raw.astype(np.int64))
            self.context = meta["context"]
            self.stride = meta["train_stride"] if half == "train" else self.context
            self.len = (len(raw) - (self.context + 1)) // self.stride + 1
        else:
            x = np.fromfile(os.path.join(data, f"{half}_x.f32"), dtype="<f4")
            y = np.fromfile(os.path.join(data, f"{half}_y.u32"), dtype="<u4")
            self.x = torch.from_numpy(x.reshape(len(y), meta["dim"]).copy())
            self.y = torch.from_numpy(y.astype(np.int64))
            self.len = len(y)

    def batch(self, idx, torch):
        if self.kind == "text":
            starts = idx * self.stride
            offsets = torch.arange(self.context + 1)
            windows = self.bytes[starts.unsqueeze(1) + offsets.unsqueeze(0)]
            return windows[:, :-1], windows[:, 1:]
        return self.x[idx], self.y[idx]


def evaluate(model, test, meta, torch):
    F = torch.nn.functional
    per = max(8192 // meta["context"], 1) if meta["kind"] == "text" else 1000
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, test.len, per):
            idx = torch.arange(start, min(start + per, test.len))
            xs, ys = test.batch(idx, torch)
            logits = model(xs)
            logits, ys = logits.reshape(-1, logits.shape[-1]), ys.reshape(-1)
            loss_sum += F.cross_entropy(logits, ys, reduction="sum").item()
            correct += (logits.argmax(1) == ys).sum().item()
            count += ys.numel()
    loss = loss_sum / count
    bits = loss / math.log(2) if meta["kind"] == "text" else None
    return loss, correct / count, bits


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--master", required=True, help="rank 0's HOST:PORT")
    ap.add_argument("--iface", help="GLOO_SOCKET_IFNAME (a namespace-lab host's eth0)")
    ap.add_argument("--data", required=True, help="bench scaling's data export")
    ap.add_argument("--spec", required=True, help="p2ptrain's ModelSpec as JSON")
    ap.add_argument("--optim", required=True, help="p2ptrain's OptimizerSpec as JSON")
    ap.add_argument("--schedule", default='{"kind":"constant"}', help="p2ptrain's Schedule")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--init-seed", type=int, default=42)
    ap.add_argument("--seed", type=int, required=True, help="this rank's data order")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, required=True)
    ap.add_argument("--max-seconds", type=float, default=3600.0)
    ap.add_argument("--dir", required=True, help="where rank 0 writes evals.jsonl, ddp.json")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    host, port = args.master.rsplit(":", 1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, port
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    dist.init_process_group("gloo", rank=args.rank, world_size=args.nodes)
    with open(os.path.join(args.data, "meta.json")) as f:
        meta = json.load(f)
    spec, schedule = json.loads(args.spec), json.loads(args.schedule)
    torch.manual_seed(args.init_seed)
    model, _ = step_torch.build(spec, torch)
    initialise(model, spec, torch)
    # The GPT's causal mask is a buffer that never changes: broadcasting it every step would
    # add a collective p2ptrain does not pay.
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = step_torch.optimizer(json.loads(args.optim), ddp.parameters(), torch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: schedule_factor(schedule, k + 1))
    train = Samples(args.data, meta, "train", torch)
    test = Samples(args.data, meta, "test", torch) if args.rank == 0 else None
    numel = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    order, pos, step, eval_secs = torch.randperm(train.len, generator=gen), 0, 0, 0.0
    os.makedirs(args.dir, exist_ok=True)
    started = time.time()
    F = torch.nn.functional
    stop = torch.zeros(1)
    while True:
        # Rank 0 decides when the time is up and tells the others every CHECK_EVERY steps:
        # a rank that left on its own clock would leave the rest waiting in a collective.
        if step % CHECK_EVERY == 0:
            if args.rank == 0 and time.time() - started >= args.max_seconds:
                stop.fill_(1.0)
            dist.broadcast(stop, 0)
            if stop.item() > 0:
                break
        if pos + args.batch > len(order):
            order, pos = torch.randperm(train.len, generator=gen), 0
        xs, ys = train.batch(order[pos : pos + args.batch], torch)
        pos += args.batch
        logits = ddp(xs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if args.rank == 0 and step % args.eval_every == 0:
            t = time.time()
            held_loss, accuracy, bits = evaluate(model, test, meta, torch)
            eval_secs += time.time() - t
            record = {
                "step": step,
                "unix_ms": int(time.time() * 1000),
                "loss": held_loss,
                "accuracy": accuracy,
                "bits_per_byte": bits,
                "eval_secs": eval_secs,
            }
            with open(os.path.join(args.dir, "evals.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
            sent = step * 2 * (args.nodes - 1) / args.nodes * numel * 4
            with open(os.path.join(args.dir, "ddp.json.tmp"), "w") as f:
                json.dump(
                    {
                        "framework": "pytorch-ddp",
                        "backend": "gloo",
                        "torch": torch.__version__,
                        "steps": step,
                        "params": numel,
                        "bytes_sent_per_node": sent,
                    },
                    f,
                )
            os.replace(os.path.join(args.dir, "ddp.json.tmp"), os.path.join(args.dir, "ddp.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
