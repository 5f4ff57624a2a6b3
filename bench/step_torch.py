#!/usr/bin/env python3
"""PyTorch eager's training step on p2ptrain's models: the yardstick of `p2ptrain bench step`.

Builds the model `--spec` describes (the JSON of p2ptrain's `ModelSpec`: an MLP, the LeNet-style
CNN, the byte-level GPT or the Llama, layer for layer as models/src builds them), the optimizer `--optim`
describes (the JSON of p2ptrain's `OptimizerSpec`: SGD with momentum / Nesterov / L2 decay, or
AdamW), and times `--steps` training steps on batches of `--batch` drawn at random from an
in-memory set of `--samples` random samples of the model's input shape (p2ptrain's bare loop
also gathers each batch from an in-memory set), on `--device` (cpu unless told). One thread
(`--threads`) by default, as p2ptrain's nodes. Every step: batch gather, forward, cross-entropy, backward, optimizer step.

For a Llama, `--transformers-llama` times transformers' own `LlamaForCausalLM` (eager attention)
rather than the written-out twin below (the same numbers; the GPU yardstick uses transformers'
own).

Prints one JSON object: steps per second for each of `--runs` timed runs, after `--warmup`
untimed steps (50 unless told).

Run by `p2ptrain bench step`; by hand:
  bench/.venv/bin/python bench/step_torch.py --spec '{"kind":"mlp","widths":[784,256,10]}' \
      --optim '{"kind":"sgd","lr":0.01,"momentum":0.9,"nesterov":true,"weight_decay":0}' \
      --batch 32 --steps 2000 --runs 3
"""

import argparse
import json
import math
import time


def build(spec, torch):
    nn = torch.nn
    F = torch.nn.functional
    kind = spec["kind"]
    if kind == "mlp":
        widths = spec["widths"]
        layers = []
        for i in range(len(widths) - 1):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if i + 2 < len(widths):
                layers.append(nn.ReLU())
        return nn.Sequential(*layers), ("features", widths[0])
    if kind == "cnn":
        h, w = spec["image"]
        c1, c2 = spec["channels"]
        side = lambda s: max(s // 2 - 4, 0) // 2  # noqa: E731 (as models/src/model.rs)
        widths = [c2 * side(h) * side(w)] + list(spec["hidden"]) + [spec["classes"]]
        fc = []
        for i in range(len(widths) - 1):
            fc.append(nn.Linear(widths[i], widths[i + 1]))
            if i + 2 < len(widths):
                fc.append(nn.ReLU())
        net = nn.Sequential(
            nn.Unflatten(1, (1, h, w)),
            nn.Conv2d(1, c1, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            *fc,
        )
        return net, ("features", h * w)
    if kind == "gpt":
        return Gpt(spec, torch), ("bytes", spec["context"])
    if kind == "llama":
        return Llama(spec, torch), ("tokens", spec["context"])
    if kind == "llama-transformers":
        return TransformersLlama(spec, torch), ("tokens", spec["context"])
    raise SystemExit(f"error: unknown model kind {kind!r}")


def Gpt(spec, torch):
    """p2ptrain's GPT: learned positions, pre-norm blocks (causal attention written out, as
    p2ptrain computes it, then a 4x MLP with SiLU), a final layer norm, a head tied to the
    byte embedding."""
    nn = torch.nn
    F = torch.nn.functional
    ctx, layers, width, heads = spec["context"], spec["layers"], spec["width"], spec["heads"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.ln2 = nn.LayerNorm(width)
            self.fc = nn.Linear(width, 4 * width)
            self.fc_proj = nn.Linear(4 * width, width)

        def forward(self, x, mask):
            b, t, _ = x.shape
            hd = width // heads
            q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
            q, k, v = (z.view(b, t, heads, hd).transpose(1, 2) for z in (q, k, v))
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)) + mask[:t, :t]
            att = F.softmax(scores, dim=-1) @ v
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, width))
            return x + self.fc_proj(F.silu(self.fc(self.ln2(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(256, width)
            self.pos = nn.Parameter(torch.zeros(ctx, width))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), -1e9), diagonal=1))

        def forward(self, tokens):
            t = tokens.shape[1]
            x = self.tok(tokens) + self.pos[:t]
            for blk in self.blocks:
                x = blk(x, self.mask)
            return self.ln_f(x) @ self.tok.weight.t()

    return Model()


