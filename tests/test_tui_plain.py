"""The chat without a screen: transcripts, commands, gauges' drawing, the plain line
mode, and the real binary driven in tmux."""

import contextlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("textual")

import lowvram  # noqa: E402
from lowvram import LLM  # noqa: E402
from lowvram.errors import ConfigError, RequestError  # noqa: E402
from lowvram.tui.backend import EngineSpec  # noqa: E402
from lowvram.tui.conversation import (  # noqa: E402
    ChatSettings,
    Conversation,
    Turn,
    check_max_tokens,
    default_transcript_dir,
    load_transcript,
    parse_command,
    save_transcript,
)
from lowvram.tui.plain import run_plain  # noqa: E402
from lowvram.tui.widgets import THRESHOLD_CHAR, gauge_cells, sparkline_cells  # noqa: E402

ROOT = Path(__file__).parent.parent
DEMO_WEIGHTS = Path(lowvram.__file__).parent / "demo_model" / "model.safetensors"


@pytest.fixture(scope="module")
def model_args(request) -> list[str]:
    """`--model DIR` for the tiny checkpoint, or nothing (the bundled model) when that is installed."""
    if DEMO_WEIGHTS.is_file():
        return []
    return ["--model", str(request.getfixturevalue("tiny_qwen2_dir"))]


def chat_argv() -> list[str]:
    """`lowvram chat` once lowvram's CLI has the subcommand, else the same chat through `python -m lowvram.tui`."""
    from lowvram.cli import build_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(["chat", "--plain"])
    except SystemExit:
        return [sys.executable, "-m", "lowvram.tui"]
    binary = shutil.which("lowvram")
    return [binary, "chat"] if binary else [sys.executable, "-m", "lowvram.cli", "chat"]


# -- transcripts and commands -------------------------------------------------------


def sample_conversation() -> Conversation:
    settings = ChatSettings(system_prompt="Be brief.", temperature=0.7, max_tokens=64)
    turns = [
        Turn("user", "What is `x`?\n\nTwo lines."),
        Turn("assistant", "```python\nx = 1\n```", "stop"),
        Turn("user", "More"),
        Turn("assistant", "It is", "abort"),
    ]
    return Conversation(settings, turns, model="demo", profile="4gb", started_at="2025-01-02T03:04:05")


def test_transcript_json_round_trips_and_markdown_reads_well(tmp_path):
    conversation = sample_conversation()
    markdown_path, json_path = save_transcript(conversation, tmp_path / "chat.json")
    assert (markdown_path.name, json_path.name) == ("chat.md", "chat.json")
    assert load_transcript(json_path) == conversation
    assert load_transcript(markdown_path) == conversation  # a .md path reads its .json twin
    markdown = markdown_path.read_text()
    for text in (
        "## System",
        "Be brief.",
        "## You",
        "Two lines.",
        "```python\nx = 1\n```",
        "*(stopped)*",
        "temperature: 0.7",
        "max tokens: 64",
    ):
        assert text in markdown
    assert conversation.messages()[0] == {"role": "system", "content": "Be brief."}
    assert len(conversation.messages()) == 5


def test_transcripts_go_to_the_xdg_data_dir_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_transcript_dir() == tmp_path / "lowvram" / "transcripts"
    markdown_path, json_path = save_transcript(sample_conversation())
    assert json_path.parent == tmp_path / "lowvram" / "transcripts" and markdown_path.is_file()
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_transcript_dir() == Path.home() / ".local" / "share" / "lowvram" / "transcripts"


def test_bad_transcripts_are_errors_that_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_transcript(tmp_path / "missing.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ConfigError, match=r"other\.json is not a lowvram chat transcript"):
        load_transcript(other)
    data = sample_conversation().to_json()
    data["turns"][0]["role"] = "robot"
    other.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="turn 0"):
        load_transcript(other)
    data = sample_conversation().to_json()
    data["settings"]["temperature"] = -1
    other.write_text(json.dumps(data))
    with pytest.raises(RequestError, match="temperature"):
        load_transcript(other)


def test_slash_commands_parse_and_double_slash_sends_a_slash():
    assert parse_command("/save notes/today.json").arg == "notes/today.json"
    assert parse_command("/system").arg == ""
    assert parse_command("plain text") is None and parse_command("//not a command") is None
    with pytest.raises(RequestError, match="unknown command /frobnicate"):
        parse_command("/frobnicate")
    with pytest.raises(RequestError, match="/temp needs VALUE"):
        parse_command("/temp")


def test_max_tokens_must_leave_a_quarter_of_the_context_to_the_conversation():
    check_max_tokens(1536, 2048)
    with pytest.raises(RequestError, match="max tokens 2000 leaves 48 of the model's 2048 context tokens .* 1536$"):
        check_max_tokens(2000, 2048)


# -- the panel's drawing ------------------------------------------------------------


def test_sparkline_marks_the_threshold_and_the_points_past_it():
    # A scale of 230 (the spike plus headroom) over 3 rows x 8 levels: the threshold of 100 is in the middle row.
    rows = sparkline_cells([10.0, 200.0, 0.0], threshold=100.0, num_rows=3, is_high_bad=True)
    assert rows == [
        [(" ", "empty"), ("▅", "bad"), (" ", "empty")],
        [(THRESHOLD_CHAR, "threshold"), ("█", "bad"), (THRESHOLD_CHAR, "threshold")],
        [("▁", "bar"), ("█", "bad"), (" ", "empty")],
    ]
    low_speed = sparkline_cells([5.0, 50.0], threshold=10.0, num_rows=2, is_high_bad=False)
    assert low_speed[1][0][1] == "bad" and low_speed[1][1][1] == "bar"  # tokens/s: below the floor is bad


