"""Shared test set-up.

Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET must be set
before any kernel module is imported, so it is set here, before collection.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _strict_interpreted_launches() -> None:
    """The interpreter drops launch keywords that the kernel does not take, where a compiled
    launch raises KeyError on them: a keyword left behind by a change to a kernel's arguments
    passes every CPU test and fails every GPU one. Make the interpreter raise as well. Besides
    the kernel's arguments, a CUDA launch takes the CUDA backend's options (num_warps, ...)."""
    import dataclasses

    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.runtime.interpreter import InterpretedFunction

    launch_options = frozenset(field.name for field in dataclasses.fields(CUDAOptions))
    run = InterpretedFunction.run

    def checked_run(self, *args, grid, warmup, **kwargs):
        unknown = sorted(set(kwargs) - set(self.arg_names) - launch_options)
        if unknown:
            raise TypeError(f"{self.fn.__name__} was launched with keywords it does not take: {', '.join(unknown)}")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = checked_run


if os.environ.get("TRITON_INTERPRET") == "1":
    _strict_interpreted_launches()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Tiny random-weight checkpoints (lowvram.testing), built once per session.
# lowvram.testing imports transformers, so it is imported only when a test asks
# for one of these, not at collection.


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """deepseek-coder-shaped checkpoint: MHA, no bias, RoPE linear x4, one safetensors file."""
    from lowvram.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """R1-Distill-Qwen-shaped checkpoint: GQA 4/2, q/k/v bias, one safetensors file."""
    from lowvram.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen2_sharded_dir(tmp_path_factory):
    """The same weights as `tiny_qwen2_dir`, split over several shards with an index."""
    from lowvram.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-sharded"), "qwen2", sharded=True)


@pytest.fixture(scope="session")
def tiny_reasoning_dir(tiny_qwen2_dir, tmp_path_factory):
    """`tiny_qwen2_dir` with a chat template that opens `<think>\n` for the reply, as DeepSeek-R1's newer ones do."""
    import shutil

    out = tmp_path_factory.mktemp("tiny-reasoning") / "tiny-r1"
    shutil.copytree(tiny_qwen2_dir, out)
    template = (out / "chat_template.jinja").read_text("utf-8")
    opened = template.replace(
        "{{- '<｜Assistant｜>' -}}{%- endif -%}", "{{- '<｜Assistant｜><think>\\n' -}}{%- endif -%}"
    )
    assert opened != template, "the template's generation prompt moved; update this fixture"
    (out / "chat_template.jinja").write_text(opened, "utf-8")
    return out


@pytest.fixture(params=["llama", "qwen2"], ids=["llama", "qwen2"])
def tiny_model_dir(request):
    """Each tiny checkpoint in turn, for tests that must hold for both architectures."""
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def pytest_runtest_logreport(report):
    """With LOWVRAM_TEST_PRINT_FAILURES=1 (scripts/test_gpu.sh sets it), a failing test's
    traceback is printed as soon as it fails, not in the summary at the end: a GPU run that
    aborts later (a CUDA error tearing the process down) still leaves in its log why each
    earlier test failed."""
    if report.failed and os.environ.get("LOWVRAM_TEST_PRINT_FAILURES") == "1":
        print(f"\n=== {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n", flush=True)


@pytest.fixture(scope="session", autouse=True)
def _emulated_card():
    """With LOWVRAM_TEST_EMULATE_GIB set (scripts/test_gpu.sh sets 4), every GPU test runs
    under that cap, as on the profile's card."""
    gib = os.environ.get("LOWVRAM_TEST_EMULATE_GIB")
    if HAS_CUDA and gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(float(gib) * 2**30 / total)
    yield


@pytest.fixture(scope="module")
def async_engine(engine):
    """The test module's `engine` fixture behind one AsyncLLMEngine loop, stopped after the module."""
    from lowvram.engine.async_engine import AsyncLLMEngine

    running = AsyncLLMEngine(engine).start()
    yield running
    running.stop()
