"""The sandbox chat templates run in: jinja2's ImmutableSandboxedEnvironment with a bound on how much a template
may make, so that a hostile template in a checkpoint cannot exhaust memory (`{{ ('a' * 10**9)|length }}` would
allocate 1 GB). Jinja's sandbox already bounds `range()` (100,000 items); this adds, for every operation that can
make something large, a check of the size it would make, before it is made:

    'a' * n, [x] * n, s + t, l + m   at most MAX_LENGTH characters (or items)
    a * b and a ** b on integers     at most MAX_INT_BITS bits
    a ~ b, '%8s' % x, '{:>8}'.format(x), s.ljust(n), s.replace(a, b), sep.join(items), ...
    the filters that make text (center, indent, join, replace, format, wordwrap, tojson, upper, ...) and lists
    (batch, slice, sum), lipsum(), {% set %} blocks, macro output and the rendered text itself

A refused operation raises ChatTemplateLimitError (a jinja2 SecurityError) saying what was refused, how large it
would have been and the limit. MAX_LENGTH is far above any real prompt (16.7M characters, millions of tokens); a
trusted template that needs more can raise it.

Offers: BoundedSandbox, ChatTemplateLimitError, bounded_join, text_size, MAX_LENGTH, MAX_INT_BITS.
"""

from __future__ import annotations

import functools
import inspect
import re
import string
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jinja2.compiler
import jinja2.exceptions
import jinja2.sandbox
import jinja2.utils

MAX_LENGTH = 1 << 24  # characters of a string, items of a list
MAX_INT_BITS = 1 << 16  # python ints grow without bound; 20k digits is already past int -> str's own limit
_SEQUENCES = (str, list, tuple, bytes)  # what * repeats and + joins


class ChatTemplateLimitError(jinja2.exceptions.SecurityError):
    """A chat template asked for a string, list or integer larger than the sandbox allows."""


def _refuse(what: str, size: int, limit: int, unit: str) -> None:
    raise ChatTemplateLimitError(
        f"chat template refused: {what} would make about {size:,} {unit}, and a chat template may make at most "
        f"{limit:,} (gpuformers.chat_sandbox.{'MAX_LENGTH' if unit != 'bits' else 'MAX_INT_BITS'}). The template "
        f"is broken or hostile: fix it, or pass chat_template= one you trust"
    )


def _check(size: int, what: str) -> None:
    if size > MAX_LENGTH:
        _refuse(what, size, MAX_LENGTH, "characters (or items)")


def _check_bits(bits: int, what: str) -> None:
    if bits > MAX_INT_BITS:
        _refuse(what, bits, MAX_INT_BITS, "bits")


def text_size(value: Any, limit: int | None = None) -> int:
    """About len(str(value)), without making the string: counted over the items of lists, tuples, sets, dicts and
    namespaces (a list may hold the same long string many times), and only until it passes `limit`."""
    limit = MAX_LENGTH if limit is None else limit
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [iter((value,))]
    while stack and total <= limit:
        item = next(stack[-1], stack)  # the stack itself marks the end of an iterator
        if item is stack:
            stack.pop()
        elif isinstance(item, str):
            total += len(item) + 2  # repr's quotes inside a container
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack.append(iter(item))
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            stack.append(iter(item.items()))
        elif isinstance(item, jinja2.utils.Namespace):
            total += 16
            stack.append(iter(item._Namespace__attrs.items()))  # a namespace's repr shows its attributes
        else:
            total += 24  # numbers, None, booleans, objects' short reprs
    return total


def bounded_join(parts: Iterable[str], what: str = "the text this template renders") -> str:
    """"".join(parts), refused as soon as the text passes MAX_LENGTH (the parts may come from a generator)."""
    out, total = [], 0
    for part in parts:
        total += len(part)
        if total > MAX_LENGTH:
            _refuse(what, total, MAX_LENGTH, "characters")
        out.append(part)
    return "".join(out)


# --- what an operation would make ----------------------------------------------------------------------------

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _width(digits: str) -> int:
    return int(digits) if len(digits) <= 12 else MAX_LENGTH + 1


def _fields_size(fmt: str, count: int, widths: list[int], dynamic: bool, values: list) -> int:
    """A format string with `count` fields: each may print the largest value, padded to the widths it names (or,
    with widths taken from the arguments, to the largest integer argument)."""
    largest = max((text_size(v) for v in values), default=0)
    padding = max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0) if dynamic else 0
    return len(fmt) + count * (largest + max(padding, 0)) + sum(widths)


