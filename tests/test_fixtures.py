"""The tiny checkpoints that other tests build on behave like the real DeepSeek ones."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lowvram.demo.tokenizer import ASSISTANT, BOS, EOS, USER
from lowvram.errors import ConfigError
from lowvram.testing import make_tiny_model

MIXED_TEXT = 'Hello  world!\n\ndef add(a, b):\n    return a + b  # 12345, "ünïcödé" 東京 🙂'


def _read_tensors(model_dir):
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def test_checkpoint_loads_in_transformers_and_gives_finite_logits(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    input_ids = tokenizer("The scheduler frees a block of memory.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_greedy_decoding_is_not_one_repeated_token(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    inputs = tokenizer("def add(a, b):", return_tensors="pt")
    output_ids = model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    new_ids = output_ids[0, inputs.input_ids.shape[1] :].tolist()
    assert len(new_ids) == 32
    assert len(set(new_ids)) > 3, f"greedy output collapsed: {new_ids}"


def test_sharded_checkpoint_has_index_and_matches_single_file(tiny_qwen2_sharded_dir, tiny_qwen2_dir):
    index = json.loads((tiny_qwen2_sharded_dir / "model.safetensors.index.json").read_text())
    shard_names = sorted(p.name for p in tiny_qwen2_sharded_dir.glob("model-*-of-*.safetensors"))
    assert len(shard_names) >= 2
    assert sorted(set(index["weight_map"].values())) == shard_names
    assert not (tiny_qwen2_sharded_dir / "model.safetensors").exists()

    sharded = _read_tensors(tiny_qwen2_sharded_dir)
    single = _read_tensors(tiny_qwen2_dir)
    assert sorted(sharded) == sorted(single) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sharded.values())
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_sharded_dir)
    assert torch.equal(model.model.embed_tokens.weight, single["model.embed_tokens.weight"])


def test_weights_on_disk_are_bfloat16(tiny_model_dir):
    tensors = _read_tensors(tiny_model_dir)
    assert tensors
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"


def test_same_arguments_give_byte_identical_weights(tmp_path):
    first = make_tiny_model(tmp_path / "a", "qwen2", seed=7)
    second = make_tiny_model(tmp_path / "b", "qwen2", seed=7)
    other_seed = make_tiny_model(tmp_path / "c", "qwen2", seed=8)
    weights_bytes = (first / "model.safetensors").read_bytes()
    assert weights_bytes == (second / "model.safetensors").read_bytes()
    assert weights_bytes != (other_seed / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()


def test_tokenizer_round_trips_text_and_adds_one_bos(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer(MIXED_TEXT).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == MIXED_TEXT
    # The vocabulary was learnt, not left at single bytes.
    assert len(tokenizer("The model reads the next token.", add_special_tokens=False).input_ids) < 15


def test_model_vocab_covers_every_token_id(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.vocab_size == len(tokenizer)
    assert max(tokenizer.get_vocab().values()) < config.vocab_size
    generation_config = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation_config["bos_token_id"] == config.bos_token_id == tokenizer.convert_tokens_to_ids(BOS)
    assert generation_config["eos_token_id"] == config.eos_token_id == tokenizer.convert_tokens_to_ids(EOS)


def test_chat_template_renders_deepseek_r1_format(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet back</think>Hello!"},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (f"{BOS}Be brief.{USER}Hi{ASSISTANT}Hello!{EOS}{USER}Why is the sky blue?{ASSISTANT}")
    without_prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert without_prompt == f"{BOS}Be brief.{USER}Hi"

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    special_ids = tokenizer.convert_tokens_to_ids([BOS, USER, ASSISTANT])
    assert ids[0] == special_ids[0] and ids.count(special_ids[0]) == 1
    assert ids.count(special_ids[1]) == 2
    assert ids[-1] == special_ids[2]


def test_llama_is_shaped_like_deepseek_coder(tiny_llama_dir):
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_attention_heads == config.num_key_value_heads == 4
    assert config.head_dim == 16 and config.hidden_size == 64
    assert config.attention_bias is False and config.mlp_bias is False
    assert config.tie_word_embeddings is False
    rope = config.rope_parameters
    assert rope["rope_type"] == "linear" and rope["factor"] == 4.0 and rope["rope_theta"] == 100000.0

    tensors = _read_tensors(tiny_llama_dir)
    assert not any(name.endswith(".bias") for name in tensors)
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (64, 64)
    # Norm weights are not all ones, so a loader that skips them changes the output.
    assert not torch.all(tensors["model.norm.weight"] == 1)


def test_qwen2_is_shaped_like_r1_distill_qwen(tiny_qwen2_dir):
    config = AutoConfig.from_pretrained(tiny_qwen2_dir)
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.intermediate_size == 160
    assert config.tie_word_embeddings is False
    assert config.use_sliding_window is False
    assert config.rope_parameters["rope_type"] == "default"
    assert config.rope_parameters["rope_theta"] == 10000.0

    tensors = _read_tensors(tiny_qwen2_dir)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (160, 64)
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = tensors[f"model.layers.0.self_attn.{proj}.bias"]
        assert bias.abs().sum() > 0, f"{proj} bias is zero, so a loader that drops it would go unnoticed"
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    assert "lm_head.weight" in tensors


def test_tied_head_override_leaves_lm_head_out_of_the_file(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in _read_tensors(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_unknown_arch_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="deepseek_v2"):
        make_tiny_model(tmp_path, "deepseek_v2")
