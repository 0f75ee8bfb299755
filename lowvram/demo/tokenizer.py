"""The demo model's tokenizer: byte-level BPE with DeepSeek-R1's special tokens and chat format,
saved in the Hugging Face layout. Digits are split one per token, so the model sees every
number digit by digit, which is what makes carrying learnable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT)
# DeepSeek-R1's layout: BOS, the system text, then <｜User｜>question<｜Assistant｜>answer
# <｜end▁of▁sentence｜> per turn, <｜Assistant｜> as the generation prompt; the reasoning before
# </think> is dropped from earlier assistant turns, as in R1's own. The demo model ships the file.
CHAT_TEMPLATE = (Path(__file__).resolve().parent.parent / "demo_model" / "chat_template.jinja").read_text("utf-8")


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, *, extra_special_tokens: tuple[str, ...] = (), split_digits=True
) -> Tokenizer:
    """Byte-level BPE over `texts`; encoding a plain text prepends BOS, as R1's tokenizer does.
    `extra_special_tokens` get ids after DeepSeek's four; `vocab_size` counts them all. Deterministic."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer = Tokenizer(models.BPE())
    digits = pre_tokenizers.Digits(individual_digits=True)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level]) if split_digits else byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, max_length: int) -> None:
    """Write the Hugging Face tokenizer files and chat_template.jinja into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "padding_side": "left",
    }
    for name, data in (("tokenizer_config.json", tokenizer_config), ("special_tokens_map.json", special)):
        (out_dir / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
