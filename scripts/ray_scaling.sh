#!/usr/bin/env bash
# Throughput of `batchgen run --ray` with 1 and then 2 replicas of one core each, on the same prompts, one after the
# other (docs/scale-out.md). Prompts: W1's shapes (../shared/anchors/workloads.py: lengths uniform in [32, 256],
# 64 new tokens, greedy, EOS ignored) repeated to ROWS rows with fresh ids. Each run starts its own local Ray cluster
# of this machine's cores.
# Before each run, a job of 4 one-token rows with the same replicas times what the job's clock holds besides
# generating (Ray Data's start, the replicas' processes, imports and model load); the run's line then gives its
# output tok/s over the job's clock and over that clock less this start ("generating").
# Usage: scripts/ray_scaling.sh [ROWS] [MODEL] [DTYPE] [ORDER]   (ORDER: replica counts in turn, "1 2" by default;
# "1 2 2 1" measures each twice, A B B A, so that a drift of the machine's speed shows)
set -euo pipefail
rows="${1:-1024}"
model="${2:-random:llama-58m}"
dtype="${3:-bfloat16}"
order="${4:-1 2}"
command -v batchgen > /dev/null || { echo "ray_scaling.sh: batchgen is not on PATH (activate its environment)" >&2; exit 1; }
dir="$(mktemp -d)"
python - "$rows" "$dir/prompts.jsonl" "$dir/start.jsonl" <<'PY'
import json, random, sys

rows, out, start = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rng = random.Random(0)  # W1's rule: per prompt its length, then its tokens
with open(out, "w") as f:
    for i in range(rows):
        ids = [rng.randrange(3, 32000) for _ in range(rng.randint(32, 256))]
        f.write(json.dumps({"id": i, "prompt_token_ids": ids, "max_tokens": 64, "ignore_eos": True}) + "\n")
with open(start, "w") as f:
    for i in range(4):
        f.write(json.dumps({"id": i, "prompt_token_ids": [5, 6, 7], "max_tokens": 1, "ignore_eos": True}) + "\n")
PY
# The summary line's output tokens and seconds: "... + 32768 output tokens in 144.1 s, ..."
job() {
  batchgen run "$1" --out "$dir/out.arrow" --overwrite --model "$model" --dtype "$dtype" --temperature 0 \
    --no-progress --ray --replicas "$2" --cpus-per-replica 1 2>&1 | grep '^batchgen: [0-9]' | tee -a "$dir/lines" |
    sed -E 's/.* ([0-9]+) output tokens in ([0-9.]+) s.*/\1 \2/'
}
for replicas in $order; do
  read -r _ start_s < <(job "$dir/start.jsonl" "$replicas")
  t0=$(date +%s.%N)
  read -r tokens job_s < <(job "$dir/prompts.jsonl" "$replicas")
  python - "$replicas" "$tokens" "$job_s" "$start_s" "$t0" <<'PY'
import sys, time

replicas, tokens, job_s, start_s, t0 = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:])
print(f"replicas {replicas}: {tokens / job_s:.1f} output tok/s over the job's {job_s:.1f} s; start {start_s:.1f} s, "
      f"generating {tokens / (job_s - start_s):.1f} tok/s; whole command {time.time() - t0:.1f} s")
PY
done
rm -r "$dir"
