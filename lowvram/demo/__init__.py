"""The bundled demo model: a small Qwen2ForCausalLM in DeepSeek-R1-Distill-Qwen's layout, trained
by `scripts/train_demo_model.py` on synthetic chat tasks with exact answers (`tasks`) and Python
source (`corpus`), so its quality can be measured (docs/demo_model.md)."""

from pathlib import Path

from lowvram.errors import ModelLoadError

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"


def demo_model_path() -> Path:
    """The directory of the bundled demo checkpoint."""
    if not (DEMO_MODEL_DIR / "model.safetensors").is_file():
        raise ModelLoadError(
            f"the bundled demo model is missing from {DEMO_MODEL_DIR}; reinstall lowvram, "
            "or train it with `python scripts/train_demo_model.py`"
        )
    return DEMO_MODEL_DIR