def _percent_size(fmt: str, args: Any) -> int:
    specs = list(_PERCENT_SPEC.finditer(fmt))
    widths = [_width(g) for m in specs for g in m.groups() if g and g != "*"]
    dynamic = any("*" in m.groups() for m in specs)
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    return _fields_size(fmt, len(specs), widths, dynamic, values)


def _format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
    try:
        fields = [spec for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
    except ValueError:  # malformed: str.format raises its own error
        return len(fmt)
    widths = [_width(d) for spec in fields for d in re.findall(r"\d+", spec or "")]
    dynamic = any("{" in (spec or "") for spec in fields)
    return _fields_size(fmt, len(fields), widths, dynamic, [*args, *kwargs.values()])


def _replace_size(s: str, old: str, new: str, count: int | None = -1) -> int:
    found = s.count(old) if old else len(s) + 1
    if count is not None and count >= 0:
        found = min(found, count)
    return len(s) + found * max(len(new) - len(old), 0)


def _join_size(separator: str, items: list) -> int:
    return sum(text_size(item) for item in items) + len(separator) * max(len(items) - 1, 0)


def _as_text(value: Any) -> str:
    """str(value), after checking that the text is not too large to make."""
    if not isinstance(value, str):
        _check(text_size(value), "turning this value into text")
    return str(value)


def _indent_size(s: str, width: int | str) -> int:
    return len(s) + (s.count("\n") + 1) * (width if isinstance(width, int) else len(width))


def _wrap_size(s: str, width: int, wrapstring: str | None) -> int:
    lines = len(s) // max(width, 1) + s.count(" ") + s.count("\n") + 1  # long words may break or not
    return len(s) + lines * len(wrapstring or "\n")


def _translate_size(s: str, table: Any) -> int:
    longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, Mapping) \
        else 1
    return len(s) * max(longest, 1)


# str methods that can make a longer string than they are called on: (the string, the call's arguments) -> size
_STR_METHODS: dict[str, Callable[..., int]] = {
    "ljust": lambda s, width, *_: max(len(s), width),
    "rjust": lambda s, width, *_: max(len(s), width),
    "center": lambda s, width, *_: max(len(s), width),
    "zfill": lambda s, width: max(len(s), width),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(tabsize, 0),
    "replace": _replace_size,
    "join": lambda s, items: _join_size(s, items),
    "translate": _translate_size,
    "format": lambda s, *args, **kwargs: _format_size(s, args, kwargs),
    "format_map": lambda s, mapping: _format_size(s, (), mapping),
}

# filters that make text or lists larger than their input: their bound arguments -> size
_FILTERS: dict[str, Callable[[dict], int]] = {
    "center": lambda a: max(text_size(a["value"]), a["width"]),
    "indent": lambda a: _indent_size(_as_text(a["s"]), a["width"]),
    "wordwrap": lambda a: _wrap_size(_as_text(a["s"]), a["width"], a["wrapstring"]),
    "replace": lambda a: _replace_size(_as_text(a["s"]), _as_text(a["old"]), _as_text(a["new"]), a["count"]),
    "join": lambda a: _join_size(_as_text(a["d"]), a["value"]),
    "format": lambda a: _percent_size(_as_text(a["value"]), a["kwargs"] or a["args"]),
    "batch": lambda a: a["linecount"] if a["fill_with"] is not None else 0,
    "slice": lambda a: a["slices"],
    "sum": lambda a: 0 if isinstance(a["start"], (int, float)) else text_size(a["start"]) + text_size(a["iterable"]),
}
# filters whose input is not turned into text (or that are bounded above): no check of the input
_PASS_THROUGH = {"abs", "attr", "count", "d", "default", "dictsort", "first", "float", "groupby", "int", "items",
                 "last", "length", "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse", "round",
                 "select", "selectattr", "sort", "tojson", "unique"}
# filters that take an iterable: materialised once, so that sizing it does not consume it
_ITERABLE_ARGUMENT = {"join": "value", "sum": "iterable"}


