"""Tiny random-weight checkpoints shaped like the DeepSeek models lowvram targets, built offline
in under a second (tests, `lowvram bench speed --shape tiny`): a byte-level BPE tokenizer
trained on text generated in code, and transformers' own model classes with a fixed seed.
"llama" is deepseek-coder's shape (MHA, no bias, RoPE theta 100000 with linear scaling x4);
"qwen2" is R1-Distill-Qwen's (GQA, q/k/v bias, untied head, theta 10000), with an
intermediate size that is not a multiple of the hidden size so transposed shapes fail loudly.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import torch

from lowvram.demo.tokenizer import BOS, EOS, save_tokenizer, train_tokenizer
from lowvram.errors import ConfigError

MAX_POSITION_EMBEDDINGS = 2048

# initializer_range is well above transformers' 0.02 so that logits spread enough for greedy
# decoding not to hinge on bf16 ties.
_COMMON_CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
}
_ARCH_CONFIG = {
    "llama": {
        "intermediate_size": 128,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
    },
    "qwen2": {
        "intermediate_size": 160,
        "num_key_value_heads": 2,
        "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
# transformers 5 loads a model_type "qwen2" tokenizer as Qwen2Tokenizer, which appends
# <|endoftext|> as its unknown token when the vocabulary lacks it (an id past the embedding).
_ARCH_SPECIAL_TOKENS = {"llama": (), "qwen2": ("<|endoftext|>",)}

_ENGLISH_SUBJECTS = (
    "The model|A small cache|Every request|The scheduler|Our tokenizer|The old laptop|A careful engineer|This page|"
    "The server|My friend"
).split("|")
_ENGLISH_VERBS = "reads writes keeps moves checks counts frees sends".split()
_ENGLISH_OBJECTS = (
    "the next token|a block of memory|the whole prompt|one short answer|the latest numbers|a list of names|"
    "the quiet evening|every open file"
).split("|")
_ENGLISH_TAILS = (
    " before lunch.| quickly.| and then it rests.| without any errors.| in the morning.|; nobody notices.|"
    " twice a day.|!"
).split("|")
_QUESTIONS = (
    "What is the capital of France?|How many legs does a spider have?|Can you write a function that adds two numbers?|"
    "Why is the sky blue?|Please explain recursion in one sentence.|What time is it in Tokyo?"
).split("|")
_PYTHON_NAMES = "add scale merge count_tokens free_blocks load_config".split()
_PYTHON_OPS = "+ - * // % **".split()


def _training_corpus() -> list[str]:
    """A few KB of English and Python, built by rule so that no download is needed."""
    rows = itertools.islice(itertools.product(_ENGLISH_SUBJECTS, _ENGLISH_VERBS, _ENGLISH_OBJECTS), 0, None, 7)
    lines = [f"{s} {v} {o}{_ENGLISH_TAILS[i % len(_ENGLISH_TAILS)]}" for i, (s, v, o) in enumerate(rows)]
    lines += [f"Question {i + 1}: {q} Answer: I think the answer is {i * 7 + 3}." for i, q in enumerate(_QUESTIONS)]
    for name, op in zip(_PYTHON_NAMES, _PYTHON_OPS):
        lines.append(f'def {name}(a, b):\n    """Return a {op} b."""\n    return a {op} b\n')
        lines.append(
            f"for i in range(10):\n    total = {name}(total, i)\n    if total > 100:\n        break\n"
            f'print(f"{name}: {{total}}")\n'
        )
    return [
        *lines,
        "class BlockManager:\n    def __init__(self, num_blocks: int):\n        self.free = list(range(num_blocks))\n"
        "        self.ref_counts = [0] * num_blocks\n\n    def allocate(self) -> int:\n"
        "        block_id = self.free.pop()\n        self.ref_counts[block_id] += 1\n        return block_id\n",
        "import os\nimport json\nfrom pathlib import Path\n\nconfig = json.loads(Path('config.json').read_text())\n",
        "0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 3.14 1e-6",
    ]


def train_tiny_tokenizer(
    out_dir: str | Path, vocab_size: int = 512, *, extra_special_tokens: tuple[str, ...] = ()
) -> Path:
    """Train a byte-level BPE tokenizer with DeepSeek's special tokens and chat template into
    `out_dir` (AutoTokenizer loads it; encoding adds BOS). Deterministic."""
    corpus = _training_corpus()
    tokenizer = train_tokenizer(corpus, vocab_size, extra_special_tokens=extra_special_tokens, split_digits=False)
    save_tokenizer(tokenizer, out_dir, max_length=MAX_POSITION_EMBEDDINGS)
    return Path(out_dir)


def make_tiny_model(
    out_dir: str | Path, arch: str = "llama", *, sharded: bool = False, seed: int = 0, num_layers: int = 2, **overrides
) -> Path:
    """Write a complete random-weight checkpoint directory of `arch` ("llama" or "qwen2") and return it.

    sharded: several safetensors shards and an index, as large checkpoints are. seed: the same
    arguments give byte-identical weights. overrides: LlamaConfig/Qwen2Config fields (e.g.
    `tie_word_embeddings=True`; a `vocab_size` above the tokenizer's mimics padded vocabularies).
    config.json carries RoPE and dtype in transformers 5's spelling and in the published one.
    """
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if arch not in classes:
        raise ConfigError(f"arch={arch!r} is not a tiny-model shape; use one of {sorted(classes)}")
    config_cls, model_cls = classes[arch]
    out_dir = Path(out_dir)
    train_tiny_tokenizer(out_dir, extra_special_tokens=_ARCH_SPECIAL_TOKENS[arch])
    # Read back with the tokenizers library: AutoTokenizer would pick its class from
    # whatever config.json a previous run left in out_dir.
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {"bos_token_id": tokenizer.token_to_id(BOS), "eos_token_id": tokenizer.token_to_id(EOS)}
    fields = {**_COMMON_CONFIG, **_ARCH_CONFIG[arch], "num_hidden_layers": num_layers, "vocab_size": num_tokens}
    fields |= overrides
    if fields["vocab_size"] < num_tokens:
        raise ConfigError(f"vocab_size={fields['vocab_size']} is smaller than the tokenizer ({num_tokens} tokens)")
    config = config_cls(**{**fields, **ids})
    model = random_model(model_cls, config, seed)
    state_dict = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_weights(out_dir, state_dict, sharded)
    write_config(out_dir, config)
    write_json(out_dir / "generation_config.json", ids)
    return out_dir


def random_model(model_cls, config, seed: int) -> torch.nn.Module:
    """A transformers model of `config` with seeded random weights, leaving the global RNG as it was."""
    config.architectures = [model_cls.__name__]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = model_cls(config)
        # Norm weights start at 1 and biases at 0: a loader that dropped them would still match
        # the reference, so they get random values too.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.1)
    return model


def save_weights(out_dir: Path, state_dict: dict[str, torch.Tensor], sharded: bool) -> None:
    from safetensors.torch import save_file

    for stale in [*out_dir.glob("model*.safetensors"), *out_dir.glob("model.safetensors.index.json")]:
        stale.unlink()
    if not sharded:
        save_file(state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    sizes_bytes = {name: tensor.numel() * tensor.element_size() for name, tensor in state_dict.items()}
    total_bytes = sum(sizes_bytes.values())
    # Aim for about three shards whatever the dimensions, so there are always at least two.
    max_shard_bytes = max(max(sizes_bytes.values()), math.ceil(total_bytes / 3))
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, size_bytes in sizes_bytes.items():
        if shards[-1] and shard_bytes + size_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size_bytes
    weight_map = {}
    for i, names in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: state_dict[name] for name in names}, str(out_dir / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out_dir / "model.safetensors.index.json", index)


def write_config(out_dir: Path, config) -> None:
    """config.json as published checkpoints write it: BF16, rope_theta and rope_scaling at the
    top, without transformers' generic defaults (the diff form)."""
    config_dict = config.to_diff_dict()
    config_dict["dtype"] = config_dict["torch_dtype"] = "bfloat16"
    rope = dict(config_dict["rope_parameters"])
    config_dict["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    config_dict["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    write_json(out_dir / "config.json", config_dict)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
