"""The line-oriented chat for scripts and pipes (`echo "hi" | lowvram chat --plain`): each input line is a
message, its reply streams to stdout; notes, prompts and errors go to stderr, and so does a reasoning model's
thinking (unless hidden), so stdout holds only answers. Slash commands work as in the terminal UI; Ctrl-C
stops the reply being written (freeing its pages) and the chat goes on."""

from __future__ import annotations

import itertools
import sys
from functools import partial

from lowvram.engine.engine import LLMEngine
from lowvram.errors import LowvramError
from lowvram.tui import conversation as chat
from lowvram.tui.backend import (
    BUNDLED_MODEL_LABEL,
    EngineSpec,
    ReplyText,
    chat_input,
    fit_to_context,
    load_engine,
    reasoning_parser,
)


class PlainChat:
    """One conversation against one engine, read from and written to text streams."""

    def __init__(self, spec, settings, transcript_dir, stdin, stdout, stderr, is_reasoning_hidden=False):
        self.spec, self.transcript_dir, self.is_reasoning_hidden = spec, transcript_dir, is_reasoning_hidden
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.is_interactive = stdin.isatty()
        self.engine = self._load(spec)
        self.conversation = chat.Conversation(settings, model=spec.model_label, profile=self.engine.profile.name)
        self._request_ids = itertools.count()
        self.num_dropped_turns = 0  # older turns left out of the last prompt to fit the context

    def note(self, text: str) -> None:
        print(f"lowvram: {text}", file=self.stderr, flush=True)

    def _load(self, spec: EngineSpec) -> LLMEngine:
        if spec.model is None:
            demo = "a small model trained for lowvram's tests, not a real DeepSeek model"
            self.note(f"using the {BUNDLED_MODEL_LABEL} ({demo}); pass --model for a real one")
        if self.is_interactive:
            self.note(f"loading {spec.model_label}...")
        # Stages that take minutes (quantizing, converting a GGUF file) say so, with their progress
        return load_engine(spec, on_stage=self.note if spec.is_quantized_on_load else lambda text: None)

    def run(self) -> int:
        """Chat until end of input or /quit; 1 if any line failed, else 0."""
        num_failed = 0
        while True:
            if self.is_interactive:
                print("you> ", end="", file=self.stderr, flush=True)
            if not (line := self.stdin.readline()):
                return 1 if num_failed else 0
            if not (text := line.strip()):
                continue
            try:
                command = chat.parse_command(text)
                if command is None:
                    self.reply(chat.message_text(text))
                elif command.name == "quit":
                    return 1 if num_failed else 0
                else:
                    self.run_command(command)
            except LowvramError as exc:
                print(f"lowvram: error: {exc}", file=self.stderr, flush=True)
                num_failed += 1

    def reply(self, text: str) -> str:
        """Stream the reply to `text` to stdout; returns its finish reason."""
        self.conversation.turns.append(chat.Turn("user", text))
        request_id = f"plain-{next(self._request_ids)}"
        params = self.conversation.settings.sampling_params()
        try:
            messages, fit = fit_to_context(self.engine, self.conversation.messages(), params.max_tokens)
            if fit.num_dropped_turns != self.num_dropped_turns and fit.num_dropped_turns:
                self.note(chat.dropped_turns_notice(fit.num_dropped_turns, self.engine.max_model_len))
            self.num_dropped_turns = fit.num_dropped_turns
            self.engine.add_request(
                request_id, params=params, **chat_input(self.engine.tokenizer.has_chat_template, messages)
            )
        except LowvramError:
            self.conversation.turns.pop()
            raise
        reply, finish_reason = ReplyText(partial(reasoning_parser, self.engine.tokenizer)), "abort"
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    reasoning, answer, thought = reply.add(out)
                    self.show_reasoning(reasoning, thought)
                    self.stdout.write(answer)
                    self.stdout.flush()
                    if out.finished:
                        finish_reason = out.outputs[0].finish_reason or "stop"
        except KeyboardInterrupt:
            self.engine.abort_request(request_id)
            self.show_reasoning("", reply.thought() if reply.reasoning and reply.thought_s is None else None)
            self.note("stopped")
        self.stdout.write("\n")
        self.stdout.flush()
        turn = chat.Turn("assistant", reply.answer, finish_reason, reply.reasoning if reply.reasoning else None)
        self.conversation.turns.append(turn)
        return finish_reason

    def show_reasoning(self, text: str, thought: str | None) -> None:
        """A reasoning model's thinking on stderr as it comes, ended by how long it took."""
        if self.is_reasoning_hidden:
            return
        self.stderr.write(text)
        if thought is not None:
            self.stderr.write("\n")
            self.note(thought)
        self.stderr.flush()

    def run_command(self, command) -> None:
        if (changes := chat.setting_changes(command)) is not None:
            if "max_tokens" in changes:
                chat.check_max_tokens(changes["max_tokens"], self.engine.max_model_len)
            self.conversation.settings = self.conversation.settings.with_changes(**changes)
            self.note(self.conversation.settings.describe())
        elif command.name == "help":
            print("\n".join(f"  {usage:18} {doc}" for usage, doc in chat.help_lines()), file=self.stderr)
        elif command.name == "new":
            self.conversation = self.conversation.cleared()
            self.note("new chat")
        elif command.name == "stop":
            self.note("nothing is being written; Ctrl-C stops a reply")
        elif command.name == "save":
            markdown_path, json_path = chat.save_transcript(self.conversation, command.arg or self.transcript_dir)
            self.note(f"saved {markdown_path} and {json_path}")
        elif command.name == "load":
            loaded = chat.load_transcript(command.arg)
            loaded.model, loaded.profile = self.conversation.model, self.conversation.profile
            self.conversation = loaded
            self.note(f"loaded {len(loaded.turns)} messages")
        elif command.name == "profile":
            old_spec, self.spec = self.spec, self.spec.with_profile(command.arg)
            self.engine = None  # let the old weights go before the new ones load
            try:
                self.engine = self._load(self.spec)
            except LowvramError:
                self.spec = old_spec
                self.engine = self._load(old_spec)
                raise
            self.conversation.profile = self.engine.profile.name
            self.note(f"profile {self.engine.profile.name}")


def run_plain(
    spec: EngineSpec,
    settings: chat.ChatSettings,
    *,
    transcript_dir=None,
    stdin=None,
    stdout=None,
    stderr=None,
    is_reasoning_hidden=False,
):
    """Chat line by line (the standard streams by default); the exit status of `PlainChat.run`."""
    streams = (stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr)
    return PlainChat(spec, settings, transcript_dir, *streams, is_reasoning_hidden).run()
