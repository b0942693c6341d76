"""Function asserts judged on values: the program answers calls, the judge evaluates the asserts.

Two sides, two processes (see judge.py for how the judge is kept out of the program's reach):

- the runner (`python -I -S asserts.py serve PROGRAM REQUESTS_FD REPLIES_FD`, the program's process): executes the
  program as module "solution", lists the names it defines, then answers call requests (a call, or an attribute of
  one of its objects read). Its stdin, stdout and stderr are /dev/null: what the program prints goes nowhere.
  Requests come as marshal data (the judge's, trusted), length-prefixed; replies go as JSON lines (`json_text`),
  which the judge parses with `json` (marshal is not safe to load from the program). The runner imports nothing
  heavy: it starts in ~15 ms.
- the judge (`judge_asserts`): executes the test's setup and each assert in its own interpreter, where every name the
  program defines is a proxy (`Remote`) and `import solution` gives a module of proxies. Calling a proxy sends the
  arguments, as plain data, to the runner and takes back the result as plain data (`encode`/`decode`); a result that
  is not plain data stays in the runner and comes back as a `Handle`, whose methods may be called but which is
  neither true, false, equal, hashable nor usable as a value: an assert that needs it as a value fails.

Outcome of an assert: None (it held); "wrong_answer" (false, or it raised while evaluating the program's values, or
needed a value that is not plain data); "runtime_error" (the program raised, or a name is missing; "memory" when the
runner's peak resident memory reached its share of the limit); the kind observed when the runner died (judge.py's
`observed_failure`; an early exit is "runtime_error") or was stopped ("timeout", "output_limit"), for that assert and
every one after it; "sandbox_error" when the test passes the program something that is not plain data (our limit: such
tests cannot be judged this way). Arguments are copies: a program that mutates its argument in place is not seen to.
"""

from __future__ import annotations

import builtins
import marshal
import os
import select
import sys
import time
from _json import encode_basestring_ascii  # the C half of json: the runner starts without importing json (and re)

MAX_DEPTH = 100  # nesting of plain data


# ---- plain data: the only values that cross between the program and the judge ----

class NotPlainData(Exception):
    """A value that is not plain data, or data that is not a well-formed encoding of one."""


_FLOAT_TAGS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
ModuleType = type(sys)
_SEQUENCE_TAGS = {list: "l", tuple: "t", set: "s", frozenset: "z"}
_SEQUENCE_TYPES = {tag: kind for kind, tag in _SEQUENCE_TAGS.items()}


