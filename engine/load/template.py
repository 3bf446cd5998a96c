"""Chat templates, rendered as the untrusted code they are.

Templates ship with downloaded weights. jinja2's sandbox keeps a template from Python's
internals, not from working without end, and nothing inside a process can stop one C call
once it has begun (`'A' * 10**10`, a join, a big power). So a template renders in a child
process: the sandbox inside it, its address space capped, its output held to what the model's
context could hold, and the parent kills it if it runs past a deadline. Every failure, the
template's own bugs included, is one ValueError line. A reader learning decoding may skip it.

    parent: fork -> read the child's answer until EOF -> reap it
            (the deadline passes, or Ctrl-C: SIGKILL it first)
    child:  cap memory -> render in the sandbox -> write {"text"} or {"error"} -> _exit
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import time

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0        # a chat template renders in milliseconds; seconds mean it loops
MEMORY_BYTES = 512 << 20    # what the child may map beyond the address space it was forked with


def render(source: str, max_chars: int, **context) -> str:
    """The template `source` rendered with `context`, its output at most `max_chars` characters;
    every failure is one ValueError line. Where there is no fork (Windows) it renders in this
    process: the sandbox and the output cap hold there, the deadline and the memory cap do not."""
    try:
        result = in_child(source, max_chars, context) if hasattr(os, "fork") else rendered(source, max_chars, context)
    except TimeoutError:
        raise ValueError(f"chat template: took longer than {RENDER_SECONDS:g} s") from None
    if "error" in result:
        raise ValueError(result["error"])
    if not result["text"].strip():
        raise ValueError("chat template rendered no text for these messages")
    return result["text"]


def in_child(source: str, max_chars: int, context: dict) -> dict:
    """rendered(), run in a forked child that is killed at the deadline, whatever it is doing."""
    # subtle: Python >= 3.12 warns (DeprecationWarning) that a fork in a process with threads
    # (torch's) may deadlock the child on a lock another thread held; this child takes none of
    # torch's, and one stuck on any lock ends at the deadline like a template that loops
    try:
        r, w = os.pipe()
    except OSError as e:   # out of descriptors: as much a refusal as any bound
        raise ValueError(cannot_start(e)) from None
    try:
        pid = os.fork()
    except OSError as e:   # out of processes or memory
        os.close(r), os.close(w)
        raise ValueError(cannot_start(e)) from None
    if pid == 0:
        child(w, source, max_chars, context)   # never returns
    os.close(w)
    try:
        answer = read_until(r, time.monotonic() + RENDER_SECONDS)
    except BaseException:   # the deadline, or Ctrl-C: the child goes, whatever it is doing
        kill(pid)
        raise
    finally:                # and is reaped, on every way out
        os.close(r)
        status = reap(pid)
    if status or not answer:   # it ended without an answer: OOM-killed, a crash in C
        return {"error": f"chat template: its renderer died ({describe(status)})"}
    return json.loads(answer)


def child(w: int, source: str, max_chars: int, context: dict) -> None:
    """The forked child's whole life: render, write the answer to `w`, exit."""
    # subtle: it must never return into the caller's code, nor flush the parent's stdio buffers
    # or run its atexit hooks (text printed twice): it leaves by os._exit, whatever happens
    code = 1
    try:
        # every other descriptor closed: a render forked meanwhile by another thread would
        # otherwise hold this one's pipe open, and its reader would wait for the deadline
        os.closerange(3, w)
        os.closerange(w + 1, os.sysconf("SC_OPEN_MAX"))
        gc.disable()   # a collection here would run finalizers of the parent's garbage twice
        for sig in (signal.SIGINT, signal.SIGTERM):   # the parent's handlers are the parent's
            signal.signal(sig, signal.SIG_DFL)
        cap_memory(MEMORY_BYTES)
        try:
            answer = rendered(source, max_chars, context)
        except BaseException as e:   # what rendered() does not expect (a MemoryError joining)
            answer = {"error": f"chat template failed: {type(e).__name__}: {one_line(e)}"}
        with os.fdopen(w, "wb") as f:
            f.write(json.dumps(answer).encode())   # ASCII JSON: nothing can fail to encode
        code = 0
    finally:
        os._exit(code)


def cannot_start(e: OSError) -> str:
    # an unbounded render is no fallback for untrusted code: say how to go without the template
    return (f"chat template: cannot start its renderer ({e.strerror or e}); the CLI's --raw, or "
            "token ids from Python, send a prompt without it")


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):   # reaped already where SIGCHLD is ignored
        os.kill(pid, signal.SIGKILL)


def reap(pid: int) -> int:
    """The child's wait status; 0 where SIGCHLD is ignored (the kernel reaped it already)."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return 0
    except KeyboardInterrupt:   # Ctrl-C while it exits: it goes, is reaped, then Ctrl-C goes on
        kill(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise


def read_until(fd: int, deadline: float) -> bytes:
    """The pipe's bytes up to its end; TimeoutError once `deadline` (time.monotonic) passes."""
    poll, data = select.poll(), bytearray()
    poll.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poll.poll(left * 1000):
            raise TimeoutError
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return bytes(data)
        data += chunk


def cap_memory(extra: int) -> None:
    """Cap this process's address space at what it maps now plus `extra` bytes, where Linux can
    say what it maps (/proc): past the cap an allocation is a MemoryError, not a swapping host.
    (The proof tool's child process runs a sampler under the same cap.)"""
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource
        with open("/proc/self/statm") as f:
            have = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)   # a user's own limit stays in force
        cap = min([have + extra] + [x for x in (soft, hard) if x != resource.RLIM_INFINITY])
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def rendered(source: str, max_chars: int, context: dict) -> dict:
    """{"text": the output} or {"error": one line}: the sandboxed render, its output capped."""
    # the settings HF chat templates are written for
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    out, size = [], 0
    try:  # a syntax error, the template's raise_exception(), a bound, or its own bug
        for chunk in env.from_string(source).generate(**context):
            size += len(chunk)
            if size > max_chars:
                return {"error": f"chat template: its output is past the {max_chars:,} characters "
                                 "the context can hold"}
            out.append(chunk)
    except jinja2.TemplateError as e:
        return {"error": f"chat template: {one_line(e)}"}
    except RecursionError:
        return {"error": "chat template: recursion too deep"}
    except MemoryError:
        return {"error": f"chat template: ran out of memory (more than {MEMORY_BYTES >> 20} MiB)"}
    except Exception as e:  # the template's own bug (1/0, a method on None): untrusted code
        return {"error": f"chat template failed: {type(e).__name__}: {one_line(e)}"}
    text = "".join(out)
    try:   # a lone surrogate ('\ud800' in the template) is no text a tokenizer can take
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return {"error": f"chat template: its output is not UTF-8 text (character {e.start}: {text[e.start]!r})"}
    return {"text": text}


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:300] + "..."


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def raise_exception(message):   # HF templates' way to refuse a chat
    raise jinja2.TemplateError(message)
