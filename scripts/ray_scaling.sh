#!/usr/bin/env bash
# Throughput of `batchgen run --ray` with 1 and then 2 replicas of one core each, on the same prompts, one after the
# other (docs/scale-out.md). Prompts: W1's shapes (../shared/anchors/workloads.py: lengths uniform in [32, 256],
# 64 new tokens, greedy, EOS ignored) repeated to ROWS rows with fresh ids. Each run starts its own local Ray cluster
# of this machine's cores.
# Before each run, a job of 4 one-token rows with the same replicas times what the job's clock holds besides
# generating (Ray Data's start, the replicas' processes, imports and model load); the run's line then gives its
# output tok/s over the job's clock and over that clock less this start ("generating"); what comes before the
# job's clock (joining or starting the cluster, the engine's facts loaded in a task) is in neither.
# Usage: scripts/ray_scaling.sh [ROWS] [MODEL] [DTYPE] [ORDER]   (ORDER: replica counts in turn, "1 2" by default;
# "1 2 2 1" measures each twice, A B B A, so that a drift of the machine's speed shows)
set -euo pipefail
rows="${1:-1024}"
model="${2:-random:llama-58m}"
dtype="${3:-bfloat16}"
order="${4:-1 2}"
command -v batchgen > /dev/null || { echo "ray_scaling.sh: batchgen is not on PATH (activate its environment)" >&2; exit 1; }
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
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
# Runs one job; prints its summary line's output tokens and seconds ("... + 32768 output tokens in 144.1 s, ...").
job() {
  if ! batchgen run "$1" --out "$dir/out.arrow" --overwrite --model "$model" --dtype "$dtype" --temperature 0 \
    --no-progress --ray --replicas "$2" --cpus-per-replica 1 > "$dir/log" 2>&1; then
    echo "ray_scaling.sh: batchgen run of $(basename "$1") with $2 replicas failed:" >&2
    tail -n 20 "$dir/log" >&2
    return 1
  fi
  # The summary line to stderr too (echo, not tee /dev/stderr: tee would reopen, and so truncate, a log file that
  # stderr is redirected to).
  local summary
  summary=$(grep '^batchgen: [0-9]' "$dir/log")
  echo "$summary" >&2
  sed -nE 's/.* ([0-9]+) output tokens in ([0-9.]+) s.*/\1 \2/p' <<< "$summary"
}
for replicas in $order; do
  start_line=$(job "$dir/start.jsonl" "$replicas")
  t0=$(date +%s.%N)
  line=$(job "$dir/prompts.jsonl" "$replicas")
  python - "$replicas" "$line" "$start_line" "$t0" <<'PY'
import sys, time

replicas, line, start_line, t0 = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), float(sys.argv[4])
if len(line) != 2 or len(start_line) != 2:
    sys.exit("ray_scaling.sh: no summary line with output tokens and seconds from batchgen")
tokens, job_s, start_s = int(line[0]), float(line[1]), float(start_line[1])
if job_s <= start_s:
    sys.exit(f"ray_scaling.sh: the job ({job_s} s) took no longer than its start ({start_s} s): use more ROWS")
print(f"replicas {replicas}: {tokens / job_s:.1f} output tok/s over the job's {job_s:.1f} s; start {start_s:.1f} s, "
      f"generating {tokens / (job_s - start_s):.1f} tok/s; whole command {time.time() - t0:.1f} s")
PY
done
