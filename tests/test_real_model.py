"""A real pretrained model end to end: SmolLM2-135M-Instruct, fetched once as a GGUF file
(scripts/fetch_smollm2.py) and converted by lowvram's GGUF path."""

import subprocess
import sys

import openai
import pytest
import torch
from script_modules import load_script

from lowvram import LLM
from lowvram.core.sampling_params import SamplingParams

QUESTION = "What is the capital of France?"
PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):\n    ", "Water boils at"]
NUM_STEPS = 24


@pytest.fixture(scope="session")
def smollm2_dir():
    return load_script("fetch_smollm2").fetch_smollm2(progress=lambda line: print(line, file=sys.stderr))


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    return LLM(str(smollm2_dir), profile="cpu")


def test_gguf_file_converts_once_to_a_checkpoint_with_its_tokenizer(smollm2_dir):
    import json

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576 and config["tie_word_embeddings"]
    assert (smollm2_dir / "model.safetensors").is_file() and (smollm2_dir / "tokenizer.json").is_file()
    script = load_script("fetch_smollm2")
    gguf = script.fetch_gguf(script.DEFAULT_DIR)
    from lowvram.models.gguf import convert_gguf

    messages = []
    assert convert_gguf(gguf, cache_root=smollm2_dir.parent, progress=messages.append) == smollm2_dir
    assert messages == []  # found, not converted again


def test_logprobs_and_greedy_continuations_equal_transformers(smollm2, smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tokenizer = smollm2.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NUM_STEPS, ignore_eos=True)
    outputs = smollm2.generate(PROMPTS, params)
    worst = 0.0
    for prompt, output in zip(PROMPTS, outputs):
        prompt_ids = tokenizer.encode(prompt)
        ids = prompt_ids + list(output.outputs[0].token_ids)
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        expected = expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        ours = torch.tensor(smollm2.engine.score(ids))
        worst = max(worst, (ours - expected).abs().max().item())
        greedy = hf.generate(
            torch.tensor([prompt_ids]), max_new_tokens=NUM_STEPS, min_new_tokens=NUM_STEPS, do_sample=False
        )[0, len(prompt_ids) :].tolist()
        assert list(output.outputs[0].token_ids) == greedy, f"{prompt!r}: greedy continuation differs"
    print(f"largest log-probability difference from transformers: {worst:.2e}")
    assert worst < 2e-3


def test_chat_template_is_the_gguf_files(smollm2, smollm2_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    reference = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    ids = smollm2.engine.tokenizer.apply_chat_template(messages)
    assert ids == reference.encode(text, add_special_tokens=False)


def test_chat_plain_answers_the_capital_question(smollm2_dir):
    result = subprocess.run(
        [sys.executable, "-m", "lowvram", "chat", "--plain", "--model", str(smollm2_dir), "--profile", "cpu"],
        input=QUESTION + "\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "Traceback" not in result.stderr


def test_server_answers_the_capital_question(smollm2, smollm2_dir):
    from lowvram.engine.async_engine import AsyncLLMEngine
    from lowvram.server.app import create_app
    from lowvram.server.cli import BackgroundServer, bind_socket

    running = AsyncLLMEngine(smollm2.engine).start()
    try:
        app = create_app(running, model_name=smollm2_dir.name)
        with BackgroundServer(app, bind_socket("127.0.0.1", 0)) as server:
            base_url = f"http://127.0.0.1:{server.port}/v1"
            with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
                reply = client.chat.completions.create(
                    model=smollm2_dir.name, messages=[{"role": "user", "content": QUESTION}], temperature=0
                )
    finally:
        running.stop()
    assert "Paris" in reply.choices[0].message.content


@pytest.mark.slow
def test_the_4gb_profiles_quantization_still_answers(smollm2_dir, tmp_path):
    # hidden size 576 is not a multiple of 128: the group size falls back to 64
    from lowvram.config import load_profile
    from lowvram.quant.quantize import quantize_model

    profile = load_profile("4gb")
    report = quantize_model(
        smollm2_dir,
        tmp_path / "awq",
        fp16_budget_mib=profile.fp16_budget_mib,
        rank=profile.compensation_rank,
        num_samples=16,
        device="cpu",
    )
    assert report.group_size == 64
    llm = LLM(str(tmp_path / "awq"), profile="cpu")
    reply = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in reply[0].outputs[0].text


def test_real_text_quality_rows_include_llama_cpp_formats(smollm2_dir):
    from lowvram.bench.quality import run_quality_bench, to_markdown

    report = run_quality_bench(
        str(smollm2_dir), variant_names=["fp16", "llama.cpp-q8_0", "llama.cpp-q4_0"], text="real", max_chars=8000
    )
    fp16, q8, q4 = report.rows
    assert fp16.num_tasks >= 50 and fp16.accuracy is None and fp16.num_ppl_tokens >= 1500
    assert 1.0 < fp16.perplexity < 100.0
    # Q8_0 is nearly lossless; Q4_0 costs perplexity; both read far fewer bytes than FP16
    assert (
        abs(q8.perplexity - fp16.perplexity) / fp16.perplexity
        < 0.01
        < (q4.perplexity - fp16.perplexity) / fp16.perplexity
    )
    # exact-match agreement of 32-token greedy answers is strict: small changes flip near-ties
    assert q8.agreement_with_fp16 >= max(0.5, q4.agreement_with_fp16)
    assert q4.weight_mib < q8.weight_mib < fp16.weight_mib
    assert 15.9 < fp16.bits_per_weight <= 16.0 and q4.bits_per_weight < q8.bits_per_weight < fp16.bits_per_weight
    assert "llama.cpp Q4_0" in to_markdown(report) and "pydoc_data.topics" in report.text
