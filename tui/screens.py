"""Screens over the chat: loading, errors, help, and the small dialogs for settings."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Input, Label, LoadingIndicator, OptionList, Static
from textual.widgets.option_list import Option

from lowvram import errors
from lowvram.tui.conversation import ChatSettings, help_lines

# What to try next, by error type; the error's own message names the value at fault.
ERROR_HINTS = {
    errors.OutOfMemoryError: "Pick a smaller profile (F4), or lower --max-model-len.",
    errors.ModelLoadError: "Check that --model names a Hugging Face model directory with config.json, "
    "safetensors weights and tokenizer files.",
    errors.UnsupportedModelError: "lowvram runs Llama- and Qwen2-architecture DeepSeek checkpoints; "
    "pass one with --model.",
    errors.ConfigError: "`lowvram profiles` lists the built-in profiles; "
    "`lowvram profiles --fields` explains every field.",
    errors.RequestError: "Shorten the conversation (Ctrl+N starts a new chat) or change the settings (F3).",
}


def describe_error(error: BaseException) -> tuple[str, str]:
    """(message, suggested fix) for a dialog; never a traceback."""
    if not isinstance(error, errors.LowvramError):
        bug = "This is a bug in lowvram. Run `lowvram -v chat --plain` to see the details, and report them."
        return f"{type(error).__name__}: {error}", bug
    return str(error), next((hint for kind, hint in ERROR_HINTS.items() if isinstance(error, kind)), "")


class LoadingScreen(Screen):
    """Shown while the model loads; the stage line is the engine's own progress report."""

    def __init__(self, model_label: str, profile: str | None):
        super().__init__()
        self.title_text = f"Loading {model_label} · profile {profile or 'default for this machine'}"
        self._started = time.monotonic()

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Label(self.title_text, id="loading-title", markup=False)
            yield LoadingIndicator()
            yield Static("", id="loading-stage", markup=False)
            yield Static("", id="loading-elapsed")

    def on_mount(self) -> None:
        elapsed = self.query_one("#loading-elapsed", Static)
        self.set_interval(0.5, lambda: elapsed.update(f"{time.monotonic() - self._started:.0f} s"))


class Dialog(ModalScreen):
    """A modal screen that Esc dismisses with None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def action_cancel(self) -> None:
        self.dismiss(None)


class ErrorDialog(ModalScreen[str]):
    """An error as a readable dialog: what happened, what to do, and buttons; dismissed with the button id."""

    BINDINGS = [Binding("escape", "dismiss_default", "Close")]

    def __init__(self, title: str, error: BaseException, buttons: list[tuple[str, str]]):
        super().__init__()
        self.title_text, self.buttons = title, buttons
        self.message, self.hint = describe_error(error)

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box"):
            yield Label(self.title_text, id="error-title", markup=False)
            yield Static(self.message, id="error-message", markup=False)
            if self.hint:
                yield Static("Fix: " + self.hint, id="error-hint", markup=False)
            with Horizontal(id="error-buttons"):
                for button_id, label in self.buttons:
                    yield Button(label, id=button_id)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)

    def action_dismiss_default(self) -> None:
        self.dismiss(self.buttons[-1][0])


class HelpScreen(Dialog):
    """Every key binding and slash command."""

    BINDINGS = [Binding("escape,f1,q", "cancel", "Close")]

    def __init__(self, bindings: list[tuple[str, str]]):
        super().__init__()
        self.bindings = bindings

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Label("Keys and commands", id="help-title")
            yield DataTable(id="help-table", show_cursor=False, zebra_stripes=True)
            yield Static("Esc closes this help", id="help-footer")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("key or command", "what it does")
        for key, doc in self.bindings + help_lines():
            table.add_row(key, doc)


class TextPrompt(Dialog):
    """Ask for one line of text, optionally offering choices to pick from. Dismissed with None on Esc."""

    AUTO_FOCUS = "#prompt-input"

    def __init__(self, title: str, value: str = "", *, placeholder: str = "", choices: list[tuple[str, str]] = ()):
        super().__init__()
        self.title_text, self.value, self.placeholder, self.choices = title, value, placeholder, choices

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt-box", classes="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            if self.choices:
                yield OptionList(*(Option(label, id=value) for value, label in self.choices), id="prompt-choices")
            yield Input(self.value, placeholder=self.placeholder, id="prompt-input")
            yield Static("Enter accepts · Esc cancels", classes="dialog-help")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)


class SettingsDialog(Dialog):
    """Temperature and max tokens; a bad value is named under the fields and nothing changes."""

    AUTO_FOCUS = "#temperature"

    def __init__(self, settings: ChatSettings):
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-box", classes="dialog"):
            yield Label("Reply settings", classes="dialog-title")
            yield Label("temperature (0 = greedy)")
            yield Input(f"{self.settings.temperature:g}", id="temperature")
            yield Label("max tokens per reply")
            yield Input(str(self.settings.max_tokens), id="max-tokens")
            yield Static("", id="settings-error", markup=False)
            yield Static("Enter saves · Esc cancels", classes="dialog-help")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        temperature = self.query_one("#temperature", Input).value
        max_tokens = self.query_one("#max-tokens", Input).value
        try:
            self.dismiss(self.settings.with_changes(temperature=float(temperature), max_tokens=int(max_tokens)))
        except ValueError:
            self.query_one("#settings-error", Static).update("temperature needs a number and max tokens a whole number")
        except errors.LowvramError as exc:
            self.query_one("#settings-error", Static).update(str(exc))
