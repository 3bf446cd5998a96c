"""Chat templates, rendered as the untrusted code they are.

Templates ship with downloaded weights. jinja2's sandbox stops them from running code, not
from working without end, so here they are also bounded: big powers and products refused,
`range` items counted over the whole render, and a wall-clock limit. The clock cannot stop one
C call, so every value a template builds is held to what the model's context could hold: the
output, `~` joins, `+`, repeated sequences, widths, and each filter's and call's result; the
calls that can multiply their input's size (join, replace, indent, a format's fields) are
estimated and refused before they run. Every failure, the template's own bugs included, is one
ValueError line. A reader learning decoding may skip it.
"""
from __future__ import annotations

import functools
import json
import re
import signal
import string
import threading
import time
from contextlib import contextmanager

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0     # a chat template renders in milliseconds; seconds mean it loops
MAX_INT_BITS = 4096      # integers a template may build; enough for any counter or id
MAX_ITERATIONS = 10**6   # range() items per render, over all loops
# the calls whose output check_output estimates from their string (a format's, a separator...)
STRING_CALLS = {"replace", "do_replace", "do_indent", "expandtabs", "do_wordwrap", "%", "do_format", "format",
                "format_map", "join"}
PERCENT_FIELD = re.compile(r"%%|%(?:\([^)]*\))?[-+ #0]*([\d.]*)")   # printf's: "%%" is no field


def render(source: str, max_chars: int, **context) -> str:
    """The template `source` rendered with `context` under the bounds above, its output at most
    `max_chars` characters; every failure is one ValueError line."""
    env = BoundedEnvironment(max_chars)
    out, size = [], 0
    try:  # a syntax error, the template's raise_exception(), a bound, or its own bug
        with alarm(RENDER_SECONDS):
            for chunk in env.from_string(source).generate(**context):
                size += len(chunk)
                env.check_size(size, "its output")
                env.tick()
                out.append(chunk)
    except (jinja2.TemplateError, TemplateBound) as e:
        raise ValueError(f"chat template: {one_line(e)}") from None
    except RecursionError:
        raise ValueError("chat template: recursion too deep") from None
    except MemoryError:
        raise ValueError("chat template: ran out of memory") from None
    except Exception as e:  # the template's own bug (1/0, a method on None): untrusted code
        raise ValueError(f"chat template failed: {type(e).__name__}: {one_line(e)}") from None
    text = "".join(out)
    if not text.strip():
        raise ValueError("chat template rendered no text for these messages")
    return text


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:300] + "..."


class TemplateBound(Exception):
    """A chat template went past a bound on its work, time or output."""


