"""Write the issue-24 speed benchmark task: a local lm-eval multiple-choice task with a shared 5-shot context.

    python scripts/eval_bench/make_task.py OUT_DIR [--items 500] [--seed 24] [--tokenizer MODEL_DIR]

Writes ``OUT_DIR/task/bench_mc5.yaml`` (``--include_path OUT_DIR/task --tasks bench_mc5``) with absolute paths to
``OUT_DIR/data/{train,test}.jsonl``. Every item is a short English passage about a person (town, work, pets, a
weekly visit, a box, a meal, a filler sentence), a question on one of its facts and 4 answer choices drawn from the
same category, the right one stated in the passage. ``fewshot_config.sampler: first_n`` puts the same 5 train items
in front of every test item, so all 4 x ITEMS loglikelihood requests share one 5-shot prefix. Items come from
``random.Random(seed)`` only (no hub). With ``--tokenizer`` it prints the token counts of the shared prefix and of
the requests.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = [
    "Mara",
    "Tobias",
    "Ines",
    "Felix",
    "Greta",
    "Hugo",
    "Lena",
    "Oskar",
    "Nora",
    "Pavel",
    "Rosa",
    "Silas",
    "Talia",
    "Viktor",
    "Wren",
    "Yusuf",
    "Alma",
    "Bruno",
]
TOWNS = [
    "Eldham",
    "Brackwater",
    "Fenmoor",
    "Hollin",
    "Kestrel",
    "Lowbridge",
    "Marrow",
    "Northby",
    "Oakhurst",
    "Pellow",
    "Quarry",
    "Rookley",
]
PLACES = [
    "a small bakery",
    "the old mill by the river",
    "the city library",
    "the harbour office",
    "a busy train station",
    "the village school",
    "a flower shop near the square",
    "the hospital on the hill",
]
OBJECTS = ["a brass key", "old letters", "a silver watch", "dried flowers", "a map of the coast", "spare buttons"]
COLORS = ["red", "blue", "green", "yellow", "wooden", "black"]
ANIMALS = ["cats", "dogs", "hens", "goats", "rabbits", "geese"]
COUNTS = ["two", "three", "four", "five", "six", "seven"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
MEALS = ["fish soup", "roast potatoes with beans", "a cheese pie", "rice with carrots", "apple cake", "lentil stew"]
FILLER = [
    "The streets there are narrow and paved with grey stone.",
    "In winter the wind comes down from the hills and the windows rattle at night.",
    "Most neighbours know each other by name and stop to talk in the mornings.",
    "A market fills the main square twice a month.",
    "The river floods every few years, so the older houses stand on stone steps.",
    "There is a bell tower that rings at noon, even though nobody remembers who winds it.",
    "Buses run only until seven in the evening.",
]


def _item(rng: random.Random) -> dict[str, object]:
    """One passage, question and 4 choices; ``label`` indexes the right choice."""
    name, town = rng.choice(NAMES), rng.choice(TOWNS)
    facts = {
        "place": rng.choice(PLACES),
        "object": rng.choice(OBJECTS),
        "count": rng.choice(COUNTS),
        "day": rng.choice(DAYS),
        "meal": rng.choice(MEALS),
    }
    animal, color, other = rng.choice(ANIMALS), rng.choice(COLORS), rng.choice(TOWNS)
    sentences = [
        f"{name} lives in the town of {town}.",
        rng.choice(FILLER),
        f"Every weekday {name} works at {facts['place']}.",
        f"At home {name} looks after {facts['count']} {animal}, which wake the whole street at dawn.",
        f"Each {facts['day']} {name} takes the early bus to {other} to visit a cousin.",
        f"Under the bed there is a {color} box where {name} keeps {facts['object']}.",
        f"Last night {name} cooked {facts['meal']} for dinner.",
    ]
    kind = rng.choice(sorted(facts))
    question, pool = {
        "place": (f"Where does {name} work?", PLACES),
        "object": (f"What does {name} keep in the {color} box?", OBJECTS),
        "count": (f"How many {animal} does {name} look after?", COUNTS),
        "day": (f"On which day does {name} visit {other}?", DAYS),
        "meal": (f"What did {name} cook for dinner last night?", MEALS),
    }[kind]
    choices = [facts[kind], *rng.sample([c for c in pool if c != facts[kind]], 3)]
    rng.shuffle(choices)
    label = choices.index(facts[kind])
    return {"passage": " ".join(sentences), "question": question, "choices": choices, "label": label}


TASK_YAML = """task: bench_mc5
dataset_path: json
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
fewshot_split: train
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{passage}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
num_fewshot: 5
fewshot_config:
  sampler: first_n
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def _text(doc: dict) -> str:
    """``doc_to_text`` of the YAML above, for counting tokens."""
    return f"{doc['passage']}\nQuestion: {doc['question']}\nAnswer:"


def write_task(out: Path, items: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Write the data files and the task YAML under ``out``; return (train, test) docs."""
    rng = random.Random(seed)
    train, test = [_item(rng) for _ in range(5)], [_item(rng) for _ in range(items)]
    (out / "data").mkdir(parents=True, exist_ok=True)
    (out / "task").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, docs in (("train", train), ("test", test)):
        paths[split] = (out / "data" / f"{split}.jsonl").resolve()
        paths[split].write_text("".join(json.dumps(d) + "\n" for d in docs))
    (out / "task" / "bench_mc5.yaml").write_text(TASK_YAML.format(**paths))
    return train, test


def count_tokens(tokenizer_dir: str, train: list[dict], test: list[dict]) -> dict[str, float]:
    """Token counts as lm-eval builds the requests: shots joined by a blank line, answer after a space."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prefix = "".join(f"{_text(d)} {d['choices'][d['label']]}\n\n" for d in train)
    full = [len(tok(prefix + _text(d) + " " + c).input_ids) for d in test for c in d["choices"]]
    return {
        "shared_prefix_tokens": len(tok(prefix).input_ids),
        "request_tokens_mean": round(sum(full) / len(full), 1),
        "request_tokens_min": min(full),
        "request_tokens_max": max(full),
        "requests": len(full),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--items", type=int, default=500)
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--tokenizer", help="model dir whose tokenizer counts the context tokens")
    args = ap.parse_args()
    train, test = write_task(args.out, args.items, args.seed)
    print(f"wrote {args.out / 'task' / 'bench_mc5.yaml'}: {len(test)} items, 5 shots")
    if args.tokenizer:
        print(json.dumps(count_tokens(args.tokenizer, train, test)))


if __name__ == "__main__":
    main()
