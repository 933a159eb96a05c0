"""The interactive `dgemma run` session (docs/compat.md#repl): `>>> ` prompts, `\"\"\"` multi-line input, history,
slash commands, Ctrl-C to stop an answer, Ctrl-D to leave. Conversations go over `/api/chat`.

Line editing and history are GNU readline's (Ctrl-A/E, Alt-B/F, Ctrl-K/U/W, Ctrl-L; bracketed paste keeps pasted
newlines in one message). The history file is `~/.dgemma/history` unless `DGEMMA_NOHISTORY` or `/set nohistory`.
"""
from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from dgemma_cli import env, wire
from dgemma_cli.client import ApiError, Client
from dgemma_cli.errors import DgemmaError
from dgemma_cli.prompt_images import extract_images, has_vision
from dgemma_cli.session import Output, RunSettings, ensure_model, stream_answer
from dgemma_cli.ui import Spinner

PROMPT = ">>> "
CONTINUATION = "... "
TRIPLE = '"""'
LISTED_PARAMETERS = (  # then one row per sampler setting (listed_parameters)
    ("seed", "<int>", "Random number seed (same seed, same answer)"),
    ("num_predict", "<int>", "Max number of tokens to predict (whole canvases are denoised)"),
    ("num_ctx", "<int>", "Set the context size"),
    ("temperature", "<float>", "0 makes every step argmax; other values are ignored (use diffusion_t_*)"),
    ("stop", "<string> <string> ...", "Set the stop parameters"),
)

HELP = """Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save your current session
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use \"\"\" to begin a multi-line message.
"""
HELP_SET = """Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set history           Enable history
  /set nohistory         Disable history
  /set wordwrap          Enable wordwrap
  /set nowordwrap        Disable wordwrap
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats
  /set think             Enable thinking
  /set nothink           Disable thinking
  /set visual            Show the canvas denoising live
  /set novisual          Plain streaming
"""
HELP_SHOW = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template
"""
HELP_SHORTCUTS = """Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line (Home)
  Ctrl + e            Move to the end of the line (End)
   Alt + b            Move back (left) one word
   Alt + f            Move forward (right) one word
  Ctrl + k            Delete the sentence after the cursor
  Ctrl + u            Delete the sentence before the cursor
  Ctrl + w            Delete the word before the cursor

  Ctrl + l            Clear the screen
  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit (/bye)
"""


def listed_parameters() -> list[tuple[str, str, str]]:
    """`/set parameter`'s list: (name, value kind, help), the sampler settings after the general parameters."""
    from dgemma_engine import settings

    return list(LISTED_PARAMETERS) + [(s.option, f"<{s.type.__name__}>", s.help) for s in settings.SAMPLER_SETTINGS]


class History:
    """readline history persisted to `~/.dgemma/history` (when enabled)."""

    def __init__(self, enabled: bool):
        try:
            import readline
        except ImportError:  # no readline (e.g. Windows): plain input()
            readline = None
        self.readline = readline
        self.path = Path.home() / ".dgemma" / "history"
        self.enabled = enabled and readline is not None
        if self.enabled:
            try:
                readline.read_history_file(str(self.path))
            except OSError:
                pass

    def save(self) -> None:
        if not self.enabled:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(str(self.path))
        except OSError:
            pass

    def line_buffer(self) -> str:
        return self.readline.get_line_buffer() if self.readline is not None else ""


