#!/usr/bin/env python3
"""Checks a Hugging Face Llama folder against the hf-llama-tiny fixture's expected numbers.

Loads DIR with transformers (`LlamaForCausalLM.from_pretrained`, dtype float32, eager attention),
fails if the load reports any missing, unexpected or mismatched key, runs the fixture's
`input_ids` and compares the logits (max absolute difference) and the loss with labels=input_ids
(relative difference) with those in `expected.safetensors`. `--bf16` compares with the figures of
the bf16 copy (`logits_bf16`, `loss_bf16`) instead of the float32 ones.

Prints one JSON line with the figures; exits 1, with the reason on stderr, when the load reports a
key problem or a difference exceeds `--tol`.

Meant for a folder written by p2ptrain's exporter, and for the fixture itself:
  python bench/hf_fixture/check_export.py models/fixtures/hf-llama-tiny
  python bench/hf_fixture/check_export.py models/fixtures/hf-llama-tiny/bf16 --bf16
Needs the venv of bench/hf_fixture/requirements.txt (see make_fixture.py).
"""

import argparse
import json
import logging
import pathlib
import re
import sys
import warnings

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_EXPECTED = REPO / "models/fixtures/hf-llama-tiny/expected.safetensors"

# Words of transformers' load report (utils/loading_report.py) and of older versions' messages
# about weights left out of, or left over from, a checkpoint.
KEY_PROBLEM_WORDS = (
    "missing", "unexpected", "mismatch", "newly initialized", "not initialized",
    "were not used", "not used when initializing",
)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        text = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())  # the report's colour codes
        self.messages.append(f"{record.name}: {text}")


def load_checked(folder, torch_dtype=None):
    """from_pretrained(folder) in float32 and eager attention, in eval mode.

    Returns (model, messages): every warning transformers logged or raised while loading. Raises
    RuntimeError if the load reported a missing, unexpected or mismatched key, whether through
    the logger or through `output_loading_info`.
    """
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    transformers.logging.set_verbosity_warning()  # the load report is a warning; keep it visible
    transformers.logging.disable_progress_bar()
    handler = _Collect()
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = LlamaForCausalLM.from_pretrained(
                folder,
                dtype=torch_dtype or torch.float32,
                attn_implementation="eager",
                output_loading_info=True,
            )
    finally:
        root.removeHandler(handler)
    messages = handler.messages + [f"{w.category.__name__}: {w.message}" for w in caught]
    problems = [m for m in messages if any(word in m.lower() for word in KEY_PROBLEM_WORDS)]
    for name in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(name):
            problems.append(f"{name}: {sorted(map(str, info[name]))}")
    if problems:
        raise RuntimeError(f"loading {folder} reported key problems:\n" + "\n".join(problems))
    model.eval()
    return model, messages


def run(model, input_ids):
    """Logits [batch, seq, vocab] and transformers' own loss (shifted mean cross-entropy)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    return out.logits.float(), out.loss.double()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="Hugging Face model folder (config.json + safetensors)")
    ap.add_argument("--expected", default=str(DEFAULT_EXPECTED), help="expected.safetensors")
    ap.add_argument("--tol", type=float, default=1e-4,
                    help="max |logit difference|, and max relative loss difference")
    ap.add_argument("--bf16", action="store_true",
                    help="compare with logits_bf16 / loss_bf16 (the fixture's bf16 copy)")
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    expected = load_file(args.expected)
    suffix = "_bf16" if args.bf16 else ""
    try:
        model, _ = load_checked(args.dir)
    except RuntimeError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        sys.exit(1)

    logits, loss = run(model, expected["input_ids"])
    want_logits = expected["logits" + suffix]
    want_loss = expected["loss" + suffix].double().reshape(())
    if logits.shape != want_logits.shape:
        print(f"FAIL: logits shape {tuple(logits.shape)}, expected {tuple(want_logits.shape)}",
              file=sys.stderr)
        sys.exit(1)
    max_diff = (logits - want_logits).abs().max().item()
    loss_rel = abs(loss.item() - want_loss.item()) / abs(want_loss.item())
    ok = max_diff <= args.tol and loss_rel <= args.tol
    print(json.dumps({
        "dir": args.dir,
        "compared_with": "logits" + suffix,
        "max_abs_logit_diff": max_diff,
        "max_abs_logit": want_logits.abs().max().item(),
        "loss": loss.item(),
        "loss_expected": want_loss.item(),
        "loss_rel_diff": loss_rel,
        "tol": args.tol,
        "ok": ok,
    }))
    if not ok:
        print(f"FAIL: max |logit diff| {max_diff:.3g}, loss relative diff {loss_rel:.3g}, "
              f"tolerance {args.tol:g}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
