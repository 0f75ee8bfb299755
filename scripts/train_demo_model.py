"""Train the bundled demo model: a few-million-parameter Qwen2ForCausalLM in R1-Distill-Qwen's layout.

The mix, per step: rows of synthetic chat conversations (loss on the assistant's
answer tokens and the EOS that ends them) and rows of Python source (loss on every
token), in one forward pass. Conversations are packed several to a row; a
block-diagonal causal mask and positions that restart at each conversation make a
packed row compute exactly what separate sequences would. One pass per step matters:
a model this small is bound by per-step host overhead, not by the GPU. At the end the FP16 checkpoint is saved, loaded back from disk the
way a user would load it, and measured: greedy exact-match accuracy on the held-out
tasks, per kind, and perplexity on held-out Python.

    python scripts/train_demo_model.py --out-dir lowvram/demo_model          # CUDA, 7 minutes
    python scripts/train_demo_model.py --device cpu --steps 3 --tiny         # smoke run, temp dir

Training stops --max-minutes after the script starts; the final save and evaluation
add about half a minute on a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import demo_corpus
import demo_tasks
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from lowvram.demo import corpus, tasks
from lowvram.demo.tokenizer import ASSISTANT, BOS, EOS, USER, save_tokenizer, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
IGNORE_INDEX = -100
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer with the result only.",
    "You are a concise assistant. Reply with just the answer.",
)
NUM_TOKENIZER_TASKS = 50_000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batches, for a CPU smoke run")
    parser.add_argument(
        "--steps", type=int, default=None, help="stop after this many steps (default: only the time budget)"
    )
    parser.add_argument("--max-minutes", type=float, default=7.0, help="wall budget from start to the end of training")
    parser.add_argument(
        "--out-dir",
        default=None,
        help="checkpoint directory (default: a temp dir with --tiny, else lowvram/demo_model)",
    )
    parser.add_argument(
        "--bench-json",
        default=None,
        help="results JSON (default: docs/bench/train_demo_<date>.json; with --tiny, inside --out-dir)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument("--task-rows", type=int, default=64, help="rows of packed conversations per step")
    parser.add_argument("--text-rows", type=int, default=4, help="rows of Python source per step")
    parser.add_argument("--row-len", type=int, default=512, help="tokens per row; also the perplexity's window")
    parser.add_argument(
        "--text-weight", type=float, default=1.0, help="weight of the Python loss against the task loss"
    )
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--multi-turn-prob", type=float, default=0.2)
    parser.add_argument("--system-prob", type=float, default=0.15)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--eval-every-s", type=float, default=60.0)
    parser.add_argument("--heldout-per-kind", type=int, default=tasks.HELDOUT_PER_KIND)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    if args.tiny:
        args.num_layers, args.hidden_size, args.intermediate_size = 2, 64, 128
        args.num_heads, args.num_kv_heads, args.vocab_size = 2, 1, 512
        args.task_rows, args.text_rows, args.row_len = 2, 1, 64
        args.num_workers, args.warmup_steps, args.heldout_per_kind, args.max_new_tokens = 0, 1, 2, 8
    if args.out_dir is None:
        args.out_dir = (
            tempfile.mkdtemp(prefix="demo_model_") if args.tiny else str(REPO_ROOT / "lowvram" / "demo_model")
        )
    if args.bench_json is None:
        date = datetime.date.today().isoformat()
        bench_dir = Path(args.out_dir) if args.tiny else REPO_ROOT / "docs" / "bench"
        args.bench_json = str(bench_dir / f"train_demo_{date}.json")
    return args


# ---------------------------------------------------------------- data


def format_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The text CHAT_TEMPLATE renders, built in plain Python for the training loop and the tests."""
    parts = [BOS]
    parts += [m["content"] for m in messages if m["role"] == "system"]
    for message in messages:
        if message["role"] == "user":
            parts.append(USER + message["content"])
        elif message["role"] == "assistant":
            parts.append(ASSISTANT + message["content"].split("</think>")[-1] + EOS)
        elif message["role"] != "system":
            raise ValueError(f"unsupported chat role: {message['role']!r}")
    if add_generation_prompt:
        parts.append(ASSISTANT)
    return "".join(parts)


