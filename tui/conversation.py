"""A chat as the terminal UI and the plain mode share it: its settings, its turns, its slash commands, and its
transcript files (Markdown for people, JSON that `load_transcript` reads back exactly, settings included)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lowvram.core.sampling_params import SamplingParams
from lowvram.errors import ConfigError, RequestError
from lowvram.paths import user_data_dir

TRANSCRIPT_FORMAT = "lowvram-chat-transcript"
TRANSCRIPT_VERSION = 1
ROLES = ("user", "assistant")


@dataclass(frozen=True)
class ChatSettings:
    """What shapes the replies (F2/F3, /system, /temp, /max); system_prompt "" is none, temperature 0 greedy."""

    system_prompt: str = ""
    temperature: float = 0.0
    max_tokens: int = 512

    def __post_init__(self) -> None:
        self.sampling_params()  # raises RequestError naming the bad field

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens)

    def describe(self) -> str:
        system = "set" if self.system_prompt else "none"
        return f"temperature {self.temperature:g} · max {self.max_tokens} tokens · system prompt {system}"

    def with_changes(self, **changes) -> ChatSettings:
        return replace(self, **changes)


@dataclass
class Turn:
    """One message. `finish_reason` (assistant only): stop, length, abort. `reasoning`: a reasoning model's
    thinking before its answer (kept in transcripts; the chat template leaves it out of the next prompt)."""

    role: str
    content: str
    finish_reason: str | None = None
    reasoning: str | None = None


@dataclass
class Conversation:
    settings: ChatSettings = field(default_factory=ChatSettings)
    turns: list[Turn] = field(default_factory=list)
    model: str = ""
    profile: str = ""
    started_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    def messages(self) -> list[dict]:
        """The conversation as chat-template messages, system prompt first."""
        system = [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []
        return system + [{"role": t.role, "content": t.content} for t in self.turns]

    def cleared(self) -> Conversation:
        """A new chat with the same settings."""
        return Conversation(self.settings, model=self.model, profile=self.profile)

    def to_json(self) -> dict:
        turns = [{k: v for k, v in asdict(t).items() if v is not None} for t in self.turns]
        head = {"format": TRANSCRIPT_FORMAT, "version": TRANSCRIPT_VERSION}
        head.update(model=self.model, profile=self.profile, started_at=self.started_at)
        return {**head, "settings": asdict(self.settings), "turns": turns}

    def to_markdown(self) -> str:
        s = self.settings
        lines = [
            f"# lowvram chat, {self.started_at.replace('T', ' ')}",
            "",
            f"model: {self.model or '-'} | profile: {self.profile or '-'} | temperature: {s.temperature:g} | "
            f"max tokens: {s.max_tokens}",
            "",
        ]
        if s.system_prompt:
            lines += ["## System", "", s.system_prompt, ""]
        for turn in self.turns:
            lines += ["## You" if turn.role == "user" else "## Assistant", ""]
            if turn.reasoning:
                lines += ["<details><summary>Reasoning</summary>", "", turn.reasoning, "", "</details>", ""]
            lines += [turn.content, ""]
            if turn.finish_reason in ("abort", "length"):
                lines += ["*(stopped)*" if turn.finish_reason == "abort" else "*(cut at max tokens)*", ""]
        return "\n".join(lines)


def default_transcript_dir() -> Path:
    return user_data_dir("transcripts")  # $XDG_DATA_HOME/lowvram/transcripts, else ~/.local/share/...


def save_transcript(conversation: Conversation, target: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write the conversation as Markdown and JSON; returns (markdown_path, json_path).
    target: a directory (timestamped file names), a .md or .json file name, or None for the default directory."""
    path = Path(target).expanduser() if target else default_transcript_dir()
    is_file = path.suffix.lower() in (".md", ".json")
    stem = path.with_suffix("") if is_file else path / ("chat-" + time.strftime("%Y%m%d-%H%M%S"))
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        markdown_path, json_path = stem.with_suffix(".md"), stem.with_suffix(".json")
        markdown_path.write_text(conversation.to_markdown(), encoding="utf-8")
        json_path.write_text(json.dumps(conversation.to_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"could not save the transcript to {stem.parent}: {exc.strerror or exc}; give a writable path (/save PATH)"
        ) from None
    return markdown_path, json_path


def load_transcript(path: str | os.PathLike) -> Conversation:
    """Read a JSON transcript written by `save_transcript` (a .md path reads its .json twin)."""
    path = Path(path).expanduser()
    if path.suffix.lower() == ".md":
        path = path.with_suffix(".json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"transcript {path} does not exist; saved chats are in {default_transcript_dir()}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"could not read transcript {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != TRANSCRIPT_FORMAT:
        raise ConfigError(
            f'{path} is not a lowvram chat transcript (no "format": "{TRANSCRIPT_FORMAT}"); '
            "load a .json file written by the chat's save"
        )
    if data.get("version") != TRANSCRIPT_VERSION:
        raise ConfigError(
            f"{path} has transcript version {data.get('version')!r}; this lowvram reads version {TRANSCRIPT_VERSION}"
        )
    settings, allowed = data.get("settings", {}), sorted(ChatSettings.__dataclass_fields__)
    if unknown := set(settings) - set(allowed):
        raise ConfigError(f"{path}: unknown settings {sorted(unknown)}; allowed: {allowed}")
    turns = data.get("turns", [])
    for i, raw in enumerate(turns):
        is_text = isinstance(raw, dict) and all(isinstance(raw.get(k, ""), str) for k in ("content", "reasoning"))
        if not is_text or raw.get("role") not in ROLES or "content" not in raw:
            raise ConfigError(f"{path}: turn {i} needs a role in {ROLES} and a text content, got {raw!r}")
    turns = [Turn(raw["role"], raw["content"], raw.get("finish_reason"), raw.get("reasoning")) for raw in turns]
    strings = [str(data.get(key, "")) for key in ("model", "profile", "started_at")]
    return Conversation(ChatSettings(**settings), turns, *strings)


# -- slash commands typed in the chat input -------------------------------------------
# name -> (argument, what it does); the help screen and `/help` print this table.
COMMANDS: dict[str, tuple[str, str]] = {
    "help": ("", "list the commands and key bindings"),
    "new": ("", "start a new chat (settings are kept)"),
    "stop": ("", "stop the reply now and free its KV pages"),
    "save": ("[PATH]", "save the transcript as Markdown and JSON"),
    "load": ("PATH", "load a JSON transcript and continue it"),
    "system": ("[TEXT]", "set the system prompt (no text clears it)"),
    "temp": ("VALUE", "set the temperature (0 = greedy)"),
    "max": ("N", "set the most tokens per reply"),
    "profile": ("NAME|PATH", "reload the model under another profile"),
    "quit": ("", "leave the chat"),
}
SETTING_COMMANDS = {"system": ("system_prompt", str), "temp": ("temperature", float), "max": ("max_tokens", int)}


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""


def parse_command(text: str) -> Command | None:
    """A Command for '/name arg', None for an ordinary message ('//x' sends '/x')."""
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    name = name.strip().lower()
    if name not in COMMANDS:
        raise RequestError(f"unknown command /{name}; /help lists the commands")
    usage, arg = COMMANDS[name][0], arg.strip()
    if usage and not usage.startswith("[") and not arg:
        raise RequestError(f"/{name} needs {usage}")
    return Command(name, arg)


def message_text(text: str) -> str:
    """The message a line sends: a leading '//' escapes a literal '/'."""
    return text[1:] if text.startswith("//") else text


def setting_changes(command: Command) -> dict | None:
    """The ChatSettings field a /system, /temp or /max command sets; None for other commands."""
    if command.name not in SETTING_COMMANDS:
        return None
    field, kind = SETTING_COMMANDS[command.name]
    try:
        return {field: kind(command.arg)}
    except ValueError:
        raise RequestError(f"/{command.name} needs a number, got {command.arg!r}") from None


def max_reply_tokens(max_model_len: int) -> int:
    """The most tokens a reply may ask for: a quarter of the model's context stays for the prompt and history."""
    return max_model_len * 3 // 4


def check_max_tokens(max_tokens: int, max_model_len: int) -> None:
    """Refuse a max tokens that would leave the conversation too little of the context (the reply would be cut
    at the context's end, or the next prompt would not fit at all)."""
    if max_tokens > (limit := max_reply_tokens(max_model_len)):
        raise RequestError(
            f"max tokens {max_tokens} leaves {max(max_model_len - max_tokens, 0)} of the model's {max_model_len} "
            f"context tokens for the prompt and the conversation; use at most {limit}"
        )


def dropped_turns_notice(num_dropped_turns: int, max_model_len: int) -> str:
    """What the chat says when older turns are left out of the prompt (lowvram.core.context's policy)."""
    turns = "turn" if num_dropped_turns == 1 else "turns"
    return f"{num_dropped_turns} older {turns} dropped to fit the {max_model_len}-token context"


def help_lines() -> list[tuple[str, str]]:
    return [(f"/{name} {arg}".rstrip(), doc) for name, (arg, doc) in COMMANDS.items()]
