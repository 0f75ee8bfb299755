"""Rebuild the shipped calibration corpus, lowvram/data/calibration.jsonl.

Python excerpts from the standard library files the demo model trains on (never its held-out
ones) and multi-turn conversations of the demo's synthetic training tasks, shuffled; see
`lowvram.quant.calibration`.
"""

import json
import random
from itertools import islice

from lowvram.quant.calibration import CALIBRATION_PATH

CORPUS_SEED = 20250301
NUM_PYTHON_EXCERPTS = 64
PYTHON_EXCERPT_CHARS = 2800
NUM_CONVERSATIONS = 160
TURNS_PER_CONVERSATION = 6


def build_calibration_corpus() -> list[dict]:
    """The shipped corpus, rebuilt: Python excerpts and multi-turn task conversations, shuffled."""
    import demo_corpus as corpus
    import demo_tasks as tasks

    rng = random.Random(CORPUS_SEED)
    root = corpus.stdlib_dir()
    available = [name for name in corpus.TRAINING_FILES if (root / name).is_file()]
    if not available:
        raise FileNotFoundError(f"no standard-library sources under {root}; the corpus needs them")
    records = []
    for name in rng.sample(available, min(NUM_PYTHON_EXCERPTS, len(available))):
        source = (root / name).read_text(encoding="utf-8")
        start = rng.randrange(max(1, len(source) - PYTHON_EXCERPT_CHARS))
        start = source.rfind("\n", 0, start) + 1  # whole lines only
        records.append({"text": source[start : start + PYTHON_EXCERPT_CHARS].rsplit("\n", 1)[0] + "\n"})
    stream = tasks.training_tasks(seed=CORPUS_SEED)
    for _ in range(NUM_CONVERSATIONS):
        messages = []
        for task in islice(stream, TURNS_PER_CONVERSATION):
            messages += [*task.messages, {"role": "assistant", "content": task.answer}]
        records.append({"messages": messages})
    rng.shuffle(records)
    return records


if __name__ == "__main__":
    CALIBRATION_PATH.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(record, ensure_ascii=False) for record in build_calibration_corpus()]
    CALIBRATION_PATH.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {CALIBRATION_PATH} ({CALIBRATION_PATH.stat().st_size} bytes, {len(lines)} records)")
