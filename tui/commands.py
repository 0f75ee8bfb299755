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
    arg = arg.strip()
    if COMMANDS[name][0] and not COMMANDS[name][0].startswith("[") and not arg:
        raise RequestError(f"/{name} needs {COMMANDS[name][0]}")
    return Command(name, arg)


def message_text(text: str) -> str:
    """The message a line sends: a leading '//' escapes a literal '/'."""
    return text[1:] if text.startswith("//") else text


def parse_number(command: Command, kind: type):
    try:
        return kind(command.arg)
    except ValueError:
        raise RequestError(f"/{command.name} needs a number, got {command.arg!r}") from None


def setting_changes(command: Command) -> dict | None:
    """ChatSettings fields a /system, /temp or /max command sets; None for other commands."""
    if command.name == "system":
        return {"system_prompt": command.arg}
    if command.name == "temp":
        return {"temperature": parse_number(command, float)}
    if command.name == "max":
        return {"max_tokens": parse_number(command, int)}
    return None


def help_lines() -> list[tuple[str, str]]:
    return [(f"/{name} {arg}".rstrip(), doc) for name, (arg, doc) in COMMANDS.items()]
