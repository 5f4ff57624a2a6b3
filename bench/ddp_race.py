#!/usr/bin/env python3
"""PyTorch DDP (gloo backend) on the MNIST MLP: the opponent in `p2ptrain bench race`.

N processes, one thread each, train the MLP 784-256-10 with SGD (lr, momentum, Nesterov as
configs/mnist-mlp.toml), initialised as p2ptrain initialises it, on batches of 32; each process trains on its own part of the training
set, cut as p2ptrain's `data.partition` cuts it (iid: every N-th sample; by_label: ceil(10/N)
classes per part, a shared class's samples dealt between its owners). Every `eval_every` steps,
and once `eval_secs` passed since the last time (a step over a slow link can take a second),
rank 0 evaluates on the 10,000 test images (all replicas hold the same parameters in DDP, so
this is every process's accuracy); every CHECK_EVERY steps it tells the others whether to
stop. It stops when that reaches the target or at the timeout,
and writes one JSON object: time to target from this script's start (data loading included,
as p2ptrain's clock starts at its first node's start), accuracy over time, bytes each process
sent (the ring all-reduce's 2(N-1)/N of the gradients per step, computed: gloo has no
counters), steps and samples per second.

Run by `p2ptrain bench race`; by hand:
  bench/ddp_race.py --mnist ../shared/data/mnist --nodes 4 --out ddp.json
With --rank R and --master HOST:PORT it runs one process of a multi-host run (`bench race
--link` runs one per namespace-lab host, with --iface naming the host's interface for gloo);
without, it spawns all N here on 127.0.0.1.
"""

import argparse
import gzip
import json
import os
import struct
import sys
import time

START = time.time()

# Steps between rank 0's stop broadcasts: often enough to stop within seconds over a slow
# link, rarely enough to cost nothing on loopback (4 bytes per 10 steps).
CHECK_EVERY = 10


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = struct.unpack(">I", data[:4])[0]
    dims = magic & 0xFF
    shape = struct.unpack(">" + "I" * dims, data[4 : 4 + 4 * dims])
    return data[4 + 4 * dims :], shape


def load(mnist, kind):
    import torch

    def find(stem):
        for name in (stem, stem + ".gz"):
            p = os.path.join(mnist, name)
            if os.path.exists(p):
                return p
        sys.exit(f"error: {stem}(.gz) not found in {mnist}")

    prefix = "train" if kind == "train" else "t10k"
    pixels, shape = read_idx(find(f"{prefix}-images.idx3-ubyte"))
    labels, _ = read_idx(find(f"{prefix}-labels.idx1-ubyte"))
    x = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).float().div_(255.0)
    x = x.view(shape[0], shape[1] * shape[2])
    y = torch.frombuffer(bytearray(labels), dtype=torch.uint8).long()
    return x, y


def part(y, how, k, n, classes=10):
    """The indices of part k of n, as p2ptrain's `Dataset::part` cuts them."""
    import torch

    if how == "iid":
        return torch.arange(k, len(y), n)
    per = -(-classes // n)
    mine = []
    for c in range(classes):
        owners = [p for p in range(n) if (c + classes - (p * per) % classes) % classes < per]
        if k in owners:
            idx = (y == c).nonzero().flatten()
            mine.append(idx[owners.index(k) :: len(owners)])
    return torch.sort(torch.cat(mine)).values


def worker(rank, args, result_path):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.set_num_threads(1)
    host, port = args.master.rsplit(":", 1)
    os.environ["MASTER_ADDR"] = host
    os.environ["MASTER_PORT"] = port
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    dist.init_process_group("gloo", rank=rank, world_size=args.nodes)
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    # p2ptrain's initialisation (models/src/init.rs): He-uniform hidden layers, Glorot-uniform
    # output layer, zero biases. torch's default (uniform +-1/sqrt(fan_in)) trains slower here.
    with torch.no_grad():
        hidden, out = model[0], model[2]
        hidden.weight.uniform_(-((6 / 784) ** 0.5), (6 / 784) ** 0.5)
        out.weight.uniform_(-((6 / (256 + 10)) ** 0.5), (6 / (256 + 10)) ** 0.5)
        hidden.bias.zero_()
        out.bias.zero_()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(
        ddp.parameters(), lr=args.lr, momentum=args.momentum, nesterov=args.momentum > 0
    )
    x, y = load(args.mnist, "train")
    idx = part(y, args.partition, rank, args.nodes)
    xs, ys = x[idx], y[idx]
    tx, ty = load(args.mnist, "test") if rank == 0 else (None, None)
    gen = torch.Generator().manual_seed(1000 + rank)
    numel = sum(p.numel() for p in model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    curve, reached, step = [], None, 0
    last_eval = time.time()
    stop = torch.zeros(1)
    order, pos = torch.randperm(len(xs), generator=gen), 0
    while True:
        if pos + args.batch > len(order):
            order, pos = torch.randperm(len(xs), generator=gen), 0
        b = order[pos : pos + args.batch]
        pos += args.batch
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(xs[b]), ys[b]).backward()
        opt.step()
        step += 1
        if rank == 0:
            by_clock = args.eval_secs > 0 and time.time() - last_eval >= args.eval_secs
            by_steps = args.eval_every > 0 and step % args.eval_every == 0
            if by_steps or by_clock:
                with torch.no_grad():
                    acc = (model(tx).argmax(1) == ty).float().mean().item()
                last_eval = time.time()
                t = last_eval - START
                curve.append([t, acc])
                if reached is None and acc >= args.target:
                    reached = t
            if reached is not None or time.time() - START >= args.timeout:
                stop.fill_(1.0)
        if step % CHECK_EVERY == 0:
            dist.broadcast(stop, 0)
            if stop.item() > 0:
                break
    wall = time.time() - START
    if rank == 0:
        sent = step * 2 * (args.nodes - 1) / args.nodes * numel * 4
        with open(result_path, "w") as f:
            json.dump(
                {
                    "framework": "pytorch-ddp",
                    "backend": "gloo",
                    "torch": torch.__version__,
                    "nodes": args.nodes,
                    "partition": args.partition,
                    "target": args.target,
                    "time_to_target_s": reached,
                    "final_accuracy": curve[-1][1] if curve else None,
                    "steps": step,
                    "samples_per_sec_per_node": step * args.batch / wall,
                    "bytes_sent_per_node": sent,
                    "bytes_sent_per_node_note": "computed: 2(N-1)/N of the f32 gradients per step",
                    "wall_s": wall,
                    "accuracy_over_time": curve,
                },
                f,
            )
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mnist", required=True)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.97)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-secs", type=float, default=0.0, help="also evaluate on this clock")
    ap.add_argument("--partition", choices=["iid", "by_label"], default="iid")
    ap.add_argument("--master", default="127.0.0.1:29517")
    ap.add_argument("--rank", type=int, help="run only this rank (multi-host)")
    ap.add_argument("--iface", help="GLOO_SOCKET_IFNAME for this process")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.rank is not None:
        worker(args.rank, args, args.out)
        return
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args, args.out), nprocs=args.nodes, join=True)


if __name__ == "__main__":
    main()
