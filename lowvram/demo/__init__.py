"""The bundled demo model: a small Qwen2ForCausalLM in DeepSeek-R1-Distill-Qwen's layout.

It is trained from scratch by `scripts/train_demo_model.py` on synthetic chat tasks
with exact answers (`lowvram.demo.tasks`) and on Python source (`lowvram.demo.corpus`),
so its quality can be measured: exact-match accuracy on held-out tasks and perplexity
on held-out Python. See docs/demo_model.md.
"""

from pathlib import Path

from lowvram.errors import ModelLoadError

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"


def demo_model_path() -> Path:
    """The directory of the bundled demo checkpoint (config.json, model.safetensors, tokenizer)."""
    if not (DEMO_MODEL_DIR / "model.safetensors").is_file():
        raise ModelLoadError(
            f"the bundled demo model is missing from {DEMO_MODEL_DIR}; reinstall lowvram, "
            "or train it with `python scripts/train_demo_model.py`"
        )
    return DEMO_MODEL_DIR