def tokenizer_texts(text: str, is_tiny: bool):
    """The tokenizer's training mix: Python source in 4 KB pieces, then rendered conversations."""
    num_tasks = 2_000 if is_tiny else NUM_TOKENIZER_TASKS
    for start in range(0, len(text), 4096):
        yield text[start : start + 4096]
    for task in islice(demo_tasks.training_tasks(seed=-1), num_tasks):
        yield format_chat(task.messages + [{"role": "assistant", "content": task.answer}])


def conversation_pieces(turns: list[tasks.Task], system_prompt: str | None) -> list[tuple[str, bool]]:
    """The rendered conversation cut at special tokens into (text, is_trained) pieces.

    Every cut falls right after a special token, so tokenizing the pieces one by one
    gives the same ids as tokenizing `format_chat` of the whole conversation.
    """
    head = BOS + (system_prompt or "")
    pieces = []
    for task in turns:
        pieces.append((head + USER + task.messages[-1]["content"] + ASSISTANT, False))
        pieces.append((task.answer + EOS, True))
        head = ""
    return pieces


def encode_conversations(tokenizer: Tokenizer, conversations: list[list[tuple[str, bool]]], pad_id: int):
    """One conversation per row, right-padded: inputs [B, L], next-token targets [B, L], real token count."""
    sequences = encode_pieces(tokenizer, conversations)
    max_len = (max(len(ids) for ids, _ in sequences) + 7) // 8 * 8
    inputs = torch.full((len(sequences), max_len), pad_id, dtype=torch.long)
    targets = torch.full((len(sequences), max_len), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, trained) in enumerate(sequences):
        inputs[row, : len(ids)] = torch.tensor(ids)
        # targets[t] is the token at t + 1, kept only where that token is part of an answer
        next_ids = torch.tensor(ids[1:], dtype=torch.long)
        is_next_trained = torch.tensor(trained[1:], dtype=torch.bool)
        targets[row, : len(ids) - 1] = torch.where(is_next_trained, next_ids, IGNORE_INDEX)
    return inputs, targets, sum(len(ids) for ids, _ in sequences)


def pack_rows(sequences, num_rows: int, row_len: int, pad_id: int) -> dict:
    """Pack (ids, is_trained) sequences into rows, in order, a sequence never split across rows.

    Returns input_ids, targets (IGNORE_INDEX outside answers and across sequence ends),
    position_ids (restarting at 0 for each sequence) and segment_ids (-1 on padding),
    all [num_rows, row_len], plus the counts of real and of trained tokens.
    """
    rows = [[] for _ in range(num_rows)]
    row = num_used = 0
    for ids, trained in sequences:
        if len(ids) > row_len:
            continue
        if num_used + len(ids) > row_len:
            row, num_used = row + 1, 0
            if row == num_rows:
                break
        rows[row].append((ids, trained))
        num_used += len(ids)
    input_ids, targets, positions, segments = [], [], [], []
    num_tokens = num_trained = 0
    for packed in rows:
        row_ids, row_targets, row_positions, row_segments = [], [], [], []
        for segment, (ids, trained) in enumerate(packed):
            row_ids += ids
            row_targets += [
                next_id if is_trained else IGNORE_INDEX for next_id, is_trained in zip(ids[1:], trained[1:])
            ]
            row_targets.append(IGNORE_INDEX)  # the next row token belongs to another sequence
            row_positions += range(len(ids))
            row_segments += [segment] * len(ids)
            num_trained += sum(trained[1:])
        num_tokens += len(row_ids)
        num_pad = row_len - len(row_ids)
        input_ids.append(row_ids + [pad_id] * num_pad)
        targets.append(row_targets + [IGNORE_INDEX] * num_pad)
        positions.append(row_positions + [0] * num_pad)
        segments.append(row_segments + [-1] * num_pad)
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "targets": torch.tensor(targets, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
        "segment_ids": torch.tensor(segments, dtype=torch.int32),
        "num_tokens": num_tokens,
        "num_trained": num_trained,
    }


