"""Seeded-sampling reproducibility trial (issue 22): how many rows of a seeded run change their tokens with the
batch they run in, or across an interruption and ``--resume``.

    python scripts/flip_rate.py --model DIR --dtype bfloat16 --work /tmp/flip [--rows 200] [--new-tokens 32]
        [--system-words 500]

Writes ``rows.jsonl`` (chat rows, no per-row seed: each gets one from ``--seed 7`` and its id), then runs ``batchgen
run`` with ``--max-running-requests 64`` and ``3``, and a third run at 64 stopped twice with SIGINT (``--interrupt-
after`` seconds after each wrote its first part) and finished with ``--resume``; prints how many rows differ from
the first run (token ids) and from which output position. Extra arguments after ``--`` go to every ``batchgen run``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.ipc as ipc

from batchgen.io.partial_output import partial_dir

TOPICS = ["rivers", "bread", "volcanoes", "chess", "owls", "trains", "glass", "tea", "bees", "comets"]
ASKS = ["Write two sentences about {}.", "Give a surprising fact about {}.", "Describe {} to a child.", "A poem on {}:"]


def _rows(count: int, system_words: int) -> list[dict[str, object]]:
    """``count`` chat rows; with ``system_words``, every second one behind one system message of that many words, so
    that the prefix cache serves it and decode rows share its K/V."""
    system = " ".join(TOPICS[(i * 7) % len(TOPICS)] for i in range(system_words))
    rows: list[dict[str, object]] = []
    for i in range(count):
        messages = [{"role": "user", "content": ASKS[i % 4].format(TOPICS[i // 4 % 10]) + f" ({i})"}]
        if system_words and i % 2 == 0:
            messages.insert(0, {"role": "system", "content": f"Notes: {system}. Answer briefly."})
        rows.append({"id": f"r{i}", "messages": messages})
    return rows


def _tokens(path: Path) -> dict[str, list[int]]:
    with ipc.open_file(path) as reader:
        table = reader.read_all()
    return dict(zip(table.column("id").to_pylist(), table.column("output_token_ids").to_pylist()))


def _parts(out: Path) -> int:
    folder = partial_dir(out)
    return sum(1 for _ in folder.glob("*.arrow")) if folder.is_dir() else 0


def _run(base: list[str], out: Path, batch: int, interrupts: int = 0, after: float = 0.0) -> None:
    """Run to the end; with ``interrupts``, first stop that many runs by SIGINT, each ``after`` seconds after it
    wrote its first part (``--flush-every 20``), each resuming the one before."""
    command = [*base, "--out", str(out), "--max-running-requests", str(batch), "--flush-every", "20"]
    for i in range(interrupts):
        before = _parts(out)
        proc = subprocess.Popen([*command, *(["--resume"] if i else [])])
        while _parts(out) == before and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(after)
        proc.send_signal(signal.SIGINT)
        proc.wait()
        # How far the stopped run got: a trial whose stops land after the last row proves nothing.
        status = subprocess.run([*base[:3], "status", base[4], str(out)], capture_output=True, text=True)
        print(f"after SIGINT: {status.stdout.strip() or status.stderr.strip()}", flush=True)
    subprocess.run([*command, *(["--resume"] if interrupts else [])], check=True)


def _compare(name: str, ref: dict[str, list[int]], other: dict[str, list[int]]) -> None:
    assert ref.keys() == other.keys(), f"{name}: not the same rows"
    firsts = []
    for key, tokens in ref.items():
        if tokens != other[key]:
            firsts.append(next((i for i, (a, b) in enumerate(zip(tokens, other[key])) if a != b), len(tokens)))
    print(f"{name}: {len(firsts)} of {len(ref)} rows differ; first differing positions {sorted(firsts)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=0, help="A shared system message for every second row.")
    parser.add_argument("--interrupt-after", type=float, default=2.0, help="Seconds from a first part to SIGINT.")
    args, extra = parser.parse_known_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = args.work / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in _rows(args.rows, args.system_words)))
    base = [sys.executable, "-m", "batchgen", "run", str(rows), "--model", args.model, "--dtype", args.dtype]
    base += ["--seed", "7", "--temperature", "1.0", "--max-new-tokens", str(args.new_tokens), "--overwrite"]
    base += ["--no-progress", *[a for a in extra if a != "--"]]
    outs = {name: args.work / f"{name}.arrow" for name in ("bs64", "bs3", "resumed")}
    for out in outs.values():
        out.unlink(missing_ok=True)
    _run(base, outs["bs64"], 64)
    _run(base, outs["bs3"], 3)
    _run([a for a in base if a != "--overwrite"], outs["resumed"], 64, 2, args.interrupt_after)
    ref = _tokens(outs["bs64"])
    _compare("--max-running-requests 3 vs 64", ref, _tokens(outs["bs3"]))
    _compare("interrupted twice + --resume vs uninterrupted", ref, _tokens(outs["resumed"]))


if __name__ == "__main__":
    main()
