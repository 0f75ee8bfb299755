"""The demo model's tokenizer: byte-level BPE with DeepSeek-R1's special tokens and chat format.

Digits are split one per token before BPE runs, so "5312" is always 5, 3, 1, 2: the
model sees every number digit by digit, which is what makes carrying learnable.
Saved in the Hugging Face layout (tokenizer.json, tokenizer_config.json,
chat_template.jinja) so `transformers.AutoTokenizer.from_pretrained` loads it.
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

# DeepSeek-R1's layout: BOS, system text, then <｜User｜>question<｜Assistant｜>answer<｜end▁of▁sentence｜>
# per turn; the generation prompt is <｜Assistant｜>. System messages go first, wherever they
# stand in the list, and the reasoning before </think> is dropped from earlier assistant turns
# so that history does not grow with old thoughts, as in R1's own template.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<｜User｜>' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<｜Assistant｜>' + message['content'].split('</think>')[-1] + '<｜end▁of▁sentence｜>' -}}"
    "{%- elif message['role'] != 'system' -%}"
    "{{- raise_exception('unsupported chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 2048,
    *,
    extra_special_tokens: tuple[str, ...] = (),
    split_digits: bool = True,
) -> Tokenizer:
    """Byte-level BPE over `texts`; encoding a plain text prepends BOS, as R1's tokenizer does.

    `extra_special_tokens` get ids right after DeepSeek's four; `vocab_size` counts them all.
    `split_digits` makes every digit its own token. The same arguments give the same tokenizer.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, max_length: int) -> None:
    """Write the Hugging Face tokenizer files and chat_template.jinja into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "padding_side": "left",
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    special_tokens_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps(special_tokens_map, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