@contextmanager
def alarm(seconds: float):
    """Raise TemplateBound in this thread after `seconds` of wall clock.

    subtle: only the main thread receives signals; elsewhere the environment's tick() checks
    the same deadline at every call, attribute, operator, range item and output chunk.
    """
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise TemplateBound(f"took longer than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class BoundedCodeGenerator(CodeGenerator):
    # `a ~ b` compiles to a plain join the sandbox never sees; send it through the environment,
    # so that doubling a string in a loop is refused at the cap, not after gigabytes
    def visit_Concat(self, node, frame):
        self.write("environment.concat_bounded((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's sandbox stops code execution, not work: this one also refuses the operations
    that allocate or loop without bound before they run, and keeps a deadline."""
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = BoundedCodeGenerator

    def __init__(self, max_chars: int):
        # the settings HF chat templates are written for
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.deadline, self.max_chars, self.iterations = time.monotonic() + RENDER_SECONDS, max_chars, 0
        self.globals["raise_exception"] = raise_exception
        self.globals["range"] = self.counted_range
        self.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.filters = {name: self.bounded(f) for name, f in self.filters.items()}

    def tick(self):
        if time.monotonic() > self.deadline:
            raise TemplateBound(f"took longer than {RENDER_SECONDS:g} s")

    def check_size(self, n, what):
        if n > self.max_chars:
            raise TemplateBound(f"{what} of {n:,} is past the {self.max_chars:,} characters the context can hold")

    def check_ints(self, args, what):   # str.center(10**10), "%*s" % (10**10, x): widths past any output
        self.tick()
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool):
                self.check_size(abs(a), what)

    def weight(self, x) -> int:
        """About the characters `x` renders to: a string's length, a container's items summed
        (each at least 1). Walked only to just past the cap: at most max_chars steps."""
        total, todo = 0, [x]
        while todo and total <= self.max_chars:
            y = todo.pop()
            if isinstance(y, (str, bytes)):
                total += len(y)
            elif isinstance(y, (list, tuple, set, frozenset, dict)):
                total += len(y)
                todo += [*y, *y.values()] if isinstance(y, dict) else y
            else:
                total += 1
        return total

    def check_output(self, name: str, subject, args: tuple, kwargs: dict) -> None:
        """Before a filter or a method runs: refuse one whose output would be past the cap. The
        sandbox's deadline cannot stop a C loop (`sum`, `join`, `replace`) once it has begun.
        subtle: these are the calls whose output can be the product of their inputs' sizes;
        every other output is at most their sum, which the check after each call bounds."""
        arg = lambda i, key, default: args[i] if len(args) > i else kwargs.get(key, default)
        s, out = str(subject) if name in STRING_CALLS else "", 0
        if name in ("join", "do_join"):                   # filter: value|join(d); method: d.join(value)
            items, sep = (subject, str(arg(0, "d", ""))) if name == "do_join" else (args[0], s)
            out = self.weight(items) + len(sep) * len(items)   # items: listed by the caller
        elif name in ("replace", "do_replace"):
            old, new = str(arg(0, "old", "")), str(arg(1, "new", ""))
            out = len(s) + (s.count(old) if old else len(s) + 1) * len(new)
        elif name == "do_indent":
            width = arg(0, "width", 4)
            out = len(s) + (s.count("\n") + 1) * (width if isinstance(width, int) else len(str(width)))
        elif name == "expandtabs":
            out = len(s) + s.count("\t") * max(arg(0, "tabsize", 8), 0)
        elif name == "do_wordwrap":
            width, wrap = arg(0, "width", 79), arg(2, "wrapstring", None)
            out = len(s) + (len(s) // max(width, 1) + 1) * len(str(wrap or "\n"))
        elif name in ("%", "do_format", "format", "format_map"):   # each field may repeat an argument
            specs = format_specs(s, name in ("%", "do_format"))             # "%10.2f", "{0:>10}"
            widest = max((int(n) for spec in specs for n in re.findall(r"\d+", spec)), default=0)
            out = len(s) + len(specs) * (self.weight(args) + self.weight(kwargs) + widest)
        elif name == "do_sum" and not isinstance(arg(1, "start", 0), (int, float)):
            raise TemplateBound("sum() adds numbers only here (a sum of lists is quadratic)")
        self.check_size(out, "the output a filter or method would build")

    def bounded(self, f):   # filters are called directly, not through call(): check them here
        pass_arg = getattr(f, "jinja_pass_arg", None) is not None   # a context comes first

        @functools.wraps(f)   # keeps jinja's pass_context marks
        def g(*args, **kwargs):
            self.check_ints((*args, *kwargs.values()), "a filter's width or count argument")
            value, rest = (args[1], args[2:]) if pass_arg else (args[0], args[1:])
            if f.__name__ == "do_join":   # a generator is listed first, so its length is known
                value = listed(value)
                args = (*args[:pass_arg], value, *rest)
            self.check_output(f.__name__, value, rest, kwargs)
            out = f(*args, **kwargs)
            self.check_size(self.weight(out), "a filter's output")
            return out
        return g

    def concat_bounded(self, parts) -> str:
        self.tick()
        parts = [str(p) for p in parts]
        self.check_size(sum(map(len, parts)), "a joined string")
        return "".join(parts)

    def call_binop(self, context, operator, left, right):
        self.tick()
        ints = all(isinstance(x, int) for x in (left, right))
        if operator == "**" and ints and right > 0 and abs(left) > 1 \
                and right * abs(left).bit_length() > MAX_INT_BITS:
            raise TemplateBound(f"{left} ** {right} has more than {MAX_INT_BITS} bits")
        if operator == "*" and ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateBound(f"a product of more than {MAX_INT_BITS} bits")
        if operator == "*":   # sequence * count: its items' weight, not their number
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and hasattr(seq, "__len__"):
                self.check_size(self.weight(seq) * max(n, 0), "a repeated sequence")
        if operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
            self.check_size(self.weight(left) + self.weight(right), "a concatenation")
        if operator == "%" and isinstance(left, str):
            self.check_ints(right if isinstance(right, tuple) else (right,), "a format width")
            self.check_output("%", left, (right,), {})
        return super().call_binop(context, operator, left, right)

    def call(self, __context, __obj, *args, **kwargs):
        self.check_ints((*args, *kwargs.values()), "a width or count argument")
        if isinstance(getattr(__obj, "__self__", None), str):   # 'x'.replace(...), sep.join(...)
            if __obj.__name__ == "join" and args:
                args = (listed(args[0]), *args[1:])
            self.check_output(__obj.__name__, __obj.__self__, args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        self.check_size(self.weight(out), "a call's output")
        return out

    def wrap_str_format(self, value):   # the sandbox's own str.format, its output checked first
        f = super().wrap_str_format(value)
        if f is None:
            return None

        def checked(*args, **kwargs):
            self.check_output(value.__name__, value.__self__, args, kwargs)
            return f(*args, **kwargs)
        return checked

    def getattr(self, obj, attribute):
        self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.tick()
        return super().getitem(obj, argument)

    def counted_range(self, *args) -> range:
        # subtle: the sandbox caps one range at 100,000 items, but nested loops multiply them;
        # counting every range's items per render bounds the total
        r = range(*args)
        self.iterations += len(r)
        if self.iterations > MAX_ITERATIONS:
            raise TemplateBound(f"loops over more than {MAX_ITERATIONS:,} items")
        return r


def format_specs(fmt: str, percent: bool) -> list[str]:
    """The spec of each field of a format string ("%10.2f" -> "10.2", "{0:>10}" -> ">10"), one
    per field; [] where it does not parse (formatting it then fails on its own)."""
    if percent:
        return [m[1] or "" for m in PERCENT_FIELD.finditer(fmt) if m[0] != "%%"]
    try:
        return [spec or "" for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
    except ValueError:
        return []


def listed(x):
    """x, or its items in a list where it has no length (a generator: `map`, `select`)."""
    return x if hasattr(x, "__len__") else list(x)


def raise_exception(message):   # HF templates' way to refuse a chat
    raise jinja2.TemplateError(message)
