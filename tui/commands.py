"""Slash commands typed in the chat input, shared by the terminal UI and the plain mode."""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.errors import RequestError

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


def help_lines() -> list[tuple[str, str]]:
    return [(f"/{name} {arg}".rstrip(), doc) for name, (arg, doc) in COMMANDS.items()]
