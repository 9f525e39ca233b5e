"""Models that misbehave in their own code, for the `callable` runner (tests/devices/test_model_misbehaviour.py).

`by_input` looks at each text of a batch: a text naming a fault ("exit:...", "surrogate",
"datetime", ...) makes the whole batch do it, any other text is echoed back. The daemon's
workers import this module, so everything at module level stays standard library (numpy is
imported where a fault needs it).
"""

import os
import sys
import time


class StopTheWorld(BaseException):
    """Not an Exception: what a model's `except Exception` (and a worker's) does not catch."""


class Unprintable(Exception):
    """An exception whose text cannot be read: its __str__ raises."""

    def __str__(self):
        raise RuntimeError("no text")


def _deep(levels):
    value = []
    for _ in range(levels):
        value = [value]
    return value


def _array(kind, n):
    import numpy as np

    arrays = {
        "datetime": lambda: np.zeros(n, dtype="datetime64[s]"),
        "timedelta": lambda: np.zeros(n, dtype="timedelta64[s]"),
        "complex": lambda: np.zeros(n, dtype=np.complex128),
        "object": lambda: np.array([object() for _ in range(n)], dtype=object),
        "bigendian": lambda: np.arange(n, dtype=">f4"),
        "structured": lambda: np.zeros(n, dtype="i4,f4"),
        "int16": lambda: np.arange(n, dtype=np.int16),
        "strided": lambda: np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3)[::2, ::2],
    }
    return arrays[kind]()


# What a text starting with the key becomes instead of its echo; the rest of its batch is echoed.
OWN_OUTPUT = {
    "surrogate": lambda: "\ud800",
    "deep": lambda: _deep(5000),
}

# What a batch holding a text starting with the key returns instead of its echo (n: the batch size).
RETURNS = {
    "scalar": lambda n: __import__("numpy").float32(1.0) and [__import__("numpy").float32(i) for i in range(n)],
    "rows": lambda n: [__import__("numpy").ones(3, dtype="float32") for _ in range(n)],
    "generator": lambda n: (i for i in range(n)),
    "none": lambda n: None,
    "dict": lambda n: {i: i for i in range(n)},
    "fewer": lambda n: [0] * (n - 1),
    "more": lambda n: [0] * (n + 1),
    "nan": lambda n: [float("nan")] * n,
    "bytes": lambda n: [b"\x00\xff"] * n,
    "set": lambda n: [{1, 2}] * n,
    "bigint": lambda n: [2**70] * n,
}


def _raise(kind):
    if kind == "systemexit":
        raise SystemExit(0)
    if kind == "keyboard":
        raise KeyboardInterrupt
    if kind == "base":
        raise StopTheWorld()
    if kind == "recursion":
        raise RecursionError("deep")
    if kind == "memory":
        raise MemoryError()


def _act(text, n):
    """What the batch does for the fault `text` names (None: echo)."""
    kind = text.split(":", 1)[0]
    if kind in RETURNS:
        return RETURNS[kind](n)
    if kind.startswith("array-"):
        return _array(kind[6:], n)
    if kind in ("systemexit", "keyboard", "base", "recursion", "memory"):
        _raise(kind)
    if kind == "recursionlimit":
        sys.setrecursionlimit(60)
        return None
    if kind == "closefds":
        for fd in range(3, 101):
            try:
                os.close(fd)
            except OSError:
                pass
        return None
    if kind == "fork":   # "fork:PATH": a child holding the worker's sockets outlives it, its pid in PATH
        written, told = os.pipe()
        if os.fork() == 0:
            os.close(written)
            with open(text.split(":", 1)[1], "a") as out:
                out.write(f"{os.getpid()}\n")
            os.write(told, b"1")   # its pid is on file: the worker may die now
            os.close(told)
            time.sleep(600)   # the fault itself: it outlives the worker, holding its sockets
            os._exit(0)
        os.close(told)
        os.read(written, 1)
        os._exit(5)
    if kind == "print":   # "print:TEXT": a model that prints its inputs (and flushes: the reply follows the write)
        print(text, flush=True)
        return None
    if kind == "eprint":   # "eprint:TEXT": the same, to stderr, as a debugging model might
        print(text, file=sys.stderr, flush=True)
        return None
    if kind == "stdout":
        sys.stdout.write("x" * (4 << 20))
        sys.stdout.flush()
        return None
    if kind == "stop":
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "segv":
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)
    return None


def by_input(inputs):
    """Echo each input, unless a text of the batch names a fault (see OWN_OUTPUT, RETURNS and `_act`)."""
    if any(isinstance(x, str) and x.split(":", 1)[0] in OWN_OUTPUT for x in inputs):
        return [OWN_OUTPUT[x.split(":", 1)[0]]() if isinstance(x, str) and x.split(":", 1)[0] in OWN_OUTPUT else x
                for x in inputs]
    for text in inputs:
        if isinstance(text, str) and text != "echo":
            out = _act(text, len(inputs))
            if out is not None or text.split(":", 1)[0] in ("none",):
                return out
    return list(inputs)


def echo(inputs):
    """Each input back: the bystander model of the tests."""
    return list(inputs)


def __getattr__(name):
    """`model_faults:exits_at_load` as a target: looking it up raises SystemExit, as a model module
    that calls sys.exit() at import does; `model_faults:unprintable_at_load` raises an exception
    whose text cannot be read."""
    if name == "exits_at_load":
        raise SystemExit(0)
    if name == "unprintable_at_load":
        raise Unprintable()
    raise AttributeError(name)