def _guard_filter(name: str, func: Callable) -> Callable:
    if name in _PASS_THROUGH:
        return func
    size = _FILTERS.get(name)
    signature = inspect.signature(func)  # of the function under jinja's async_variant wrapper, if any
    inner = getattr(func, "__wrapped__", func)
    # the wrapper of a plain function takes an eval context first and drops it: not in the signature
    dropped = 1 if getattr(func, "jinja_pass_arg", None) and not getattr(inner, "jinja_pass_arg", None) else 0
    # where the filtered value is: after the environment or context jinja passes first
    value_at = dropped + (1 if getattr(inner, "jinja_pass_arg", None) else 0)

    @functools.wraps(func)  # keeps jinja's pass_environment / pass_eval_context marks
    def turns_into_text(*args, **kwargs):
        value = args[value_at] if len(args) > value_at else None
        if not isinstance(value, str):
            _check(text_size(value), f"the {name} filter on this value")
        return func(*args, **kwargs)

    @functools.wraps(func)
    def sized(*args, **kwargs):
        lead, args = args[:dropped], args[dropped:]
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # a wrong call: the filter says so itself
            return func(*lead, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if name in _ITERABLE_ARGUMENT:
            key = _ITERABLE_ARGUMENT[name]
            arguments[key] = list(arguments[key])
        try:
            made = size(arguments)
        except TypeError:  # e.g. a width that is not a number: the filter raises its own error
            made = 0
        _check(made, f"the {name} filter")
        return func(*lead, *bound.args, **bound.kwargs)

    return turns_into_text if size is None else sized


def _bounded_lipsum(lipsum: Callable) -> Callable:
    @functools.wraps(lipsum)
    def guarded(n=5, html=True, min=20, max=100):  # noqa: A002 - lipsum's own parameter names
        _check(n * max * 16, "lipsum()")  # at most `max` words of at most ~12 letters per paragraph
        return lipsum(n=n, html=html, min=min, max=max)

    return guarded


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """`a ~ b` is compiled to a join jinja does not let the sandbox intercept: route it through the environment."""

    def visit_Concat(self, node, frame):
        if frame.eval_ctx.autoescape or frame.eval_ctx.volatile:  # chat templates never autoescape
            return super().visit_Concat(node, frame)
        self.write("environment.concat_operator((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment whose operations are refused when what they would make passes the bounds."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *args, **kwargs):
        super().__init__(*args, finalize=self._finalize, **kwargs)
        # {% set %} blocks, macro and caller() output and render() itself are joined by environment.concat
        self.concat = bounded_join
        self.filters = {name: _guard_filter(name, func) for name, func in self.filters.items()}
        self.globals["lipsum"] = _bounded_lipsum(self.globals["lipsum"])

    @staticmethod
    def _finalize(value: Any) -> Any:
        if not isinstance(value, str):  # {{ a_list }} prints every item
            _check(text_size(value), "printing this value")
        return value

    @staticmethod
    def concat_operator(parts: tuple) -> str:
        _check(sum(len(part) if type(part) is str else text_size(part) for part in parts), "the ~ operator")
        return "".join(map(str, parts))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        # the messages are formatted only when refusing: this runs for every + of a template
        if operator == "+":
            if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES) and len(left) + len(right) > MAX_LENGTH:
                _check(len(left) + len(right), f"{type(left).__name__} + {type(right).__name__}")
        elif operator == "*":
            sequence, count = (right, left) if isinstance(right, _SEQUENCES) else (left, right)
            if isinstance(sequence, _SEQUENCES) and isinstance(count, int):
                _check(len(sequence) * count, f"{type(sequence).__name__} * {count}")
            elif isinstance(left, int) and isinstance(right, int):
                _check_bits(left.bit_length() + right.bit_length(), "integer * integer")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                _check_bits((abs(left).bit_length() - 1) * right, f"a {left.bit_length()}-bit integer ** {right}")
        elif operator == "%" and isinstance(left, str):
            _check(_percent_size(left, right), "the % string format")
        return self.binop_table[operator](left, right)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """Every read of a str method goes through here (jinja wraps str.format here): the methods that can make
        a longer string are checked before they run."""
        if type(value) is not types.BuiltinMethodType or value.__name__ not in _STR_METHODS \
                or not isinstance(value.__self__, str):
            return super().wrap_str_format(value)
        owner, name = value.__self__, value.__name__
        size, method = _STR_METHODS[name], super().wrap_str_format(value) or value

        def guarded(*args, **kwargs):
            if name == "join":  # sized and joined from one list, not from a generator consumed twice
                args = (list(args[0]),) + args[1:] if args else args
            try:
                made = size(owner, *args, **kwargs)
            except TypeError:  # a wrong call: the method raises its own error
                made = 0
            _check(made, f"str.{name}()")
            return method(*args, **kwargs)

        return guarded