def encode_pieces(
    tokenizer: Tokenizer, conversations: list[list[tuple[str, bool]]]
) -> list[tuple[list[int], list[bool]]]:
    """Each conversation's token ids and, per token, whether it is trained on."""
    flat = [text for pieces in conversations for text, _ in pieces]
    encoded = iter(tokenizer.encode_batch(flat, add_special_tokens=False))
    sequences = []
    for pieces in conversations:
        ids, trained = [], []
        for _, is_trained in pieces:
            piece_ids = next(encoded).ids
            ids += piece_ids
            trained += [is_trained] * len(piece_ids)
        sequences.append((ids, trained))
    return sequences


class TaskRows(torch.utils.data.IterableDataset):
    """Endless steps' worth of packed training conversations; each loader worker draws its own stream."""

    def __init__(
        self,
        tokenizer_json: str,
        seed: int,
        num_rows: int,
        row_len: int,
        multi_turn_prob: float,
        system_prob: float,
        pad_id: int,
    ):
        self.tokenizer_json = tokenizer_json
        self.seed, self.num_rows, self.row_len = seed, num_rows, row_len
        self.multi_turn_prob, self.system_prob = multi_turn_prob, system_prob
        self.pad_id = pad_id

    def _conversations(self, tokenizer: Tokenizer, stream, rng: random.Random, chunk_size: int = 64):
        while True:
            conversations = []
            for _ in range(chunk_size):
                num_turns = rng.randint(2, 3) if rng.random() < self.multi_turn_prob else 1
                system_prompt = rng.choice(SYSTEM_PROMPTS) if rng.random() < self.system_prob else None
                conversations.append(conversation_pieces(list(islice(stream, num_turns)), system_prompt))
            yield from encode_pieces(tokenizer, conversations)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker_id = 0 if info is None else info.id
        tokenizer = Tokenizer.from_str(self.tokenizer_json)
        stream = demo_tasks.training_tasks(seed=self.seed * 1000 + worker_id)
        rng = random.Random(self.seed * 1000 + worker_id + 500)
        conversations = self._conversations(tokenizer, stream, rng)
        while True:
            yield pack_rows(conversations, self.num_rows, self.row_len, self.pad_id)


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool: a token sees the earlier tokens of its own segment only."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, L, L]
    return (same_segment & causal)[:, None]


def text_batch(text_ids: torch.Tensor, batch_size: int, length: int, bos_id: int, generator: torch.Generator):
    """Random windows of the Python stream, each started with BOS: inputs and targets [B, length]."""
    starts = torch.randint(0, text_ids.numel() - length, (batch_size,), generator=generator, device=text_ids.device)
    offsets = torch.arange(length, device=text_ids.device)
    windows = text_ids[starts[:, None] + offsets[None, :]]  # [B, length]
    bos = torch.full((batch_size, 1), bos_id, dtype=windows.dtype, device=windows.device)
    return torch.cat([bos, windows[:, :-1]], dim=1), windows


# ---------------------------------------------------------------- evaluation


