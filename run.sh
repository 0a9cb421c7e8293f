#!/usr/bin/env bash
# finetune's few verbs. Each sets up .venv first if needed (about 45 s on a fresh machine).
#
#   ./run.sh demo [finetune args]   fine-tune the offline demo under DDP (2 CPU processes, or every GPU)
#   ./run.sh test [pytest args]     the whole test suite (CPU only, offline)
#   ./run.sh bench [perf.py args]   the benchmark table (bench/README.md); --only grid: issue 18, zero_memory: ZeRO
#   ./run.sh setup                  only create/refresh .venv
#
# Environment: FINETUNE_MEGATRON_LM: a Megatron-LM tree for the Megatron tests (default ../shared/vendor/megatron-lm-9a1c0d05
# when it exists). FINETUNE_TORCH overrides the torch requirement installed into a new .venv (default:
# torch==2.13.0, the CPU wheel, where no NVIDIA GPU is visible; the default CUDA build where one is).
# A .venv that already has a torch keeps it: a GPU build is never replaced.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.finetune-installed"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }

setup() {
  if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt setup.py ] && [ "$STAMP" -nt constraints.txt ]; then return; fi
  echo "[run.sh] setting up $VENV (once)"
  [ -x "$PY" ] || python3 -m venv "$VENV"
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if [ -n "${FINETUNE_TORCH:-}" ]; then spec="$FINETUNE_TORCH"; elif has_gpu; then spec="torch"; else spec="torch==2.13.0"; fi
    echo "[run.sh] installing $spec"
    "$PY" -m pip install -q "$spec" >"$VENV/install.log" 2>&1 || { cat "$VENV/install.log"; exit 1; }
  fi
  # The rest with uv: its resolver takes seconds where pip's takes a minute on 2 cores. uv keeps the torch
  # installed above, as pip does. --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (CI's
  # machines set it), a package installed without .pyc files is compiled from source by every process that
  # imports it: importing torch, transformers, accelerate, deepspeed, peft and datasets took 15 s instead of 6, in
  # every rank of every launch (CI: 2,279 s instead of ~1,450).
  { "$PY" -m pip install -q -c constraints.txt uv \
    && "$VENV/bin/uv" pip install -q --compile-bytecode --python "$PY" -c constraints.txt -e ".[deepspeed,peft,tensorboard,dev,bench]"
  } >"$VENV/install.log" 2>&1 || { cat "$VENV/install.log"; exit 1; }
  touch "$STAMP"
}

cmd="${1:-help}"
shift || true
case "$cmd" in
  setup)
    setup ;;
  demo)
    setup
    "$PY" -m finetune.demo prepare --dir demo
    nproc=2
    if has_gpu; then nproc=$(nvidia-smi -L | grep -c GPU); fi
    # The same Accelerate config runs on GPUs (nccl) and on CPU processes (gloo).
    "$VENV/bin/accelerate" launch --config_file accelerate_configs/ddp.yaml --num_processes "$nproc" \
      -m finetune --config examples/demo.yaml --overwrite_output_dir true "$@" ;;
  test)
    setup
    # Megatron-LM for the Megatron integration tests (docs/megatron.md); without it they skip and say so.
    vendored="$(cd .. && pwd)/shared/vendor/megatron-lm-9a1c0d05"
    if [ -z "${FINETUNE_MEGATRON_LM:-}" ] && [ -d "$vendored" ]; then export FINETUNE_MEGATRON_LM="$vendored"; fi
    # Two tests at a time (-n 2, pytest-xdist): most of a multi-process test is start-up and waiting, so two
    # side by side keep both cores busy. Every launch takes a free port, so they never share one.
    # finetune's own bytecode, once: where PYTHONDONTWRITEBYTECODE is set (CI's machines), every process of every
    # launch would compile its modules from source (85 ms per process, a few hundred processes per run).
    "$PY" -m compileall -q finetune >/dev/null
    "$PY" -m pytest -q -n 2 --dist loadgroup tests "$@" ;;
  bench)
    setup
    "$PY" bench/perf.py "$@" ;;
  *)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    [ "$cmd" = help ] || exit 2 ;;
esac