def encode(value, depth: int = 0):
    """`value` as JSON-able data that `decode` turns back into an equal value of the same types. Plain data is None,
    bool, int, float, str, bytes, complex, list, tuple, set, frozenset and dict of plain data, of exactly those types
    (a subclass can override ==); NotPlainData for anything else."""
    if depth > MAX_DEPTH:
        raise NotPlainData("nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:  # past 63 bits in hex: the int/str digit limit (4300 digits) applies to decimal only
        return value if value.bit_length() <= 63 else {"i": hex(value)}
    if kind is float:
        return value if value - value == 0.0 else {"f": repr(value)}  # inf - inf and nan - nan are nan
    if kind in _SEQUENCE_TAGS:
        return {_SEQUENCE_TAGS[kind]: [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    raise NotPlainData(f"a {kind.__name__} is not plain data")


def decode(data, depth: int = 0):
    """The value `encode` turned into `data`; NotPlainData when `data` is not such an encoding."""
    if depth > MAX_DEPTH:
        raise NotPlainData("nested too deeply")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not dict or len(data) != 1:
        raise NotPlainData(f"not an encoded value: a {type(data).__name__}")
    (tag, body), = data.items()
    try:
        if tag == "f":
            return _FLOAT_TAGS[body]
        if tag == "b":
            return bytes.fromhex(body)
        if tag == "i":
            if type(body) is not str:
                raise TypeError("an int's digits")
            return int(body, 16)
        if tag == "c":
            real, imag = body
            if type(real) is not float and type(real) is not int or type(imag) is not float and type(imag) is not int:
                raise TypeError("complex parts")
            return complex(real, imag)
        if tag == "d":
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
        return _SEQUENCE_TYPES[tag](decode(item, depth + 1) for item in body)
    except NotPlainData:
        raise
    except Exception as error:  # an unknown tag, an unhashable key, a malformed body
        raise NotPlainData(f"malformed encoded value ({type(error).__name__})") from None


def json_text(data) -> str:
    """`data` (what `encode` returns, or a reply made of such data, str keys, lists and dicts) as JSON text."""
    if data is None:
        return "null"
    if data is True or data is False:
        return "true" if data else "false"
    if type(data) is int:
        return str(data)
    if type(data) is float:
        return repr(data)  # finite here: `encode` tags the others
    if type(data) is str:
        return encode_basestring_ascii(data)
    if type(data) is list:
        return "[" + ",".join(json_text(item) for item in data) + "]"
    return "{" + ",".join(f"{encode_basestring_ascii(key)}:{json_text(value)}" for key, value in data.items()) + "}"


# ---- the runner: the program's process ----

def _read_exactly(fd: int, size: int) -> bytes | None:
    """`size` bytes from `fd`, None at EOF."""
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def serve(program: str, requests_fd: int, replies_fd: int) -> None:
    """Execute the program as module "solution", send what it defines, then answer call requests until EOF."""

    def reply(message: dict) -> None:
        view = memoryview((json_text(message) + "\n").encode())
        while view:
            view = view[os.write(replies_fd, view):]

    objects: list = []

    def result(value) -> dict:
        try:
            return {"value": encode(value)}
        except NotPlainData:
            objects.append(value)
            return {"handle": len(objects) - 1, "type": type(value).__name__}

    def argument(data):
        if type(data) is dict and set(data) == {"h"}:
            return objects[data["h"]]
        return decode(data)

    module = ModuleType("solution")
    sys.modules["solution"] = module
    with open(program, encoding="utf-8") as f:
        source = f.read()
    try:
        exec(compile(source, "solution.py", "exec"), module.__dict__)
    except BaseException as error:
        reply({"raised": type(error).__name__})
        return
    defined = {name: {"callable": True} if callable(value) else result(value)
               for name, value in list(module.__dict__.items())
               if not name.startswith("__") and not isinstance(value, ModuleType)}
    reply({"defined": defined})
    while True:
        head = _read_exactly(requests_fd, 4)
        body = None if head is None else _read_exactly(requests_fd, int.from_bytes(head, "little"))
        if body is None:
            return
        try:
            request = marshal.loads(body)
            if "attr" in request:  # an attribute of an object of the program's: read, not called
                target, args, kwargs = getattr, [objects[request["handle"]], str(request["attr"])], {}
            else:
                target = (module.__dict__[request["name"]] if "name" in request
                          else getattr(objects[request["handle"]], request["method"]))
                args = [argument(a) for a in request["args"]]
                kwargs = {str(k): argument(v) for k, v in request["kwargs"].items()}
        except Exception as error:
            reply({"bad_request": type(error).__name__})
            continue
        try:
            value = target(*args, **kwargs)
        except BaseException as error:
            reply({"raised": type(error).__name__})
            continue
        reply({"callable": True} if "attr" in request and callable(value) else result(value))


# ---- the judge's side ----

class ProgramRaised(Exception):
    """The program raised an exception in a call (its type's name, as the runner said: it only names the failure)."""


class Stopped(Exception):
    """The runner is gone: `kind` is how it ended (observed by the judge)."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class UnsupportedTest(Exception):
    """The test passes the program a value that is not plain data: it cannot be judged on values."""


class Runner:
    """The judge's end of the runner: sends requests, reads replies within the deadline, watches the process."""

    def __init__(self, judge, deadline: float):
        self.judge, self.deadline = judge, deadline
        requests_r, self.requests = os.pipe()
        self.replies, replies_w = os.pipe()
        self.process = judge.start([os.path.abspath(__file__), "serve", judge.program, str(requests_r),
                                    str(replies_w)], quiet=True, pass_fds=(requests_r, replies_w))
        os.close(requests_r)
        os.close(replies_w)
        os.set_blocking(self.requests, False)
        self.buffer, self.peak_tasks, self.kind = bytearray(), 0, None
        self.next_look = time.monotonic() + judge.tick_s  # when to count the program's tasks again

    def call(self, request: dict) -> dict:
        body = marshal.dumps(request)
        data = memoryview(len(body).to_bytes(4, "little") + body)
        while data:
            _, writable, _ = select.select([], [self.requests], [], self._wait())
            if writable:
                try:
                    data = data[os.write(self.requests, data):]
                except BrokenPipeError:
                    self.stop(None)
        return self.receive()

    def receive(self) -> dict:
        """The runner's next reply line, parsed; Stopped when it dies, passes the deadline or the output cap."""
        while b"\n" not in self.buffer:
            readable, _, _ = select.select([self.replies], [], [], self._wait())
            if not readable:
                continue
            chunk = os.read(self.replies, 1 << 16)
            if not chunk:
                self.stop(None)
            self.buffer += chunk
            if len(self.buffer) > self.judge.limits["output_bytes"]:
                self.stop("output_limit")
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        import json  # deferred: the judge's side only; the runner must start light

        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            raise NotPlainData("a reply that is not JSON") from None
        if type(reply) is not dict:
            raise NotPlainData("a reply that is not an object")
        return reply

    def _wait(self) -> float:
        """Seconds to wait before looking again; stops the runner past the deadline."""
        now = time.monotonic()
        if now >= self.deadline:
            self.stop("timeout")
        if now >= self.next_look:
            self.peak_tasks = max(self.peak_tasks, self.judge.tasks(self.process))
            self.next_look = now + self.judge.tick_s
        return min(self.judge.tick_s, self.deadline - now)

    def stop(self, kind: str | None) -> None:
        """End the runner (killed if it still runs); raise Stopped with `kind`, or (None) with the kind observed."""
        if self.kind is None:
            self.peak_tasks = max(self.peak_tasks, self.judge.tasks(self.process))  # its leftovers count too
            self.process.kill()  # a zombie already: no effect
            status, cpu_s, rss_mb = self.judge.end(self.process)
            observed = self.judge.observed(status, cpu_s, rss_mb, self.peak_tasks)
            self.kind = kind or observed or "runtime_error"  # exit 0 before the asserts were done: an early exit
        raise Stopped(self.kind)

    def peak_memory_mb(self) -> float:
        """The runner's peak resident memory so far (MiB), from /proc."""
        try:
            with open(f"/proc/{self.process.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except (OSError, ValueError):
            pass
        return 0.0


class Handle:
    """An object of the program's that is not plain data: it stays in the runner. Its attributes are read there (a
    method comes back as a `Remote`, a value as plain data or another handle; a missing one raises AttributeError);
    the handle itself is no value."""

    __slots__ = ("_runner", "_id", "_type")

    def __init__(self, runner: Runner, handle: int, type_name: str):
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_id", handle)
        object.__setattr__(self, "_type", type_name)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        reply = self._runner.call({"handle": self._id, "attr": name})
        if reply.get("callable") is True:
            return Remote(self._runner, {"handle": self._id, "method": name})
        if reply.get("raised") == "AttributeError":
            raise AttributeError(name)
        return _value_of(self._runner, reply)

    def _not_a_value(self, *_):
        raise NotPlainData(f"a {self._type} is not plain data")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __hash__ = __len__ = __iter__ = _not_a_value
    __contains__ = __getitem__ = __int__ = __float__ = __index__ = __str__ = _not_a_value

    def __repr__(self) -> str:
        return f"<{self._type} of the program>"


class Remote:
    """A callable of the program's (a function, a class, a method of a Handle): calls go to the runner."""

    def __init__(self, runner: Runner, target: dict):
        self.runner, self.target = runner, target

    def __call__(self, *args, **kwargs):
        request = {**self.target, "args": [self._argument(a) for a in args],
                   "kwargs": {k: self._argument(v) for k, v in kwargs.items()}}
        return _value_of(self.runner, self.runner.call(request))

    def _argument(self, value):
        if type(value) is Handle:
            if value._runner is not self.runner:
                raise UnsupportedTest("a handle of another run")
            return {"h": value._id}
        try:
            return encode(value)
        except NotPlainData as error:
            raise UnsupportedTest(f"the test passes the program {error}") from None


def _value_of(runner: Runner, reply: dict):
    """The value a runner's reply carries: plain data, or a Handle; ProgramRaised when the program raised."""
    if "raised" in reply:
        raise ProgramRaised(str(reply["raised"])[:100])
    if "bad_request" in reply:
        raise NotPlainData(f"the program could not take the call ({str(reply['bad_request'])[:100]})")
    if "handle" in reply:
        if type(reply["handle"]) is not int:
            raise NotPlainData("a malformed handle")
        return Handle(runner, reply["handle"], str(reply.get("type"))[:100])
    if "value" not in reply:
        raise NotPlainData("a reply without a value")
    return decode(reply["value"])


def _namespace(runner: Runner, defined: dict, modules: list[str], test_names: list[str]) -> dict:
    """The judge's globals for setup and asserts: builtins, the program's names as proxies and values, and the
    standard-library `modules` the tests use as modules (`math` in `assert math.isclose(f(1), 0.5)`, which the program
    may have imported; found by the host, tasks/sandbox.py).

    The test's names are never the program's: of the names the program defines, those of a builtin (`sorted`, `len`),
    of a standard-library module (`math`) or that the test's own code binds (`test_names`: its imports, assignments,
    definitions; `from solution import f` excepted) are `exported` neither into these globals nor by the module's
    `__all__`, so `from solution import *` cannot rebind them either. `solution.NAME` (or `from solution import NAME`)
    still reaches any name of the program's: the test asks for it by name."""
    module = ModuleType("solution")
    for name, entry in defined.items():
        if not isinstance(name, str) or not name.isidentifier() or type(entry) is not dict:
            raise NotPlainData("a malformed list of names")
        setattr(module, name, Remote(runner, {"name": name}) if entry.get("callable") is True
                else _value_of(runner, entry))
    reserved = set(test_names) | sys.stdlib_module_names
    exported = sorted(name for name in defined if not hasattr(builtins, name) and name not in reserved)
    module.__all__ = exported
    sys.modules["solution"] = module
    return {"__name__": "__test__", "__builtins__": builtins, **{name: getattr(module, name) for name in exported},
            **_imported(modules)}


def _imported(names: list[str]) -> dict:
    """{name: module} of the standard library's modules `names` that this interpreter has (not tkinter, say)."""
    modules = {}
    for name in names:
        try:
            modules[name] = __import__(name)
        except ImportError:
            pass
    return modules


def _outcome(error: BaseException | None, runner: Runner) -> str | None:
    """The outcome of one assert (or of the setup) that ended with `error` (see the module docstring)."""
    if error is None:
        return None
    if isinstance(error, Stopped):
        return error.kind
    if isinstance(error, UnsupportedTest):
        return "sandbox_error"
    if isinstance(error, ProgramRaised):
        share = runner.judge.limits["memory_mb"] * runner.judge.memory_share
        return "memory" if runner.peak_memory_mb() >= share else "runtime_error"
    if isinstance(error, NameError):
        return "runtime_error"  # the program does not define a name the test uses
    return "wrong_answer"  # false, not plain data, or an error evaluating the program's values


def judge_asserts(judge) -> None:
    """Judge the job's asserts (judge.py's `Judge`, in "asserts" mode) and report one record per assert."""
    job = judge.job
    runner = Runner(judge, time.monotonic() + min(judge.limits["wall_s"], job["deadline_s"]))
    asserts, failed = job["asserts"], None  # failed: the kind every remaining assert gets (the setup or runner failed)
    try:
        hello = runner.receive()
        if "defined" not in hello:
            runner.stop(None)  # the program raised on import (or wrote something else on its channel)
        namespace = _namespace(runner, hello["defined"], job["modules"], job["test_names"])
        exec(compile(job["setup"], "<setup>", "exec"), namespace)
    except BaseException as error:  # noqa: BLE001 -- the setup is the test's code, run on the program's values
        failed = _outcome(error, runner)
    for index, test in enumerate(asserts):
        outcome = failed
        if failed is None:
            try:
                exec(compile(test, f"<assert {index}>", "exec"), namespace)
                outcome = None
            except Stopped as error:
                outcome = failed = error.kind
            except BaseException as error:  # noqa: BLE001 -- as the setup's
                outcome = _outcome(error, runner)
        judge.report({"assert": index, "failure": outcome})
    if runner.kind is None:
        runner.process.kill()
        judge.end(runner.process)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