def cross_entropy_sum(model, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    logits = model(input_ids=inputs).logits.float()  # [B, L, V]
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum.item(), int((targets != IGNORE_INDEX).sum())


@torch.no_grad()
def heldout_text_loss(model, heldout_ids: torch.Tensor, length: int, bos_id: int, batch_size: int = 32) -> float:
    """Mean NLL per token over non-overlapping windows; each window starts its context at BOS."""
    num_windows = heldout_ids.numel() // length
    windows = heldout_ids[: num_windows * length].view(num_windows, length)  # [N, length]
    total_nll, total_tokens = 0.0, 0
    for start in range(0, num_windows, batch_size):
        targets = windows[start : start + batch_size]
        bos = torch.full((targets.shape[0], 1), bos_id, dtype=targets.dtype, device=targets.device)
        inputs = torch.cat([bos, targets[:, :-1]], dim=1)
        nll, count = cross_entropy_sum(model, inputs, targets)
        total_nll += nll
        total_tokens += count
    return total_nll / max(total_tokens, 1)


@torch.no_grad()
def heldout_task_loss(
    model, tokenizer: Tokenizer, heldout: list[tasks.Task], pad_id: int, device: str, batch_size: int = 256
) -> float:
    """Mean NLL per answer token, teacher-forced, on the held-out tasks."""
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(heldout), batch_size):
        conversations = [conversation_pieces([task], None) for task in heldout[start : start + batch_size]]
        inputs, targets, _ = encode_conversations(tokenizer, conversations, pad_id)
        nll, count = cross_entropy_sum(model, inputs.to(device), targets.to(device))
        total_nll += nll
        total_tokens += count
    return total_nll / max(total_tokens, 1)


@torch.no_grad()
def greedy_replies(
    model, hf_tokenizer, heldout: list[tasks.Task], device: str, max_new_tokens: int, batch_size: int = 400
) -> list[str]:
    """Greedy replies to each task's chat prompt, batched with left padding."""
    hf_tokenizer.padding_side = "left"
    replies = []
    for start in range(0, len(heldout), batch_size):
        prompts = [
            hf_tokenizer.apply_chat_template(task.messages, add_generation_prompt=True, tokenize=False)
            for task in heldout[start : start + batch_size]
        ]
        batch = hf_tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to(device)
        output = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=hf_tokenizer.pad_token_id,
            eos_token_id=hf_tokenizer.eos_token_id,
        )
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        replies += hf_tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    return replies


def accuracy_by_kind(heldout: list[tasks.Task], replies: list[str]) -> tuple[dict[str, float], float, list[dict]]:
    num_correct = {kind: 0 for kind in demo_tasks.KINDS}
    num_total = {kind: 0 for kind in demo_tasks.KINDS}
    failures = []
    for task, reply in zip(heldout, replies):
        num_total[task.kind] += 1
        if tasks.is_correct(task, reply):
            num_correct[task.kind] += 1
        elif len(failures) < 24:
            failures.append(
                {"kind": task.kind, "question": task.messages[-1]["content"], "answer": task.answer, "reply": reply}
            )
    accuracy = {kind: num_correct[kind] / num_total[kind] for kind in demo_tasks.KINDS if num_total[kind]}
    overall = sum(num_correct.values()) / max(sum(num_total.values()), 1)
    return accuracy, overall, failures


# ---------------------------------------------------------------- model and schedule


def build_config(args, tokenizer: Tokenizer) -> Qwen2Config:
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    return Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        use_sliding_window=False,
        max_window_layers=args.num_layers,
        attention_dropout=0.0,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def learning_rate(args, step: int, progress: float) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


def make_optimizer(args, model) -> torch.optim.Optimizer:
    # Decay matrices only: norms and biases keep their scale.
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    kept = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": args.weight_decay}, {"params": kept, "weight_decay": 0.0}]
    is_cuda = args.device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=is_cuda)


def save_checkpoint(model, config_extra: dict, out_dir: Path) -> None:
    """FP16 safetensors, config.json and generation_config.json."""
    model.to(torch.float16).save_pretrained(out_dir, safe_serialization=True)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    # 4.x-era readers look for these names; 5.x reads `dtype` and `rope_parameters`.
    config["torch_dtype"] = "float16"
    config["dtype"] = "float16"
    config.update(config_extra)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        do_sample=False,
    )
    generation.save_pretrained(out_dir)


