"""Issue 24's speed benchmark: wall time of `lm_eval` on the bench_mc5 task, per backend, in one sitting.

    python scripts/eval_bench/run.py --model DIR --out OUT [--limit N] [--backends hf-bf16,vllm-pc,batchgen]

Writes the task (make_task.py, 500 items, shared 5-shot prefix) under OUT, then runs each backend one after the
other as its own process: ``hf-*`` and ``batchgen`` with this Python (``batchgen`` is skipped when ``batchgen.eval``
does not import), ``vllm*`` through lm_eval_vllm.sh in the vLLM CPU venv. Each run's log and lm-eval output go to
OUT/runs/NAME*; one JSON line per run is appended to OUT/results.jsonl and printed: wall seconds of the whole process
(load + start-up + scoring), seconds of lm-eval's "Running loglikelihood requests" bar (scoring only), acc, acc_norm.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from make_task import write_task

HERE = Path(__file__).resolve().parent
# vLLM's lm-eval backend sends everything to one generate call only with batch_size auto (the CLI default is 1).
BACKENDS = {
    "hf-bf16": ([sys.executable, "-m", "lm_eval"], "hf", "dtype=bfloat16", None),
    "hf-fp32": ([sys.executable, "-m", "lm_eval"], "hf", "dtype=float32", None),
    "vllm-pc": ([str(HERE / "lm_eval_vllm.sh")], "vllm", "dtype=bfloat16,enable_prefix_caching=True", "auto"),
    "vllm": ([str(HERE / "lm_eval_vllm.sh")], "vllm", "dtype=bfloat16,enable_prefix_caching=False", "auto"),
    "batchgen": ([sys.executable, "-m", "batchgen.eval"], "batchgen", "dtype=bfloat16", "auto"),
}
BAR = re.compile(r"Running loglikelihood requests: 100%\|[^|]*\|\s*(\d+)/\1 \[([\d:]+)<")


def _seconds(clock: str) -> int:
    """tqdm's elapsed ``[H:]MM:SS`` in seconds."""
    total = 0
    for part in clock.split(":"):
        total = total * 60 + int(part)
    return total


def run_backend(name: str, model: str, out: Path, limit: int | None, hf_batch_size: str) -> dict[str, object]:
    """Run one backend on bench_mc5; return its result row (``error`` set when lm_eval failed)."""
    prefix, model_type, args, batch_size = BACKENDS[name]
    cmd = [*prefix, "--model", model_type, "--model_args", f"pretrained={model},{args}"]
    cmd += ["--include_path", str(out / "task"), "--tasks", "bench_mc5", "--output_path", str(out / "runs" / name)]
    cmd += ["--batch_size", batch_size or hf_batch_size] + (["--limit", str(limit)] if limit else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = out / "runs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=HERE.parents[1]).returncode
    row: dict[str, object] = {"backend": name, "limit": limit, "wall_s": round(time.perf_counter() - start, 1)}
    if model_type == "hf":
        row["batch_size"] = hf_batch_size
    text = log.read_text(errors="replace")
    bars = BAR.findall(text)
    row["scoring_s"] = _seconds(bars[-1][1]) if bars else None
    results = sorted((out / "runs" / name).rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if code != 0 or not results:
        return {**row, "error": f"exit {code}, see {log}"}
    metrics = json.loads(results[-1].read_text())["results"]["bench_mc5"]
    return {**row, "acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct HF dir")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--items", type=int, default=500)
    ap.add_argument("--limit", type=int, help="score only the first N items (trial runs)")
    ap.add_argument("--backends", default="hf-bf16,vllm-pc,batchgen", help=f"comma list of {', '.join(BACKENDS)}")
    ap.add_argument("--hf-batch-size", default="8")
    args = ap.parse_args()
    names = args.backends.split(",")
    if unknown := set(names) - set(BACKENDS):
        sys.exit(f"--backends: unknown {', '.join(sorted(unknown))}; choose from {', '.join(BACKENDS)}")
    write_task(args.out, args.items, seed=24)
    for name in names:
        probe = [sys.executable, "-c", "import batchgen.eval"]
        if name == "batchgen" and subprocess.run(probe, cwd=HERE.parents[1], capture_output=True).returncode != 0:
            print("[batchgen] skipped: `import batchgen.eval` fails", flush=True)
            continue
        row = run_backend(name, str(Path(args.model).resolve()), args.out, args.limit, args.hf_batch_size)
        print(json.dumps(row), flush=True)
        with (args.out / "results.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