def Llama(spec, torch):
    """p2ptrain's Llama-family decoder, as transformers' LlamaForCausalLM computes it in eager
    mode: RMS norms (written out as transformers' LlamaRMSNorm), rotary embeddings in the
    rotate-half layout, grouped-query attention with each key-value head repeated for its query
    heads (causal attention written out, as the GPT's above), a SwiGLU MLP, no biases, the head
    tied to the embedding or not."""
    nn = torch.nn
    F = torch.nn.functional
    ctx, width, layers = spec["context"], spec["hidden"], spec["layers"]
    heads, kv_heads, hd = spec["heads"], spec["kv_heads"], spec["head_dim"]
    eps, theta, vocab = spec["rms_eps"], spec["rope_theta"], spec["vocab"]

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate_half(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm()
            self.q = nn.Linear(width, heads * hd, bias=False)
            self.k = nn.Linear(width, kv_heads * hd, bias=False)
            self.v = nn.Linear(width, kv_heads * hd, bias=False)
            self.o = nn.Linear(heads * hd, width, bias=False)
            self.post_attention_layernorm = RMSNorm()
            self.gate = nn.Linear(width, spec["intermediate"], bias=False)
            self.up = nn.Linear(width, spec["intermediate"], bias=False)
            self.down = nn.Linear(spec["intermediate"], width, bias=False)

        def forward(self, x, mask, cos, sin):
            b, t, _ = x.shape
            h = self.input_layernorm(x)
            q = self.q(h).view(b, t, heads, hd).transpose(1, 2)
            k = self.k(h).view(b, t, kv_heads, hd).transpose(1, 2)
            v = self.v(h).view(b, t, kv_heads, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)) + mask[:t, :t]
            att = F.softmax(scores, dim=-1) @ v
            x = x + self.o(att.transpose(1, 2).reshape(b, t, heads * hd))
            h = self.post_attention_layernorm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RMSNorm()
            self.head = None if spec["tied"] else nn.Linear(width, vocab, bias=False)
            self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), -1e9), diagonal=1))
            inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
            angles = torch.outer(torch.arange(ctx, dtype=torch.float32), inv)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos())
            self.register_buffer("sin", angles.sin())

        def forward(self, tokens):
            t = tokens.shape[1]
            x = self.embed(tokens)
            cos, sin = self.cos[:t], self.sin[:t]
            for blk in self.blocks:
                x = blk(x, self.mask, cos, sin)
            x = self.norm(x)
            return x @ self.embed.weight.t() if self.head is None else self.head(x)

    return Model()


def TransformersLlama(spec, torch):
    """The same Llama as transformers' own `LlamaForCausalLM` in eager attention, built from
    p2ptrain's spec (the model users fine-tune, exactly as transformers computes it); called
    with token ids, it answers the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        rms_norm_eps=spec["rms_eps"],
        rope_theta=spec["rope_theta"],
        max_position_embeddings=spec["context"],
        tie_word_embeddings=spec["tied"],
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "eager"
    config.use_cache = False

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = LlamaForCausalLM(config)

        def forward(self, tokens):
            return self.inner(input_ids=tokens, use_cache=False).logits

    return Model()


def optimizer(spec, params, torch):
    kind = spec["kind"]
    if kind == "sgd":
        return torch.optim.SGD(
            params,
            lr=spec["lr"],
            momentum=spec["momentum"],
            nesterov=spec["nesterov"] and spec["momentum"] > 0,
            weight_decay=spec["weight_decay"],
        )
    if kind == "adamw":
        return torch.optim.AdamW(
            params,
            lr=spec["lr"],
            betas=(spec["beta1"], spec["beta2"]),
            eps=spec["eps"],
            weight_decay=spec["weight_decay"],
        )
    raise SystemExit(f"error: unknown optimizer kind {kind!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="p2ptrain's ModelSpec as JSON")
    ap.add_argument("--optim", required=True, help="p2ptrain's OptimizerSpec as JSON")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=50, help="untimed steps before the timed runs")
    ap.add_argument(
        "--transformers-llama",
        action="store_true",
        help="for a Llama, time transformers' own LlamaForCausalLM (eager attention) instead of the written-out twin",
    )
    ap.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N for a GPU yardstick")
    ap.add_argument(
        "--tf32",
        action="store_true",
        help="TF32 matrix products and convolutions on a GPU (both off by default here: PyTorch's own default allows TF32 in convolutions)",
    )
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.manual_seed(0)
    spec = json.loads(args.spec)
    built = spec
    if args.transformers_llama and spec["kind"] == "llama":
        built = dict(spec, kind="llama-transformers")
    model, (kind, dim) = build(built, torch)
    model = model.to(args.device)
    opt = optimizer(json.loads(args.optim), model.parameters(), torch)
    if kind == "features":
        inputs = torch.rand(args.samples, dim)
        classes = spec["widths"][-1] if spec["kind"] == "mlp" else spec["classes"]
        targets = torch.randint(0, classes, (args.samples,))
    else:
        vocab = spec.get("vocab", 256)
        text = torch.randint(0, vocab, (args.samples, dim + 1))
        inputs, targets = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    inputs, targets = inputs.to(args.device), targets.to(args.device)
    loss_fn = torch.nn.functional.cross_entropy

    def run(steps):
        last = float("nan")
        for _ in range(steps):
            idx = torch.randint(0, args.samples, (args.batch,), device=args.device)
            xs, ys = inputs.index_select(0, idx), targets.index_select(0, idx)
            logits = model(xs)
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last = loss.item()  # p2ptrain's step reads its loss back too
        return last

    run(args.warmup)
    rates = []
    for _ in range(args.runs):
        start = time.perf_counter()
        run(args.steps)
        rates.append(args.steps / (time.perf_counter() - start))
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "device": args.device,
                "tf32": args.tf32,
                "params": sum(p.numel() for p in model.parameters()),
                "model": built["kind"],
                "steps_per_sec": rates,
            }
        )
    )


if __name__ == "__main__":
    main()