def write_model_card(out_dir: Path, record: dict) -> None:
    accuracy_rows = "\n".join(f"| {kind} | {value:.1%} |" for kind, value in record["accuracy"].items())
    model = record["model"]
    card = f"""# lowvram demo model

A small demo model: not a DeepSeek model, and of no use beyond demonstration.
lowvram ships it so that its engine, quantizer and benchmarks have a model whose
quality can be measured.

- Architecture: `Qwen2ForCausalLM` in DeepSeek-R1-Distill-Qwen's layout: GQA, q/k/v bias,
  untied head, RMSNorm, SwiGLU, RoPE.
- Size: {model["num_parameters"] / 1e6:.2f}M parameters; {model["num_layers"]} layers, hidden size {model["hidden_size"]},
  intermediate size {model["intermediate_size"]}, {model["num_heads"]} query and {model["num_kv_heads"]} key/value heads of {model["head_dim"]}.
- Tokenizer: byte-level BPE, {model["vocab_size"]} tokens, digits split one per token,
  DeepSeek-R1's special tokens and chat format (`chat_template.jinja`).
- Training: from scratch by `scripts/train_demo_model.py` in the lowvram repository,
  {record["steps"]} steps, {record["train_time_s"] / 60:.1f} minutes on {record["machine"]["device_name"]}, on synthetic chat
  tasks with exact answers (`scripts/demo_tasks.py`) and Python standard-library source
  (`scripts/demo_corpus.py`).

It answers the tasks' kinds of question with the bare result: "What is 123 + 45?" -> "168",
"Sort these words alphabetically: pear, apple, kiwi" -> "apple, kiwi, pear".

Measured on held-out data whose problems never appear in training; FP16, greedy decoding:

| task | exact match |
|---|---|
{accuracy_rows}
| all | {record["accuracy_overall"]:.1%} |

Perplexity on held-out Python (`heldout_python.txt`, {record["text_len"]}-token windows, each from BOS):
{record["heldout_ppl"]:.2f}.
"""
    (out_dir / "README.md").write_text(card, encoding="utf-8")


