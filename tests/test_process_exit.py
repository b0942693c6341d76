"""`process_exit.exit_with`: an entry point's process ends with its code after everything a normal exit does before
the interpreter's teardown (threads, `concurrent.futures` pools, atexit callbacks, logging's files, stdio), and
without that teardown. Each case is a real Python process."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import atexit, logging, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    from megatron_scalerl.process_exit import exit_with

    out = Path(sys.argv[1])

    class Teardown:  # a module global's finalizer runs only in the interpreter's teardown
        def __del__(self):
            (out / "teardown").write_text("ran")

    held = Teardown()

    def main():
        logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
        logging.info("logged before the end")
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        pool = ThreadPoolExecutor(1)
        pool.submit(lambda: (time.sleep(0.5), (out / "pool").write_text("done")))
        threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
        sys.stdout.write("no newline, not flushed")
        how = sys.argv[2]
        if how == "return":
            return 3
        if how == "none":
            return None
        if how == "exit":
            sys.exit(4)
        if how == "message":
            sys.exit("a message")
        raise RuntimeError("boom")

    exit_with(main)
''')


def _run(tmp_path, how):
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), str(tmp_path), how], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("how, code", [("return", 3), ("none", 0), ("exit", 4)])
def test_the_process_ends_with_mains_code_after_threads_and_callbacks_without_teardown(tmp_path, how, code):
    result = _run(tmp_path, how)
    assert result.returncode == code, result.stderr
    assert result.stdout == "no newline, not flushed"
    assert (tmp_path / "pool").read_text() == "done"  # the pool's worker finished its task (threading's callbacks)
    assert (tmp_path / "thread").read_text() == "done"  # the non-daemon thread was joined
    assert (tmp_path / "atexit").read_text() == "ran"
    assert "logged before the end" in (tmp_path / "log.txt").read_text()
    assert not (tmp_path / "teardown").exists()  # no interpreter teardown


@pytest.mark.parametrize("how, said", [("message", "a message"), ("raise", "RuntimeError: boom")])
def test_a_message_or_an_error_takes_pythons_usual_path(tmp_path, how, said):
    result = _run(tmp_path, how)
    assert result.returncode == 1
    assert said in result.stderr
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "teardown").read_text() == "ran"  # the usual exit, teardown included