class Repl:
    def __init__(self, client: Client, settings: RunSettings, show: dict[str, Any], out: TextIO = sys.stdout,
                 read: Callable[[str], str] = input, answer: Callable[[str], Any] | None = None):
        self.client = client
        self.settings = settings
        self.show = show
        self.out = out
        self.read = read
        self.answer = answer  # a task model's front end (sudoku.py): it answers each message itself, with no chat
        self.messages: list[dict[str, str]] = []
        self.history = History(enabled=not env.NOHISTORY.get_or_default())  # unreadable: history on

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # ---- session ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        # Ctrl-C must stop an answer even when a parent started us with SIGINT ignored or blocked (both survive exec,
        # and Python then never raises KeyboardInterrupt): an interactive chat takes the default behaviour back.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self.preload()
        self.replay_model_messages()
        try:
            while True:
                try:
                    line = self.read_message()
                except EOFError:
                    self.say("")
                    return
                except KeyboardInterrupt:
                    self.say("" if self.history.line_buffer() else "\nUse Ctrl + d or /bye to exit.")
                    continue
                if not line.strip():
                    continue
                if line.lstrip().startswith("/"):
                    if self.command(line.strip()) == "exit":
                        return
                    continue
                if self.answer is not None:
                    self.task_message(line)
                else:
                    self.chat(line)
        finally:
            self.history.save()

    def preload(self) -> None:
        spinner = Spinner().start("")
        try:
            self.client.generate(self.settings.generate_request(""))
        finally:
            spinner.stop()

    def replay_model_messages(self) -> None:
        """The Modelfile's MESSAGEs: user turns printed as `>>> text`, assistant turns as answers."""
        for message in self.show.get("messages") or []:
            role, content = message.get("role"), message.get("content", "")
            if role == "user":
                self.say(PROMPT + content)
            elif role == "assistant":
                self.say(content + "\n")

    def read_message(self) -> str:
        """One message: a line, or a `\"\"\"` block running until a line that ends with `\"\"\"`."""
        line = self.read(PROMPT)
        stripped = line.lstrip()
        opener = None
        if stripped.startswith(TRIPLE):
            opener = ""
            first = stripped[len(TRIPLE):]
        elif stripped.startswith("/set system " + TRIPLE):
            opener = "/set system "
            first = stripped[len("/set system " + TRIPLE):]
        if opener is None:
            return line
        if first.endswith(TRIPLE):
            return opener + first[: -len(TRIPLE)]
        lines = [first] if first else []
        while True:
            more = self.read(CONTINUATION)
            if more.rstrip().endswith(TRIPLE):
                lines.append(more.rstrip()[: -len(TRIPLE)])
                break
            lines.append(more)
        text = "\n".join(lines)
        return opener + text if opener else text

    # ---- chat ------------------------------------------------------------------------------------------------------

    def conversation(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system is not None else []
        return system + self.messages

    def chat(self, text: str) -> None:
        message: dict[str, Any] = {"role": "user", "content": text}
        if has_vision(self.show):  # image files named in the line go with it (prompt_images.py)
            try:
                found = extract_images(text)
            except DgemmaError as exc:
                print(f"Error: {exc}", file=sys.stderr)
                return
            for path in found.added:
                print(f"Added image '{path}'", file=sys.stderr)  # stderr, as Ollama's CLI
            message = {"role": "user", "content": found.text, **({"images": found.images} if found.images else {})}
        self.messages.append(message)
        output = Output(self.settings, out=self.out)
        request = self.settings.chat_request(self.conversation(), progress=output.wants_progress(),
                                             preview=output.visual)
        chunks = self.client.chat_stream(request)
        try:
            final, answer = stream_answer(chunks, output)
        except KeyboardInterrupt:
            chunks.close()  # closes the HTTP response: the server stops at the next denoising step
            self.messages.pop()
            self.say("")
            return
        except DgemmaError as exc:
            chunks.close()
            self.messages.pop()
            print(f"Error: {exc}", file=sys.stderr)
            return
        if final is None:
            self.messages.pop()
            return
        self.messages.append({"role": "assistant", "content": answer})
        self.say("")

    def task_message(self, text: str) -> None:
        """One message to a task model: its front end shows the answer; an error is one line, and Ctrl-C stops it."""
        try:
            self.answer(text)
        except KeyboardInterrupt:
            self.say("")
            return
        except DgemmaError as exc:
            print(f"Error: {exc}", file=sys.stderr)
            return
        self.say("")

    # ---- slash commands --------------------------------------------------------------------------------------------

    def command(self, line: str) -> str | None:
        words = line.split()
        name = words[0].lower()
        if name in ("/bye", "/exit"):
            return "exit"
        if name in ("/?", "/help"):
            topic = words[1].lower() if len(words) > 1 else ""
            self.say({"set": HELP_SET, "show": HELP_SHOW, "shortcuts": HELP_SHORTCUTS}.get(topic, HELP))
        elif name == "/set":
            self.set_command(line, words[1:])
        elif name == "/show":
            self.show_command(words[1:])
        elif name == "/clear":
            self.messages = []
            self.say("Cleared conversation context")
        elif name == "/load":
            self.load_command(words[1:])
        elif name == "/save":
            self.save_command(words[1:])
        else:
            self.say(f"Unknown command '{words[0]}'. Type /? for help")
        return None

    def set_command(self, line: str, args: list[str]) -> None:
        if not args:
            self.say(HELP_SET)
            return
        what = args[0].lower()
        toggles = {
            "history": ("history", True), "nohistory": ("history", False),
            "wordwrap": ("wordwrap", True), "nowordwrap": ("wordwrap", False),
            "verbose": ("verbose", True), "quiet": ("verbose", False),
            "visual": ("visual", True), "novisual": ("visual", False),
            "preview": ("visual", True), "nopreview": ("visual", False),
        }
        if what in toggles:
            attribute, value = toggles[what]
            if attribute == "history":
                self.history.enabled = value and self.history.readline is not None
            else:
                setattr(self.settings, attribute, value)
            self.say(f"Set '{what}' mode.")
        elif what == "parameter":
            self.set_parameter(args[1:])
        elif what == "system":
            text = line.split(None, 2)[2] if len(args) > 1 else ""
            self.settings.system = text.strip().strip('"')
            self.say("Set system message.")
        elif what == "think":
            level = args[1].lower() if len(args) > 1 else "true"
            if level not in ("true", "low", "medium", "high", "max"):
                self.say(f'Invalid think value: "{args[1]}" (must be true, false, high, medium, low, or max)')
                return
            self.settings.think = True if level == "true" else level
            self.say("Set 'think' mode." if level == "true" else f"Set 'think' mode to '{level}'.")
        elif what == "nothink":
            self.settings.think = False
            self.say("Set 'nothink' mode.")
        elif what == "format":
            if len(args) < 2 or args[1] != "json":
                self.say("Invalid or missing format. For 'json' mode use '/set format json'")
                return
            self.settings.format = "json"
            self.say("Set format to 'json' mode.")
        elif what == "noformat":
            self.settings.format = None
            self.say("Disabled format.")
        else:
            self.say(f"Unknown command '/set {args[0]}'. Type /? for help")

    def set_parameter(self, args: list[str]) -> None:
        from dgemma_cli.modelfile import parse_parameter

        if not args:
            usage = [(f"/set parameter {name} {kind}", text) for name, kind, text in listed_parameters()]
            width = max(len(u) for u, _ in usage)
            self.say("Available Parameters:\n" + "\n".join(f"  {u:<{width}}    {text}" for u, text in usage))
            return
        if len(args) < 2:
            self.say(f"Couldn't set parameter: \"missing value for '{args[0]}'\"")
            return
        name, values = args[0], args[1:]
        try:
            if name == "stop":
                typed: Any = [parse_parameter(name, v) for v in values]
            else:
                typed = parse_parameter(name, " ".join(values))
        except DgemmaError as exc:
            self.say(f'Couldn\'t set parameter: "{exc}"')
            return
        self.settings.options[name] = typed
        shown = ", ".join(values) if name == "stop" else " ".join(values)
        self.say(f"Set parameter '{name}' to '{shown}'")

    def show_command(self, args: list[str]) -> None:
        if not args:
            self.say(HELP_SHOW)
            return
        what = args[0].lower()
        try:
            show = self.client.show(self.settings.model)
        except DgemmaError as exc:
            self.say(f"error: couldn't get model: {exc}")
            return
        if what == "info":
            from dgemma_cli.cmd_store import show_info_text  # the blocks of `dgemma show`

            self.say(show_info_text(show))
        elif what == "license":
            self.say(show.get("license") or "No license was specified for this model.")
        elif what == "modelfile":
            self.say(show.get("modelfile") or "")
        elif what == "parameters":
            self.say("Model defined parameters:")
            self.say(show.get("parameters") or "No parameters were specified for this model.")
            if self.settings.options:
                from dgemma_cli.gotext import go_value

                self.say("\nUser defined parameters:")
                for key in sorted(self.settings.options):
                    value = self.settings.options[key]
                    for item in value if isinstance(value, list) else [value]:  # `stop` repeats its key per value
                        self.say(f"{key:<30} {go_value(item)}")
        elif what == "system":
            self.say(self.settings.system or show.get("system") or "No system message was specified for this model.")
        elif what == "template":
            self.say(show.get("template") or "No prompt template was specified for this model.")
        else:
            self.say(f"Unknown command '/show {args[0]}'. Type /? for help")

    def load_command(self, args: list[str]) -> None:
        if len(args) != 1:
            self.say("Usage:\n  /load <modelname>")
            return
        model = args[0]
        self.say(f"Loading model '{model}'")
        try:
            self.show = ensure_model(self.client, model, pull=False)
        except ApiError as exc:
            self.say(f"Couldn't find model '{model}'" if exc.status == 404 else f"error: {exc}")
            return
        except DgemmaError as exc:
            self.say(f"error: {exc}")
            return
        self.settings.model = model
        self.messages = []
        self.preload()

    def save_command(self, args: list[str]) -> None:
        from dgemma_cli.names import ModelName

        if len(args) != 1:
            self.say("Usage:\n  /save <modelname>")
            return
        name = args[0]
        try:
            ModelName.parse(name)
        except DgemmaError:
            self.say(f"error: The model name '{name}' is invalid")
            return
        request = wire.CreateRequest(model=name, from_=self.settings.model, messages=self.messages,
                                     system=self.settings.system, parameters=dict(self.settings.options) or None)
        try:
            for _status in self.client.create(request):
                pass
        except DgemmaError as exc:
            self.say(f"error: {exc}")
            return
        self.say(f"Created new model '{name}'")
