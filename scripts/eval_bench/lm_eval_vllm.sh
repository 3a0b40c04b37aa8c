#!/usr/bin/env bash
# lm_eval run inside the vLLM CPU venv that ../shared/anchors/vllm_cpu.sh builds, with the settings that script
# uses (tcmalloc and Intel's OpenMP preloaded, both cores bound to vLLM's OpenMP threads, 4 GiB KV cache): without
# them vLLM keeps a core for its engine process and runs ~1.6x slower. Arguments go to lm-eval's CLI.
# lm-eval checks `importlib.metadata.version("vllm")`, but PyPI's CPU build is installed as the `vllm-cpu`
# distribution (same `vllm` module): that lookup is answered as vLLM's own platform check does, "<vllm-cpu>+cpu"
# (a bare version would make vLLM look for a GPU).
# Once: run vllm_cpu.sh on any prompts file, then `$venv/bin/pip install lm-eval==0.4.13`.
set -euo pipefail
venv="${XDG_CACHE_HOME:-$HOME/.cache}/batchgen-anchors/vllm-venv"
find='import importlib.util as u, sys; sys.exit(not (u.find_spec("vllm") and u.find_spec("lm_eval")))'
if ! "$venv/bin/python" -c "$find" >/dev/null 2>&1; then
  echo "lm_eval_vllm.sh: $venv lacks vllm or lm_eval (build it with vllm_cpu.sh, then pip install lm-eval==0.4.13)" >&2
  exit 2
fi
tcmalloc="$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')"
iomp="$(ls "$venv"/lib/libiomp5.so 2>/dev/null || true)"
preload="$tcmalloc"
[ -n "$iomp" ] && preload="${preload:+$preload:}$iomp"
export LD_PRELOAD="$preload"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}"
exec "$venv/bin/python" -c '
import importlib.metadata as md
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
sys.argv[0] = "lm_eval"
from lm_eval.__main__ import cli_evaluate

cli_evaluate()
' "$@"
