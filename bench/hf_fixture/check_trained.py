#!/usr/bin/env python3
"""Checks a Llama that p2ptrain trained, exported as a Hugging Face folder, with transformers.

Why: p2ptrain's held-out figures must be what the tools users take the model to compute. This
loads the export with from_pretrained (failing on any missing or unexpected key), evaluates it
on the held-out tail of the run's token file exactly as `p2ptrain eval` cuts it, compares the
loss with the one p2ptrain printed, and generates a few tokens from a prompt.

The held-out tail, as p2ptrain's `tokens.rs` cuts it: of N ids, the last round(N * test_fraction)
are held out; evaluation reads at most eval_tokens of them (plus one), as windows of context + 1
ids that do not overlap (stride context); the loss is the mean next-token cross-entropy over
every prediction of every window.

  /tmp/hfenv/bin/python bench/hf_fixture/check_trained.py --hf DIR --tokens FILE.bin \
      --context 64 --expect-loss 3.1333 [--token-bytes 2] [--test-fraction 0.1] \
      [--eval-tokens 16384] [--prompt "HAMLET."] [--tol 1e-3]

Prints one JSON line; exits 1 when the loss differs by more than --tol (absolute).
"""

import argparse
import json
import logging
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast


def held_out_windows(ids, context, test_fraction, eval_tokens):
    n = len(ids)
    # Rust's f64::round: halves away from zero (Python's round takes them to even).
    n_test = int(math.floor(n * test_fraction + 0.5))
    cut = n - n_test
    end = min(n, cut + max(eval_tokens, context) + 1) if eval_tokens > 0 else n
    tail = ids[cut:end]
    count = (len(tail) - (context + 1)) // context + 1
    return np.stack([tail[i * context: i * context + context + 1] for i in range(count)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--expect-loss", type=float, required=True)
    p.add_argument("--token-bytes", type=int, default=2)
    p.add_argument("--test-fraction", type=float, default=0.1)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--prompt", default="HAMLET.")
    p.add_argument("--tol", type=float, default=1e-3)
    a = p.parse_args()

    # transformers reports missing / unexpected keys through its log and its loading info.
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    transformers.logging.get_logger("transformers.modeling_utils").addHandler(handler)
    model, info = LlamaForCausalLM.from_pretrained(
        a.hf, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad or any("MISSING" in m or "UNEXPECTED" in m for m in records):
        print(f"loading {a.hf} reported {bad} {records}", file=sys.stderr)
        sys.exit(1)
    model.eval()

    dtype = {2: np.uint16, 4: np.uint32}[a.token_bytes]
    ids = np.fromfile(a.tokens, dtype=dtype).astype(np.int64)
    windows = torch.from_numpy(held_out_windows(ids, a.context, a.test_fraction, a.eval_tokens))
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in windows.split(128):
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += batch[:, 1:].numel()
    loss = total / count

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{a.hf}/tokenizer.json")
    prompt_ids = torch.tensor([tokenizer(a.prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=30, do_sample=False)
    text = tokenizer.decode(out[0])

    diff = abs(loss - a.expect_loss)
    print(json.dumps({
        "hf": a.hf,
        "windows": int(windows.shape[0]),
        "predictions": count,
        "loss": loss,
        "p2ptrain_loss": a.expect_loss,
        "abs_diff": diff,
        "tol": a.tol,
        "generated": text,
        "ok": diff <= a.tol,
    }))
    sys.exit(0 if diff <= a.tol else 1)


if __name__ == "__main__":
    main()