def test_gauge_shows_any_use_and_never_overflows():
    assert gauge_cells(0.0, 10) == (0, 10)
    assert gauge_cells(0.001, 10) == (1, 9)
    assert gauge_cells(0.5, 10) == (5, 5)
    assert gauge_cells(1.7, 10) == (10, 0)


# -- loading -------------------------------------------------------------------------


def test_loading_reports_stages_and_keeps_warnings_on_the_terminal(monkeypatch, caplog):
    from lowvram.tui import backend

    def fake_engine(model, profile, **kwargs):
        log = logging.getLogger("lowvram")
        log.info("weights loaded")
        log.warning("odd generation_config.json")
        return "engine"

    monkeypatch.setattr(backend, "LLMEngine", fake_engine)
    caplog.set_level(logging.WARNING)
    stages = []
    assert backend.load_engine(EngineSpec(None), stages.append) == "engine"
    assert stages[0].startswith("resolving bundled demo model") and stages[1:] == [
        "weights loaded",
        "odd generation_config.json",
    ]
    assert [r.getMessage() for r in caplog.records] == ["odd generation_config.json"]  # INFO stays off the terminal
    assert logging.getLogger("lowvram").propagate


# -- the plain line mode ---------------------------------------------------------------


def test_plain_mode_keeps_a_multi_turn_chat_and_obeys_commands(model_args, tmp_path):
    model = model_args[1] if model_args else None
    stdin = io.StringIO(
        f"What is 17 + 25?\n/max 4\n/max 100000\n/system Be brief.\nAnd 2 + 2?\n/nonsense\n/save {tmp_path}/t.json\n"
    )
    stdout, stderr = io.StringIO(), io.StringIO()
    status = run_plain(EngineSpec(model, "cpu"), ChatSettings(max_tokens=16), stdin=stdin, stdout=stdout, stderr=stderr)
    assert status == 1  # the unknown command and the max tokens past the context failed; the rest went on
    assert "unknown command /nonsense" in stderr.getvalue() and "max tokens 100000 leaves 0" in stderr.getvalue()
    saved = load_transcript(tmp_path / "t.json")
    assert [t.role for t in saved.turns] == ["user", "assistant", "user", "assistant"]
    assert saved.settings == ChatSettings(system_prompt="Be brief.", max_tokens=4)
    assert stdout.getvalue() == "".join(t.content + "\n" for t in saved.turns if t.role == "assistant")


def test_plain_mode_is_automatic_without_a_terminal(model_args, monkeypatch, capsys):
    from lowvram.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 17 + 25?\n"))
    assert main(["chat", *model_args, "--profile", "cpu", "-n", "8"]) == 0  # no --plain: stdout is not a terminal
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and "Traceback" not in err


def test_chat_errors_are_one_line_and_exit_2(tmp_path, capsys):
    from lowvram.cli import main

    assert main(["chat", "--plain", "--model", str(tmp_path / "nothing-here")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowvram: error: model directory") and "Traceback" not in err
    assert main(["chat", "--plain", "--temperature", "-3"]) == 2
    assert "temperature = -3.0 is invalid" in capsys.readouterr().err


def test_piped_lines_get_the_models_answers_from_the_binary(model_args):
    """`echo "..." | lowvram chat --plain`: one reply per line on stdout, the same as the library's."""
    questions = ["What is 17 + 25?", "Sort these numbers from smallest to largest: 42, 7, 19, 88, 3"]
    llm = LLM(model_args[1] if model_args else None, profile="cpu")
    from lowvram.core.sampling_params import SamplingParams

    history, expected = [], []
    for question in questions:
        history.append({"role": "user", "content": question})
        answer = llm.chat(history, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
        history.append({"role": "assistant", "content": answer})
        expected.append(answer)
    result = subprocess.run(
        [*chat_argv(), "--plain", *model_args, "--profile", "cpu", "-n", "16"],
        input="\n".join(questions) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(answer + "\n" for answer in expected)
    assert "Traceback" not in result.stderr


# -- the real binary in a terminal ---------------------------------------------------------


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_the_chat_runs_in_a_real_terminal(model_args):
    env = dict(os.environ, LOWVRAM_CHAT_CMD=" ".join(chat_argv()))
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "tmux_chat_check.sh"), *model_args, "--profile", "cpu"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "tmux_chat_check: ok" in result.stdout


# -- docs -------------------------------------------------------------------------------


def test_every_key_binding_is_documented():
    pytest.importorskip("textual")
    from lowvram.tui.app import ChatApp, key_label
    from lowvram.tui.conversation import COMMANDS

    for doc in (ROOT / "docs" / "chat.md", ROOT / "README.md"):
        text = doc.read_text()
        for binding in ChatApp.BINDINGS:
            assert re.search(rf"`{re.escape(key_label(binding.key))}`", text), f"{doc.name} lacks {binding.key}"
        for name in COMMANDS:
            assert f"/{name}" in text, f"{doc.name} lacks /{name}"
