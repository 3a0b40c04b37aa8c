#!/usr/bin/env bash
# Throughput of `batchgen run --ray` with 1 and then 2 replicas of one core each, on the same prompts, one after the
# other (docs/scale-out.md). Prompts: W1's shapes (../shared/anchors/workloads.py: lengths uniform in [32, 256],
# 64 new tokens, greedy, EOS ignored) repeated to ROWS rows with fresh ids, so that model loading is a small share.
# Each run starts its own local Ray cluster of this machine's cores.
# Usage: scripts/ray_scaling.sh [ROWS] [MODEL] [DTYPE] [ORDER]   (ORDER: replica counts in turn, "1 2" by default;
# "1 2 2 1" measures each twice, A B B A, so that a drift of the machine's speed shows)
set -euo pipefail
rows="${1:-1024}"
model="${2:-random:llama-58m}"
dtype="${3:-bfloat16}"
order="${4:-1 2}"
dir="$(mktemp -d)"
python - "$rows" "$dir/prompts.jsonl" <<'PY'
import json, random, sys

rows, out = int(sys.argv[1]), sys.argv[2]
rng = random.Random(0)  # W1's rule: per prompt its length, then its tokens
with open(out, "w") as f:
    for i in range(rows):
        ids = [rng.randrange(3, 32000) for _ in range(rng.randint(32, 256))]
        f.write(json.dumps({"id": i, "prompt_token_ids": ids, "max_tokens": 64, "ignore_eos": True}) + "\n")
PY
for replicas in $order; do
  start=$(date +%s.%N)
  batchgen run "$dir/prompts.jsonl" --out "$dir/out$replicas.arrow" --overwrite --model "$model" --dtype "$dtype" \
    --temperature 0 --no-progress --ray --replicas "$replicas" --cpus-per-replica 1 2>&1 | grep '^batchgen: [0-9]'
  echo "replicas $replicas: wall $(python -c "import time; print(f'{time.time() - $start:.1f}')") s"
done
rm -r "$dir"
