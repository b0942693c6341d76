"""The generators' API key without a server: the run's key file (created 0600, reused, the user's key winning), the
key flags of `scalerl serve` and `scalerl eval`, and the middleware on a real Starlette app (HTTP of any method and
WebSocket handshakes refused without the key, GET /health open, no key: no server). The launched servers:
tests/test_rollout_serve.py and tests/test_pipeline_run.py."""

import importlib
import os
import stat

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from megatron_scalerl.commands import main
from megatron_scalerl.errors import UserError
from megatron_scalerl.run.directory import API_KEY_FILE, read_api_key_file, run_api_key

KEY = "k3y-of-the-test"


def test_a_run_makes_its_own_key_once_private_and_the_users_wins(tmp_path):
    key, source = run_api_key(tmp_path, env={})
    path = tmp_path / API_KEY_FILE
    assert source == str(path) and len(key) >= 43  # token_urlsafe(32): 256 random bits
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert run_api_key(tmp_path, env={}) == (key, str(path))  # --resume, a requeued job: the same key
    assert [p.name for p in tmp_path.iterdir()] == [API_KEY_FILE]  # no temp file left behind
    other = tmp_path / "other"
    other.mkdir()
    assert run_api_key(other, env={"SCALERL_API_KEY": KEY}) == (KEY, "$SCALERL_API_KEY")
    assert not (other / API_KEY_FILE).exists()  # the user's key is written nowhere
    path.chmod(0o644)
    with pytest.raises(UserError, match=f"API key file {path}: other users may read it .*chmod 600"):
        run_api_key(tmp_path, env={})
    (other / "empty").write_text("\n")
    (other / "empty").chmod(0o600)
    with pytest.raises(UserError, match="is empty"):
        read_api_key_file(other / "empty")


def test_serve_needs_a_key_and_warns_about_one_on_its_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SCALERL_API_KEY", raising=False)
    absent = str(tmp_path / "no_model")  # every case ends before a server would start
    assert main(["serve", "--model", absent]) == 2
    assert "scalerl serve needs an API key" in capsys.readouterr().err
    assert main(["serve", "--model", absent, "--api-key", KEY]) == 2
    err = capsys.readouterr().err
    assert "warning: --api-key puts the key on the command line, where `ps` shows it" in err
    assert "--api-key-file" in err and "not a Hugging Face checkpoint directory" in err  # it went on, with the key
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    for argv, env in ((["--no-api-key"], None), (["--api-key-file", str(key_file)], None), ([], KEY)):
        if env:
            monkeypatch.setenv("SCALERL_API_KEY", env)
        assert main(["serve", "--model", absent, *argv]) == 2
        err = capsys.readouterr().err
        assert "not a Hugging Face checkpoint directory" in err and "warning" not in err, (argv, err)
    assert main(["serve", "--model", absent, "--no-api-key"]) == 2  # $SCALERL_API_KEY is still set
    assert "--no-api-key, but an API key is given" in capsys.readouterr().err


def test_eval_takes_its_key_from_a_file_the_environment_or_the_flag(tmp_path, monkeypatch, capsys):
    from megatron_scalerl.commands import build_parser
    from megatron_scalerl.commands.eval import _request

    parser = build_parser(["eval"])  # the command's own parser
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    base = ["eval", "aime", "--endpoint", "http://h:1", "--model", "m", "--out", str(tmp_path)]
    monkeypatch.setenv("SCALERL_API_KEY", "from-env")
    assert _request(parser.parse_args(base + ["--api-key-file", str(key_file)]), samples=1, endpoint="", model="",
                    out=tmp_path).api_key == KEY
    assert _request(parser.parse_args(base), samples=1, endpoint="", model="", out=tmp_path).api_key == "from-env"
    assert "warning" not in capsys.readouterr().err
    assert _request(parser.parse_args(base + ["--api-key", KEY]), samples=1, endpoint="", model="",
                    out=tmp_path).api_key == KEY
    assert "`ps` shows it" in capsys.readouterr().err


@pytest.fixture
def server_auth(monkeypatch):
    """The middleware module as vLLM imports it: with VLLM_API_KEY in the environment."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    import megatron_scalerl.inference.server_auth as module

    return importlib.reload(module)


async def _echo(websocket):
    await websocket.accept()
    await websocket.send_text("in")
    await websocket.close()


def test_the_middleware_guards_every_method_and_websockets_but_not_health(server_auth):
    app = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("ok")),
                            Route("/collective_rpc", lambda request: PlainTextResponse("ran"), methods=["POST"]),
                            WebSocketRoute("/ws", _echo)])
    app.add_middleware(server_auth.RequireApiKey)  # as vLLM adds a class given to --middleware
    client = TestClient(app)
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/health").text == "ok"
    for method in ("POST", "OPTIONS", "GET", "DELETE"):
        answer = client.request(method, "/collective_rpc")
        assert answer.status_code == 401 and "API key" in answer.json()["error"], method
        assert client.request(method, "/collective_rpc", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.options("/health").status_code == 401 and client.post("/health").status_code == 401
    assert client.post("/collective_rpc", headers=bearer).text == "ran"
    with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/ws"):
        pass
    assert refused.value.code == 1008  # closed before the handshake is accepted
    with client.websocket_connect("/ws", headers=bearer) as websocket:
        assert websocket.receive_text() == "in"


def test_the_middleware_refuses_to_load_without_a_key(server_auth, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set: refusing to start a server"):
        importlib.reload(server_auth)
    assert "VLLM_API_KEY" not in os.environ