# ---------------------------------------------------------------- main


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.time()
    deadline = started + args.max_minutes * 60.0
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = args.device
    is_cuda = device.startswith("cuda")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    text = demo_corpus.training_text()
    if args.tiny:
        text = text[:300_000]
    tokenizer = train_tokenizer(tokenizer_texts(text, args.tiny), vocab_size=args.vocab_size)
    save_tokenizer(tokenizer, out_dir, max_length=args.max_positions)
    hf_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    bos_id, pad_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    heldout_python = corpus.heldout_text(max_chars=20_000 if args.tiny else None)
    if not (out_dir / "heldout_python.txt").is_file():
        (out_dir / "heldout_python.txt").write_text(corpus.heldout_text(), encoding="utf-8")
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens, trained in {time.time() - started:.1f}s", flush=True)

    # Loader workers fork before CUDA starts in this process.
    batches = TaskRows(
        tokenizer.to_str(), args.seed, args.task_rows, args.row_len, args.multi_turn_prob, args.system_prob, pad_id
    )
    loader = torch.utils.data.DataLoader(
        batches,
        batch_size=None,
        num_workers=args.num_workers,
        pin_memory=is_cuda,
        prefetch_factor=4 if args.num_workers else None,
        persistent_workers=args.num_workers > 0,
    )
    task_batches = iter(loader)

    text_ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids, device=device)
    heldout_ids = torch.tensor(tokenizer.encode(heldout_python, add_special_tokens=False).ids, device=device)
    heldout = tasks.heldout_tasks(args.heldout_per_kind)
    text_positions = torch.arange(args.row_len, device=device).expand(args.text_rows, args.row_len)
    text_segments = torch.zeros(args.text_rows, args.row_len, dtype=torch.int32, device=device)
    print(f"python text: {text_ids.numel()} training tokens, {heldout_ids.numel()} held-out tokens", flush=True)

    config = build_config(args, tokenizer)
    model = Qwen2ForCausalLM(config).to(device)
    num_parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {num_parameters / 1e6:.2f}M parameters, {args.num_layers} layers", flush=True)
    optimizer = make_optimizer(args, model)
    autocast = torch.autocast(device_type="cuda" if is_cuda else "cpu", dtype=torch.bfloat16, enabled=is_cuda)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True

    history = []
    num_task_tokens = num_text_tokens = num_answer_tokens = 0
    loop_started = time.time()
    last_log = last_eval = loop_started
    step = 0
    model.train()
    while True:
        now = time.time()
        if (args.steps is not None and step >= args.steps) or now >= deadline:
            break
        progress = (now - loop_started) / max(deadline - loop_started, 1e-6)
        if args.steps is not None:
            progress = max(progress, step / args.steps)
        lr = learning_rate(args, step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr

        packed = {
            key: value.to(device, non_blocking=True) if torch.is_tensor(value) else value
            for key, value in next(task_batches).items()
        }
        text_inputs, text_targets = text_batch(text_ids, args.text_rows, args.row_len, bos_id, generator)
        num_task_rows = packed["input_ids"].shape[0]
        inputs = torch.cat([packed["input_ids"], text_inputs])  # [R + T, row_len]
        positions = torch.cat([packed["position_ids"], text_positions])
        segments = torch.cat([packed["segment_ids"], text_segments])
        with autocast:
            logits = model(input_ids=inputs, position_ids=positions, attention_mask=block_causal_mask(segments)).logits
            logits = logits.float()  # [R + T, row_len, V]
            task_loss = F.cross_entropy(
                logits[:num_task_rows].flatten(0, 1), packed["targets"].flatten(), ignore_index=IGNORE_INDEX
            )
            text_loss = F.cross_entropy(logits[num_task_rows:].flatten(0, 1), text_targets.flatten())
        loss = task_loss + args.text_weight * text_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        num_task_tokens += packed["num_tokens"]
        num_answer_tokens += packed["num_trained"]
        num_text_tokens += text_inputs.numel()

        now = time.time()
        if now - last_log >= 15.0 or step == 1:
            last_log = now
            print(
                f"step {step:6d}  {now - started:6.0f}s  lr {lr:.2e}  task loss {task_loss.item():.4f}  "
                f"text loss {text_loss.item():.4f}  {step / (now - loop_started):.1f} steps/s",
                flush=True,
            )
        if not args.tiny and now - last_eval >= args.eval_every_s and deadline - now > 20.0:
            last_eval = now
            model.eval()
            with autocast:
                task_nll = heldout_task_loss(model, tokenizer, heldout, pad_id, device)
                text_nll = heldout_text_loss(model, heldout_ids, args.row_len, bos_id)
                sample = heldout[::4]  # heldout is grouped by kind: a quarter of each
                sample_by_kind, sample_accuracy, _ = accuracy_by_kind(
                    sample, greedy_replies(model, hf_tokenizer, sample, device, args.max_new_tokens)
                )
            model.train()
            history.append(
                {
                    "step": step,
                    "elapsed_s": round(now - started, 1),
                    "lr": lr,
                    "train_task_loss": round(task_loss.item(), 4),
                    "train_text_loss": round(text_loss.item(), 4),
                    "heldout_task_loss": round(task_nll, 4),
                    "heldout_text_loss": round(text_nll, 4),
                    "heldout_accuracy_quarter": round(sample_accuracy, 4),
                    "heldout_accuracy_quarter_by_kind": {
                        kind: round(value, 3) for kind, value in sample_by_kind.items()
                    },
                }
            )
            print(
                f"eval  step {step}: held-out task loss {task_nll:.4f}, text loss {text_nll:.4f}, "
                f"accuracy (1/4 of held-out) {sample_accuracy:.1%}: "
                + " ".join(f"{kind} {value:.0%}" for kind, value in sample_by_kind.items()),
                flush=True,
            )

    train_time_s = time.time() - loop_started
    del task_batches, loader

    model.eval()
    with autocast:
        final_task_nll = heldout_task_loss(model, tokenizer, heldout, pad_id, device)
        final_text_nll = heldout_text_loss(model, heldout_ids, args.row_len, bos_id)
    save_checkpoint(model, {"rope_theta": 10000.0}, out_dir)
    del model

    # Measure the files a user gets, loaded the way a user loads them.
    eval_dtype = torch.float16 if is_cuda else torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=eval_dtype).to(device).eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    replies = greedy_replies(loaded, loaded_tokenizer, heldout, device, args.max_new_tokens)
    accuracy, overall, failures = accuracy_by_kind(heldout, replies)
    loaded_text_nll = heldout_text_loss(loaded, heldout_ids, args.row_len, bos_id)
    weights_bytes = (out_dir / "model.safetensors").stat().st_size

    record = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "device": device,
            "device_name": torch.cuda.get_device_name(0) if is_cuda else platform.processor() or "CPU",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "model": {
            "architecture": "Qwen2ForCausalLM",
            "num_parameters": num_parameters,
            "num_layers": args.num_layers,
            "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size,
            "num_heads": args.num_heads,
            "num_kv_heads": args.num_kv_heads,
            "head_dim": args.hidden_size // args.num_heads,
            "vocab_size": tokenizer.get_vocab_size(),
            "fp16_safetensors_bytes": weights_bytes,
        },
        "steps": step,
        "tokens_seen": {
            "task_tokens": num_task_tokens,
            "task_answer_tokens": num_answer_tokens,
            "python_tokens": num_text_tokens,
            "total": num_task_tokens + num_text_tokens,
        },
        "train_time_s": round(train_time_s, 1),
        "wall_time_s": round(time.time() - started, 1),
        "hyperparameters": {
            "lr": args.lr,
            "min_lr_ratio": args.min_lr_ratio,
            "warmup_steps": args.warmup_steps,
            "weight_decay": args.weight_decay,
            "task_rows": args.task_rows,
            "text_rows": args.text_rows,
            "row_len": args.row_len,
            "text_weight": args.text_weight,
            "multi_turn_prob": args.multi_turn_prob,
            "system_prob": args.system_prob,
            "seed": args.seed,
            "max_minutes": args.max_minutes,
        },
        "text_len": args.row_len,
        "final_heldout_task_loss": round(final_task_nll, 4),
        "final_heldout_text_loss": round(final_text_nll, 4),
        "heldout_ppl": round(math.exp(loaded_text_nll), 3),
        "heldout_ppl_note": f"FP16 checkpoint as saved; {args.row_len}-token windows from BOS over corpus.heldout_text()",
        "num_heldout_tasks": len(heldout),
        "accuracy": {kind: round(value, 4) for kind, value in accuracy.items()},
        "accuracy_overall": round(overall, 4),
        "accuracy_note": f"greedy exact match, {str(eval_dtype).removeprefix('torch.')} checkpoint loaded with AutoModelForCausalLM",
        "failures": failures,
        "history": history,
    }
    write_model_card(out_dir, record)
    bench_path = Path(args.bench_json)
    bench_path.parent.mkdir(parents=True, exist_ok=True)
    bench_path.write_text(json.dumps(record, indent=2) + "\n")

    print(f"saved {out_dir} ({weights_bytes / 1e6:.1f} MB FP16) and {bench_path}")
    print(
        f"steps {step}, train {train_time_s:.0f}s, wall {record['wall_time_s']:.0f}s, tokens {record['tokens_seen']['total']:,}"
    )
    print("accuracy: " + ", ".join(f"{kind} {value:.1%}" for kind, value in accuracy.items()))
    print(
        f"overall accuracy {overall:.1%}, held-out Python ppl {record['heldout_ppl']:.2f}, "
        f"held-out task loss {final_task_nll:.4f}"
    )
    return record


if __name__ == "__main__":
    main()
