#!/usr/bin/env bash
# Every GPU check in one go, for a GPU machine without a Rust toolchain (docs/gpu.md): the GPU
# kernels against their CPU twins; `bench step --device cuda` side by side with PyTorch eager on
# the SmolLM-shaped Llama (against transformers' own LlamaForCausalLM), the 10.8 M GPT and the
# GPT-2 small config; `bench trainer` on the GPT-2 small config; a mixed Llama mesh (a cuda node
# founding, a cpu node of the same binary joining) for MESH_SECS seconds (default 45), both
# nodes' statuses kept. Build here first, then on the GPU machine:
#
#   bench/cuda_session.sh DIR OUT [PART...]
#
# PART: twins, llama, mesh, gpt, trainer (all of them, in that order, when none is named), or
# levers (the 10.8 M GPT with each GPU lever on its own, p2ptrain alone; not in the default set).
# DIR holds `p2ptrain` (a release build with `--features cuda`), `twins` (the models crate's
# test binary of the same build: `cargo test --release -p p2ptrain-models --features cuda
# --no-run`) and `shakespeare.txt.gz`; OUT receives a JSON report per run and the logs. Python
# with torch (and transformers, for the Llama) is `python3` unless PYTHON says otherwise; the
# CUDA libraries are taken from its nvidia-* wheels. Each part has its own time limit, so one
# that hangs costs only its share.
set -u
dir=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
parts=" ${*:-twins llama mesh gpt trainer} "
want() { [[ $parts == *" $1 "* ]]; }
python=${PYTHON:-$(command -v python3)}
lib=$("$python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
repo=$(cd "$(dirname "$0")/.." && pwd)

# The configs read the corpus at ../../shared/data/text and the fixture's tokenizer at
# ../models/fixtures beside their folder.
work=$(mktemp -d)
mkdir -p "$work/a/configs" "$work/a/models/fixtures" "$work/shared/data/text"
cp "$repo"/configs/*.toml "$work/a/configs/"
cp -r "$repo/models/fixtures/hf-llama-tiny" "$work/a/models/fixtures/"
cp "$dir/shakespeare.txt.gz" "$work/shared/data/text/"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$out/gpu.csv" 2>&1
"$python" -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))' >>"$out/gpu.csv" 2>&1
cat "$out/gpu.csv"

if want twins; then
    echo "== twins"
    timeout 180 "$dir/twins" --test-threads=1 gpu:: 2>&1 | tee "$out/twins.log" | tail -12
fi

step() { # name, seconds limit, then bench step's arguments
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    (cd "$work/a" && timeout "$limit" "$dir/p2ptrain" bench step --device cuda --configs configs \
        --python "$python" --torch-script "$repo/bench/step_torch.py" --optimizers adamw \
        --codec-reps 2 --out "$out/$name.json" "$@" >"$out/$name.log" 2>&1)
    echo "exit $?"
    grep -E '"(gpu_levers|torch_model|p2ptrain_median|torch_median|ratio|gpu_wait_fraction)"' "$out/$name.json" 2>/dev/null ||
        tail -5 "$out/$name.log"
}

if want llama; then
    # The SmolLM-shaped Llama (134.5 M parameters, batch 8, context 2048) against transformers'
    # own LlamaForCausalLM in eager attention, f32 products on both sides.
    step llama-smollm 240 --models smollm-135m-gpu --seconds 4 --runs 3 --transformers-llama
fi

if want mesh; then
    echo "== mesh"
    bin=$dir/p2ptrain
    config="configs/${MESH_CONFIG:-llama-tiny}.toml"
    cd "$work/a"
    "$bin" join --config "$config" --device cuda --data-dir "$work/mesh-a" --api 127.0.0.1:7071 \
        --listen /ip4/127.0.0.1/tcp/4101 >"$out/mesh-a.log" 2>&1 &
    a=$!
    id=
    for _ in $(seq 60); do
        id=$("$bin" status --api 127.0.0.1:7071 --json 2>/dev/null |
            "$python" -c 'import json, sys; print(json.load(sys.stdin)["peer_id"])' 2>/dev/null) &&
            [ -n "$id" ] && break
        sleep 1
    done
    echo "founder $id"
    "$bin" join --config "$config" --device cpu --threads 4 --data-dir "$work/mesh-b" \
        --api 127.0.0.1:7072 --listen /ip4/127.0.0.1/tcp/4102 \
        --bootstrap "/ip4/127.0.0.1/tcp/4101/p2p/$id" >"$out/mesh-b.log" 2>&1 &
    b=$!
    sleep "${MESH_SECS:-45}"
    "$bin" status --api 127.0.0.1:7071 --json >"$out/mesh-a.json" 2>&1
    "$bin" status --api 127.0.0.1:7072 --json >"$out/mesh-b.json" 2>&1
    "$bin" stop --api 127.0.0.1:7072 >/dev/null 2>&1
    "$bin" stop --api 127.0.0.1:7071 >/dev/null 2>&1
    for _ in $(seq 20); do
        kill -0 $a 2>/dev/null || kill -0 $b 2>/dev/null || break
        sleep 1
    done
    kill -9 $a $b 2>/dev/null
    cd "$repo"
    for f in "$out"/mesh-a.json "$out"/mesh-b.json; do
        "$python" - "$f" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[1], "no status:", e)
    raise SystemExit
keys = ["device", "step", "loss", "updates", "full_syncs", "rejected_by_peer", "sync_refusals",
        "consensus_distance"] + [k for k in s if "ban" in k]
print(sys.argv[1].rsplit("/", 1)[-1], "peers", s.get("peers", {}).get("count"),
      json.dumps({k: s.get(k) for k in keys}))
PY
    done
fi

if want gpt; then
    # Every lever on (the default), against PyTorch: the 10.8 M GPT, then GPT-2 small.
    step gpt-default 150 --models text-gpt-gpu --seconds 3 --runs 3
    step gpt2s-default 200 --models text-gpt2s-gpu --seconds 4 --runs 3
fi

if want levers; then
    for levers in none events-off pool htod-cache kernels; do
        P2PTRAIN_CUDA_LEVERS=$levers step "gpt-$levers" 120 --models text-gpt-gpu --seconds 2 --runs 2 --no-torch
    done
    P2PTRAIN_CUDA_LEVERS=default,tf32 step gpt-tf32 150 --models text-gpt-gpu --seconds 3 --runs 3
fi

if want trainer; then
    echo "== trainer"
    (cd "$work/a" && timeout 150 "$dir/p2ptrain" bench trainer --config configs/text-gpt2s-gpu.toml \
        --steps 60 --runs 2 --out "$out/trainer-gpt2s.json" >"$out/trainer-gpt2s.log" 2>&1)
    echo "exit $?"
    tail -c 600 "$out/trainer-gpt2s.json" 2>/dev/null || tail -5 "$out/trainer-gpt2s.log"
fi
rm -rf "$work"
