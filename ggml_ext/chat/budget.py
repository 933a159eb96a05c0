"""Time and size budgets for one chat-template render, enforced inside the jinja2 sandbox.

A chat template comes from a model file, a Modelfile or a request, i.e. from strangers, and its branches may depend
on the conversation (`{% if 'boom' in messages[-1].content %}`), so a test render at create time proves nothing about
the next request. Every render therefore runs under a `RenderBudget`: a wall-clock deadline, a cap on loop iterations
plus calls, a cap on the size of any one value the template builds and a cap on everything it produces in all.

The hooks that enforce it:
- the template's syntax tree is rewritten after parsing (`BudgetTransformer`): every `for` loop's iterable, every
  `~` concatenation and every list/tuple/dict literal goes through an internal filter that counts and measures;
- `BudgetedSandbox.call` (every call a template makes), `call_binop` (`*`, `**`, `+`, `%`), the `str.format`
  wrapper, `finalize` (every `{{ ... }}`) and a wrapper around every filter check sizes before amplifying operations
  (widths, repetition, replace, join, indent) and measure results afterwards.
All wrapped filters take the context, which also keeps jinja2 from constant-folding them at compile time (outside any
budget). Over budget raises `BudgetExceeded` (a sandbox SecurityError) with one line naming the budget.

The limits every template is held to, Go or Jinja, are here too (`MAX_TEMPLATE_CHARS`, `MAX_TEMPLATE_DEPTH`,
`MAX_OUTPUT_CHARS`), with the errors of both renderers: a template's source is measured before it is parsed, its
nesting while it is parsed (`DepthLimitedParser`: jinja2's parser and code generator recurse), and its output while
it is produced (`OutputBudget`), never afterwards.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import string
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import jinja2
import jinja2.nodes as nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from dgemma_engine.errors import EngineError

# Both kinds of template. The largest real chat templates are about 17,000 characters and nest 29 levels (syntax tree)
# or 20 (the parser's count below): these leave room for them and none for a template built to exhaust the server.
MAX_TEMPLATE_CHARS = 131_072     # a template's source, at create, at pull and per request
MAX_TEMPLATE_DEPTH = 64          # nested blocks, brackets and operator chains (Go: nested actions)
MAX_OUTPUT_CHARS = 4_000_000     # one rendered prompt: beyond this it is an attack or a mistake

# Jinja renders.
MAX_RENDER_SECONDS = 1.0
MAX_STEPS = 2_000_000            # loop iterations + calls + filter applications in one render
MAX_VALUE_SIZE = 8_000_000       # characters + items of any one value a template builds
MAX_PRODUCED = 64_000_000        # characters + items produced over a whole render (bounds its memory)
MAX_INT_BITS = 1 << 16           # integers beyond ~20,000 digits
MAX_FORMAT_WIDTH = 100_000       # '%*d', '{:>N}', center(N), indent(N), ...
MAX_SLOW_FILTER_INPUT = 1 << 20  # wordwrap, urlize, striptags... are pure-Python scans: keep each call short

LOOP_FILTER = "_dgemma_budget_loop"
CONCAT_FILTER = "_dgemma_budget_concat"
VALUE_FILTER = "_dgemma_budget_value"


class ChatTemplateError(EngineError):
    """A chat template that cannot be compiled or rendered (syntax, sandbox violation, raise_exception, limits).

    `detail`: the underlying failure as `ExceptionType: message` (what `create`'s template check reports)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.detail = f"{type(cause).__name__}: {cause}" if cause is not None else message


class ChatTemplateBudgetError(ChatTemplateError):
    """A template over one of the limits of this module (its size, its nesting, a render's time, size or output):
    the input's fault as much as the template's, so the server answers it as a client error."""


class BudgetExceeded(jinja2.exceptions.SecurityError):
    """One render went over one of its budgets; the message is the one line users see."""


def check_source(text: str) -> None:
    """A template's source within MAX_TEMPLATE_CHARS (checked before anything parses it)."""
    if len(text) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateBudgetError(f"chat template is {len(text)} characters long (at most {MAX_TEMPLATE_CHARS})")


def too_deep() -> ChatTemplateBudgetError:
    return ChatTemplateBudgetError(f"chat template is nested more than {MAX_TEMPLATE_DEPTH} levels deep")


class OutputBudget:
    """One rendered prompt's pieces, counted as each is produced: over MAX_OUTPUT_CHARS the render stops."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.size = 0

    def add(self, piece: str) -> None:
        self.size += len(piece)
        if self.size > MAX_OUTPUT_CHARS:
            raise ChatTemplateBudgetError(f"chat template output exceeds {MAX_OUTPUT_CHARS} characters")
        self.pieces.append(piece)

    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class RenderBudget:
    deadline: float
    steps: int = 0
    produced: int = 0
    exceeded: BudgetExceeded | None = field(default=None)

    @classmethod
    def start(cls, seconds: float = MAX_RENDER_SECONDS) -> "RenderBudget":
        return cls(deadline=time.monotonic() + seconds)

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            self.fail(f"step budget ({MAX_STEPS} loop iterations and calls)")
        if time.monotonic() > self.deadline:
            self.fail(f"time budget ({MAX_RENDER_SECONDS:g} s)")

    def produce(self, size: int) -> None:
        if size > MAX_VALUE_SIZE:
            self.fail(f"size budget ({MAX_VALUE_SIZE} characters per value)")
        self.produced += size
        if self.produced > MAX_PRODUCED:
            self.fail(f"memory budget ({MAX_PRODUCED} characters in all)")

    def fail(self, what: str) -> None:
        # Sticky: a filter that swallows exceptions cannot hide the first failure from render_chat.
        if self.exceeded is None:
            self.exceeded = BudgetExceeded(f"chat template exceeded its {what}")
        raise self.exceeded


_ACTIVE: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("dgemma_render_budget", default=None)


@contextlib.contextmanager
def active_budget(budget: RenderBudget) -> Iterator[RenderBudget]:
    token = _ACTIVE.set(budget)
    try:
        yield budget
    finally:
        _ACTIVE.reset(token)


def _current() -> RenderBudget:
    budget = _ACTIVE.get()
    if budget is None:  # a template used outside render_chat: still bounded, by a budget of its own
        budget = RenderBudget.start()
        _ACTIVE.set(budget)
    return budget


def size_of(value: Any, limit: int = MAX_VALUE_SIZE) -> int:
    """Characters + items of a value, nested containers included (shared ones counted each time they occur, as
    printing or comparing them would); stops counting soon after `limit`, so it costs O(min(size, limit))."""
    total, stack, visited = 0, [value], 0
    while stack and total <= limit:
        item = stack.pop()
        visited += 1
        if visited % 65536 == 0:  # a walk of a huge shared structure still notices the deadline
            _current().step(0)
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple)):
            total += len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, jinja2.utils.Namespace):
            attrs = item._Namespace__attrs  # jinja2 lets this one name through Namespace.__getattribute__
            total += len(attrs)
            stack.extend(attrs.values())
        elif isinstance(item, int) and not isinstance(item, bool):
            total += 1 + item.bit_length() // 4
        else:
            total += 1
    return total


def _measure(value: Any) -> Any:
    """Charge a produced value to the budget (strings and containers; other values are small)."""
    if isinstance(value, (str, bytes, list, tuple, dict, jinja2.utils.Namespace)):
        _current().produce(size_of(value))
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        _current().fail(f"size budget ({MAX_INT_BITS}-bit integers)")
    return value


def _check_width(width: Any) -> None:
    if isinstance(width, int) and not isinstance(width, bool) and width > MAX_FORMAT_WIDTH:
        _current().fail(f"size budget (widths up to {MAX_FORMAT_WIDTH})")


def _check_total(size: int) -> None:
    if size > MAX_VALUE_SIZE:
        _current().fail(f"size budget ({MAX_VALUE_SIZE} characters per value)")


# ---- amplifying operations, checked before they run --------------------------------------------------------------

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def check_percent_format(fmt: str, args: Any) -> None:
    """`fmt % args`: no width or precision beyond MAX_FORMAT_WIDTH, no `*` (a width taken from the data)."""
    for match in _PERCENT_SPEC.finditer(fmt):
        for number in match.groups():
            if number == "*":
                _current().fail("size budget ('*' widths are not allowed)")
            if number is not None:
                _check_width(int(number) if len(number) < 12 else MAX_FORMAT_WIDTH + 1)
    _check_total(len(fmt) + size_of(args))


def check_brace_format(fmt: str, args: Any, kwargs: Any) -> None:
    """`fmt.format(...)`: the same width rule for every field's format spec (nested `{}` specs are refused)."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format itself reports the malformed string
    for _literal, _name, spec, _conversion in fields:
        if not spec:
            continue
        if "{" in spec:
            _current().fail("size budget (nested format widths are not allowed)")
        for number in re.findall(r"\d+", spec):
            _check_width(int(number) if len(number) < 12 else MAX_FORMAT_WIDTH + 1)
    _check_total(len(fmt) + size_of(args) + size_of(kwargs))


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                _check_total(size_of(seq) * max(n, 0))
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            _current().fail(f"size budget ({MAX_INT_BITS}-bit integers)")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if left.bit_length() * min(right, MAX_INT_BITS + 1) > MAX_INT_BITS:
                _current().fail(f"size budget ({MAX_INT_BITS}-bit integers)")
    elif operator == "+":
        if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
            _check_total(size_of(left) + size_of(right))
    elif operator == "%" and isinstance(left, str):
        check_percent_format(left, right)


def _check_str_method(method: Any, args: tuple, kwargs: dict) -> None:
    """Pre-checks for the str methods whose result can be far larger than their inputs."""
    text, name = method.__self__, method.__name__
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(args[0])
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            _check_total(len(text) + text.count("\t") * max(tabsize, 0))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = text.count(args[0]) if args[0] else len(text) + 1
        _check_total(len(text) + count * max(len(args[1]) - len(args[0]), 0))
    elif name == "join" and args:
        items = args[0]
        if isinstance(items, (list, tuple, str)):
            _check_total(size_of(items) + len(text) * len(items))


# ---- filters ------------------------------------------------------------------------------------------------------

def _filter_checks(name: str, value: Any, args: tuple, kwargs: dict) -> None:
    if name == "center":
        _check_width(args[0] if args else kwargs.get("width"))
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width
        _check_width(width)
        if isinstance(value, str) and isinstance(width, int):
            _check_total(len(value) + (value.count("\n") + 1) * max(width, 0))
    elif name == "format" and isinstance(value, str):
        check_percent_format(value, kwargs or args)
    elif name == "join":
        separator = args[0] if args else kwargs.get("d", "")
        if isinstance(value, (list, tuple)) and isinstance(separator, str):
            _check_total(size_of(value) + len(separator) * len(value))
    elif name == "replace" and len(args) >= 2 and isinstance(value, str):
        old, new = str(args[0]), str(args[1])
        count = value.count(old) if old else len(value) + 1
        _check_total(len(value) + count * max(len(new) - len(old), 0))
    elif name in ("batch", "slice"):
        _check_width(args[0] if args else None)
    elif name == "tojson":
        indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
        _check_width(len(indent) if isinstance(indent, str) else indent)
        if isinstance(indent, int) and indent > 0:
            _check_total(size_of(value) * (1 + min(indent, MAX_FORMAT_WIDTH)))
    elif name in ("wordwrap", "urlize", "striptags", "wordcount", "truncate", "title", "xmlattr", "pprint"):
        if size_of(value, MAX_SLOW_FILTER_INPUT) > MAX_SLOW_FILTER_INPUT:
            _current().fail(f"size budget ({MAX_SLOW_FILTER_INPUT} characters into {name})")


def budgeted_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` with a step, its pre-checks and a measured result; always `pass_context` (see the module doc)."""
    wants = getattr(getattr(func, "jinja_pass_arg", None), "name", None)  # set by jinja2.pass_context & co.

    @jinja2.pass_context
    @functools.wraps(func)
    def wrapper(context: jinja2.runtime.Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        _current().step()
        _filter_checks(name, value, args, kwargs)
        if wants == "context":
            result = func(context, value, *args, **kwargs)
        elif wants == "eval_context":
            result = func(context.eval_ctx, value, *args, **kwargs)
        elif wants == "environment":
            result = func(context.environment, value, *args, **kwargs)
        else:
            result = func(value, *args, **kwargs)
        return _measure(result)

    return wrapper


def _counted(items: Iterable[Any], literal_chars: int) -> Iterator[Any]:
    """A loop's iterable, one budget step (and the body's literal text) per iteration."""
    budget = _current()
    for item in items:
        budget.step()
        if literal_chars:
            budget.produce(literal_chars)
        yield item


@jinja2.pass_context
def _loop_filter(context: jinja2.runtime.Context, items: Any, literal_chars: int = 0) -> Iterator[Any]:
    return _counted(items, literal_chars)


@jinja2.pass_context
def _concat_filter(context: jinja2.runtime.Context, parts: list[Any]) -> str:
    _current().step()
    _check_total(sum(size_of(part) for part in parts))
    return _measure("".join(map(str, parts)))


@jinja2.pass_context
def _value_filter(context: jinja2.runtime.Context, value: Any) -> Any:
    return _measure(value)


def _literal_chars(body: list[nodes.Node]) -> int:
    return sum(len(data.data) for node in body for data in node.find_all(nodes.TemplateData))


class BudgetTransformer(NodeTransformer):
    """Routes loops, `~` and container literals through the budget filters (children first)."""

    def _wrap(self, node: nodes.Expr, name: str, *args: nodes.Expr) -> nodes.Filter:
        return nodes.Filter(node, name, list(args), [], None, None, lineno=node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = self._wrap(node.iter, LOOP_FILTER, nodes.Const(_literal_chars(node.body), lineno=node.lineno))
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return self._wrap(nodes.List(node.nodes, lineno=node.lineno), CONCAT_FILTER)

    def _literal(self, node: nodes.Expr) -> nodes.Expr:
        self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":
            return node  # an assignment target (`{% set a, b = ... %}`), not a value
        return self._wrap(node, VALUE_FILTER)

    visit_List = visit_Tuple = visit_Dict = _literal


class DepthLimitedParser(jinja2.parser.Parser):
    """jinja2's parser, stopped at MAX_TEMPLATE_DEPTH levels before its own recursion (about 6 Python frames a level)
    reaches the interpreter's limit. Every recursive path through jinja2's grammar passes one of these methods: a
    statement inside a block, an operand (every bracket level, `-` and `not` chain), an `else` chain."""

    level = 0

    @contextlib.contextmanager
    def _nested(self) -> Iterator[None]:
        self.level += 1
        if self.level > MAX_TEMPLATE_DEPTH:
            raise too_deep()
        try:
            yield
        finally:
            self.level -= 1

    def parse_statement(self) -> nodes.Node | list[nodes.Node]:
        with self._nested():
            return super().parse_statement()

    def parse_condexpr(self) -> nodes.Expr:
        with self._nested():
            return super().parse_condexpr()

    def parse_not(self) -> nodes.Expr:
        with self._nested():
            return super().parse_not()

    def parse_unary(self, with_filter: bool = True) -> nodes.Expr:
        with self._nested():
            return super().parse_unary(with_filter)


def check_tree_depth(tree: nodes.Node) -> None:
    """The syntax tree within MAX_TEMPLATE_DEPTH levels (walked without recursion): the transformer below and jinja2's
    code generator recurse over it, and chains the parser builds in a loop (`a + b + ...`, `x|f|f...`) are deep."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TEMPLATE_DEPTH:
            raise too_deep()
        stack.extend((child, depth + 1) for child in node.iter_child_nodes())


def _finalize(value: Any) -> Any:
    """Every `{{ ... }}` output, measured before it is turned into text."""
    return _measure(value)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every render bounded by the active RenderBudget."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, **options: Any) -> None:
        # optimized=False: jinja2's optimizer would evaluate constant expressions at compile time, unbudgeted.
        super().__init__(optimized=False, finalize=_finalize, **options)
        self.filters = {name: budgeted_filter(name, func) for name, func in self.filters.items()}
        self.filters.update({LOOP_FILTER: _loop_filter, CONCAT_FILTER: _concat_filter, VALUE_FILTER: _value_filter})
        self.globals["lipsum"] = _lipsum

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = DepthLimitedParser(self, source, name, filename).parse()
        check_tree_depth(tree)
        return BudgetTransformer().visit(tree)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _current().step()
        _check_binop(operator, left, right)
        return _measure(super().call_binop(context, operator, left, right))

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _current().step()
        if isinstance(__obj, jinja2.runtime.LoopContext) and args:
            args = (_counted(args[0], 0),) + args[1:]  # `loop(children)` in a recursive loop
        elif getattr(__obj, "__self__", None).__class__ is str:
            _check_str_method(__obj, args, kwargs)
        return _measure(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            check_brace_format(fmt, args if not is_map else (), args[0] if is_map and args else kwargs)
            return _measure(wrapped(*args, **kwargs))

        return checked


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (jinja2's names)
    if not all(isinstance(x, int) for x in (n, min, max)) or n * max > MAX_FORMAT_WIDTH:
        _current().fail(f"size budget (lipsum up to {MAX_FORMAT_WIDTH} words)")
    return _measure(jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max))
