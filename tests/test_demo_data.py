"""The demo model's data: tasks, splits, corpus, tokenizer and the training script's smoke run."""

import datetime
import json
import re
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
from script_modules import load_script

from lowvram.demo import corpus, tasks
from lowvram.demo.tokenizer import ASSISTANT, BOS, EOS, USER, save_tokenizer, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
demo_tasks = load_script("demo_tasks")
demo_corpus = load_script("demo_corpus")
NUM_TRAINING_SAMPLES = 20_000

# 2024-01-01 was a Monday: datetime does the weekday arithmetic independently of tasks.py.
MONDAY = datetime.date(2024, 1, 1)
CONVERSION_FACTORS = {
    ("kilometers", "meters"): 1000,
    ("meters", "centimeters"): 100,
    ("centimeters", "millimeters"): 10,
    ("kilograms", "grams"): 1000,
    ("liters", "milliliters"): 1000,
    ("hours", "minutes"): 60,
    ("minutes", "seconds"): 60,
    ("weeks", "days"): 7,
    ("yards", "feet"): 3,
}
PLURALS = {"foot": "feet"}


def _plural(unit: str) -> str:
    return PLURALS.get(unit, unit if unit.endswith("s") else unit + "s")


def _expected_answer(task: tasks.Task) -> str:
    """The answer recomputed from the question's text alone."""
    question = task.messages[-1]["content"]
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if task.kind == "add":
        return str(numbers[0] + numbers[1])
    if task.kind == "sub":
        return str(numbers[0] - numbers[1]) if "Subtract" not in question else str(numbers[1] - numbers[0])
    if task.kind == "convert":
        match = re.search(
            r"(\d+) ([a-z]+)\b.*?\b(kilometers|meters|centimeters|millimeters|kilograms|grams|liters|"
            r"milliliters|hours|minutes|seconds|weeks|days|yards|feet)\b",
            question,
        )
        if question.startswith("How many"):
            match = re.search(r"How many ([a-z]+) are in (\d+) ([a-z]+)", question)
            to_unit, value, from_unit = match.group(1), int(match.group(2)), _plural(match.group(3))
        else:
            value, from_unit, to_unit = int(match.group(1)), _plural(match.group(2)), match.group(3)
        if (from_unit, to_unit) in CONVERSION_FACTORS:
            return str(value * CONVERSION_FACTORS[(from_unit, to_unit)])
        factor = CONVERSION_FACTORS[(to_unit, from_unit)]
        assert value % factor == 0, question
        return str(value // factor)
    if task.kind == "weekday":
        names = [MONDAY + datetime.timedelta(days=i) for i in range(7)]
        start = next(d for d in names if d.strftime("%A") in question)
        weeks = re.search(r"(\d+) weeks?\b", question)
        days = re.search(r"(\d+) days?\b", question)
        span = datetime.timedelta(weeks=int(weeks.group(1)) if weeks else 0, days=int(days.group(1)) if days else 0)
        is_backward = "before" in question or "ago" in question
        return (start - span if is_backward else start + span).strftime("%A")
    if task.kind == "sort":
        items = [item.strip() for item in question.split(":", 1)[1].split(",")]
        if items[0].isdigit():
            is_descending = "largest to smallest" in question or "descending" in question
            return ", ".join(str(n) for n in sorted(map(int, items), reverse=is_descending))
        return ", ".join(sorted(items))
    if task.kind == "count":
        quoted = re.findall(r'"([a-z]+)"', question)
        letter, word = quoted[::-1] if question.startswith("In the word") else quoted
        return str(sum(1 for c in word if c == letter))
    if task.kind == "extreme":
        is_largest = "largest" in question or "maximum" in question
        return str(max(numbers) if is_largest else min(numbers))
    if task.kind == "sequence":
        step = numbers[1] - numbers[0]
        assert all(b - a == step for a, b in zip(numbers, numbers[1:])), question
        return str(numbers[-1] + step)
    raise AssertionError(f"unknown kind {task.kind}")


@pytest.fixture(scope="module")
def training_sample():
    return list(islice(demo_tasks.training_tasks(seed=7), NUM_TRAINING_SAMPLES))


def test_heldout_split_is_fixed_and_balanced():
    first, second = tasks.heldout_tasks(), tasks.heldout_tasks()
    assert [(t.key, t.messages, t.answer) for t in first] == [(t.key, t.messages, t.answer) for t in second]
    assert len(first) == tasks.HELDOUT_PER_KIND * len(demo_tasks.KINDS)
    assert len({t.key for t in first}) == len(first)
    # A smaller held-out set is a prefix of each kind's fixed list.
    expected_prefix = [t.key for kind in demo_tasks.KINDS for t in [t for t in first if t.kind == kind][:5]]
    assert [t.key for t in tasks.heldout_tasks(5)] == expected_prefix
    with pytest.raises(ValueError):
        tasks.heldout_tasks(tasks.HELDOUT_PER_KIND + 1)


def test_shipped_heldout_tasks_are_the_generated_ones():
    shipped = [(t.kind, t.messages, t.answer, t.key) for t in tasks.heldout_tasks()]
    assert shipped == [(t.kind, t.messages, t.answer, t.key) for t in demo_tasks.build_heldout_tasks()]


def test_training_stream_is_reproducible_and_seeded():
    first = [(t.key, t.messages[0]["content"]) for t in islice(demo_tasks.training_tasks(seed=3), 500)]
    again = [(t.key, t.messages[0]["content"]) for t in islice(demo_tasks.training_tasks(seed=3), 500)]
    other = [(t.key, t.messages[0]["content"]) for t in islice(demo_tasks.training_tasks(seed=4), 500)]
    assert first == again
    assert first != other


def test_heldout_never_appears_in_training(training_sample):
    heldout = tasks.heldout_tasks()
    heldout_keys = {t.key for t in heldout}
    heldout_questions = {t.messages[-1]["content"] for t in heldout}
    assert not heldout_keys & {t.key for t in training_sample}
    assert not heldout_questions & {t.messages[-1]["content"] for t in training_sample}
    assert {t.kind for t in training_sample} == set(demo_tasks.KINDS)


def test_answers_match_an_independent_computation(training_sample):
    for task in tasks.heldout_tasks() + training_sample[:5000]:
        assert task.answer == _expected_answer(task), task


def test_is_correct_is_exact_match_after_strip():
    task = tasks.heldout_tasks(1)[0]
    assert tasks.is_correct(task, f"  {task.answer}\n")
    assert not tasks.is_correct(task, task.answer + "0")
    assert not tasks.is_correct(task, f"The answer is {task.answer}")


@pytest.fixture(scope="module")
def train_script():
    """scripts/train_demo_model.py as a module (it imports its sibling scripts/demo_corpus.py)."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import train_demo_model
    finally:
        sys.path.pop(0)
    return train_demo_model


def test_corpus_split_is_by_file_and_heldout_is_shipped():
    assert not set(demo_corpus.HELDOUT_FILES) & set(demo_corpus.TRAINING_FILES)
    assert corpus.HELDOUT_PATH.is_file()
    heldout = corpus.heldout_text()
    assert 100_000 < len(heldout.encode("utf-8")) <= 200_000
    assert corpus.heldout_text(max_chars=1000) == heldout[:1000]
    # The held-out files are byte-identical across CPython 3.10-3.13, so the shipped copy
    # is what this interpreter's standard library holds (where its sources are installed).
    if (demo_corpus.stdlib_dir() / "difflib.py").is_file():
        assert demo_corpus.build_heldout_text() == heldout


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory, train_script):
    texts = [demo_corpus.training_text()[:200_000]] + [
        train_script.format_chat(t.messages + [{"role": "assistant", "content": t.answer}])
        for t in islice(demo_tasks.training_tasks(0), 2000)
    ]
    tokenizer = train_tokenizer(texts, vocab_size=512)
    out_dir = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(tokenizer, out_dir, max_length=2048)
    return tokenizer, out_dir


def test_tokenizer_round_trips_and_splits_digits(small_tokenizer):
    tokenizer, _ = small_tokenizer
    text = "def área(x):\n    return x * 5312  # ✓ done\n"
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == tokenizer.token_to_id(BOS)
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == text
    digit_tokens = [tokenizer.id_to_token(i) for i in tokenizer.encode("5312", add_special_tokens=False).ids]
    assert digit_tokens == ["5", "3", "1", "2"]
    for special in (BOS, EOS, USER, ASSISTANT):
        assert len(tokenizer.encode(special, add_special_tokens=False).ids) == 1


def test_chat_template_matches_the_training_format(small_tokenizer, train_script):
    from transformers import AutoTokenizer

    tokenizer, out_dir = small_tokenizer
    hf_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert (hf_tokenizer.bos_token, hf_tokenizer.eos_token) == (BOS, EOS)
    messages = [
        {"role": "system", "content": "Answer with the result only."},
        {"role": "user", "content": "What is 123 + 45?"},
        {"role": "assistant", "content": "168"},
        {"role": "user", "content": "Sort these words alphabetically: pear, apple"},
    ]
    rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        f"{BOS}Answer with the result only.{USER}What is 123 + 45?{ASSISTANT}168{EOS}"
        f"{USER}Sort these words alphabetically: pear, apple{ASSISTANT}"
    )
    assert rendered == train_script.format_chat(messages, add_generation_prompt=True)
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert list(ids) == tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == hf_tokenizer.bos_token_id and ids[-1] == tokenizer.token_to_id(ASSISTANT)


def test_training_pieces_tokenize_like_the_whole_conversation(small_tokenizer, train_script):
    tokenizer, _ = small_tokenizer
    turns = list(islice(demo_tasks.training_tasks(1), 3))
    pieces = train_script.conversation_pieces(turns, "You are a helpful assistant.")
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for task in turns:
        messages += task.messages + [{"role": "assistant", "content": task.answer}]
    whole = tokenizer.encode(train_script.format_chat(messages), add_special_tokens=False).ids
    [(ids, trained)] = train_script.encode_pieces(tokenizer, [pieces])
    assert ids == whole
    # Only answer tokens and the EOS after each answer are trained on.
    trained_text = tokenizer.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False)
    assert trained_text == "".join(task.answer + EOS for task in turns)


def test_packed_rows_compute_what_separate_sequences_do(train_script):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sequences = [
        ([0, 5, 6, 7, 2], [False, False, False, True, True]),
        ([0, 8, 9], [False, True, True]),
        ([0, 10, 11, 12], [False, False, True, True]),
    ]
    packed = train_script.pack_rows(iter(sequences), num_rows=2, row_len=8, pad_id=1)
    ignore = train_script.IGNORE_INDEX
    assert packed["input_ids"].tolist() == [[0, 5, 6, 7, 2, 0, 8, 9], [0, 10, 11, 12, 1, 1, 1, 1]]
    assert packed["targets"].tolist() == [
        [ignore, ignore, 7, 2, ignore, 8, 9, ignore],
        [ignore, 11, 12, ignore, ignore, ignore, ignore, ignore],
    ]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert (packed["num_tokens"], packed["num_trained"]) == (12, 6)

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = Qwen2ForCausalLM(config).eval()
    mask = train_script.block_causal_mask(packed["segment_ids"])
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], attention_mask=mask).logits
        alone = model(input_ids=torch.tensor([[0, 8, 9]])).logits
    torch.testing.assert_close(logits[0, 5:8], alone[0], atol=1e-5, rtol=1e-5)


def test_training_script_smoke_run_on_cpu(tmp_path):
    out_dir = tmp_path / "model"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "train_demo_model.py"),
            "--device",
            "cpu",
            "--steps",
            "3",
            "--tiny",
            "--out-dir",
            str(out_dir),
            "--bench-json",
            str(tmp_path / "bench.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "README.md",
    ):
        assert (out_dir / name).is_file(), name
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["torch_dtype"] == config["dtype"] == "float16"
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["steps"] == 3
    assert set(record["accuracy"]) == set(demo_tasks.KINDS)
    assert record["heldout_ppl"] > 1.0


def test_bundled_demo_model_answers_heldout_tasks():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowvram.demo import demo_model_path

    model_dir = demo_model_path()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["dtype"] == "float16"
    assert (model_dir / "model.safetensors").stat().st_size <= 15 * 2**20
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    heldout = tasks.heldout_tasks(2)
    prompts = [tokenizer.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=False) for t in heldout]
    batch = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    assert tokenizer.padding_side == "left"
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    replies = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    num_correct = sum(tasks.is_correct(task, reply) for task, reply in zip(heldout, replies))
    assert num_correct >= len(heldout) - 1, list(zip([t.answer for t in heldout], replies))
