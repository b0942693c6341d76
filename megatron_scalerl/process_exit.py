"""How our processes end: `exit_with(main)` runs an entry point and ends the process without the interpreter's teardown.

After a normal exit CPython tears down every module the process imported, which costs CPU and nothing else: 0.4 s
for `import torch`, 0.55 s with transformers and dynamo, 1.65 s for vLLM (2 cores; bench/process_exit.py,
docs/benchmarks.md). Every trainer rank, orchestrator, API server and `scalerl` call pays it. `exit_with` first does what a
normal exit does before the teardown, in the same order:

1. `threading`'s own exit callbacks (`concurrent.futures` tells its pools' workers to finish there), then every
   non-daemon thread joined (`threading._shutdown`, as `Py_FinalizeEx` calls it);
2. the `atexit` callbacks, newest first (logging's `shutdown` flushes and closes its handlers; multiprocessing joins
   its children; wandb finishes its run);
3. `sys.stdout` and `sys.stderr` flushed;

then `os._exit` with the code `main` returned (None is 0) or the integer its `SystemExit` carried. What the teardown
would also have done is skipped: flushing a file object still open at exit (our writers close theirs: `with open`,
`fileio.atomic_write`) and the finalizers of objects alive at exit. A `main` that raises anything else, or exits with
a message, takes Python's usual path (the traceback or message, then exit status 1), teardown included.
"""

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_with(main: Callable[[], int | None]) -> NoReturn:
    """Run `main`; end the process with its exit code once threads and exit callbacks are done (module docstring)."""
    try:
        code = main()
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            raise  # a message for stderr: Python prints it
        code = exc.code
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, a closed pipe, a closed file
            pass
    os._exit(code or 0)
