"""A chat conversation: its settings, its turns, and its transcript files.

A transcript is saved twice: Markdown for people, JSON for `load_transcript`,
which gives back exactly what was saved (settings included), so a chat can be
picked up where it was left.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lowvram.core.sampling_params import SamplingParams
from lowvram.errors import ConfigError
from lowvram.paths import user_data_dir

TRANSCRIPT_FORMAT = "lowvram-chat-transcript"
TRANSCRIPT_VERSION = 1
ROLES = ("user", "assistant")


@dataclass(frozen=True)
class ChatSettings:
    """What shapes the replies; changed with F2/F3 or /system, /temp, /max.

    system_prompt: sent first through the chat template ("" = none).
    temperature: 0 = greedy (the same question gets the same answer); higher = more varied.
    max_tokens: the longest reply in tokens; a reply cut here ends with "max tokens".
    """

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
    """One message. `finish_reason` (assistant only): stop, length, abort."""

    role: str
    content: str
    finish_reason: str | None = None


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
        return {
            "format": TRANSCRIPT_FORMAT,
            "version": TRANSCRIPT_VERSION,
            "model": self.model,
            "profile": self.profile,
            "started_at": self.started_at,
            "settings": asdict(self.settings),
            "turns": [{k: v for k, v in asdict(t).items() if v is not None} for t in self.turns],
        }

    @classmethod
    def from_json(cls, data: dict, source: str = "transcript") -> Conversation:
        if not isinstance(data, dict) or data.get("format") != TRANSCRIPT_FORMAT:
            raise ConfigError(
                f'{source} is not a lowvram chat transcript (no "format": "{TRANSCRIPT_FORMAT}"); '
                "load a .json file written by the chat's save"
            )
        if data.get("version") != TRANSCRIPT_VERSION:
            raise ConfigError(
                f"{source} has transcript version {data.get('version')!r}; this lowvram reads version "
                f"{TRANSCRIPT_VERSION}"
            )
        settings_data = data.get("settings", {})
        unknown = set(settings_data) - set(ChatSettings.__dataclass_fields__)
        if unknown:
            raise ConfigError(
                f"{source}: unknown settings {sorted(unknown)}; allowed: {sorted(ChatSettings.__dataclass_fields__)}"
            )
        turns = []
        for i, raw in enumerate(data.get("turns", [])):
            if not isinstance(raw, dict) or raw.get("role") not in ROLES or not isinstance(raw.get("content"), str):
                raise ConfigError(f"{source}: turn {i} needs a role in {ROLES} and a text content, got {raw!r}")
            turns.append(Turn(raw["role"], raw["content"], raw.get("finish_reason")))
        return cls(
            ChatSettings(**settings_data),
            turns,
            str(data.get("model", "")),
            str(data.get("profile", "")),
            str(data.get("started_at", "")),
        )

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
            lines += ["## You" if turn.role == "user" else "## Assistant", "", turn.content, ""]
            if turn.finish_reason in ("abort", "length"):
                lines += ["*(stopped)*" if turn.finish_reason == "abort" else "*(cut at max tokens)*", ""]
        return "\n".join(lines)


def default_transcript_dir() -> Path:
    """$XDG_DATA_HOME/lowvram/transcripts, else ~/.local/share/lowvram/transcripts."""
    return user_data_dir("transcripts")


def save_transcript(conversation: Conversation, target: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write the conversation as Markdown and JSON; returns (markdown_path, json_path).

    target: a directory (the files get a timestamped name), a file name whose
    extension is replaced by .md and .json, or None for `default_transcript_dir()`.
    """
    path = Path(target).expanduser() if target else default_transcript_dir()
    if path.suffix.lower() in (".md", ".json"):
        stem = path.with_suffix("")
    else:
        stem = path / ("chat-" + time.strftime("%Y%m%d-%H%M%S"))
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
    return Conversation.from_json(data, source=str(path))


def recent_transcripts(directory: Path | None = None, max_count: int = 20) -> list[Path]:
    """The newest JSON transcripts first."""
    directory = directory or default_transcript_dir()
    if not directory.is_dir():
        return []
    files = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return files[:max_count]
