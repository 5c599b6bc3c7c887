"""What our language mode puts around SGLang's server, in this process: the ASGI guards (body
bound, error scrubbing), the prompt bound, secret redaction, the flags it gives SGLang, and the
``/health`` of a peer whose rooms failed. The same things on SGLang's running server:
``tests/test_sglang_language.py``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from connector.failures import FailureKind
from connector.peer_health import FailingPeers
from sglang_ext.http_guards import AsleepHealth, FreezeGcAfterWake, ScrubErrors, scrub
from sglang_ext.language_flags import cpu_kv_tokens, sglang_argv
from sglang_ext.prompt_bounds import MAX_BATCH_CHARS, too_long
from sglang_ext.redact import redact_command_line, redact_fields
from worker_infra.asgi import BodyLimit
from worker_infra.http import HTTPError
from worker_infra.trust import BootstrapAllowList

pytestmark = pytest.mark.fast

LIMIT = 1000
HANDLER_WAIT_S = 30  # how long the stand-ins for SGLang's handlers wait while the scheduler is paused
AT_ONCE_S = 20  # an answer within this did not wait for such a handler (below HANDLER_WAIT_S)


def guarded_app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return JSONResponse({"bytes": len(await request.body())})

    @app.post("/boom")
    async def boom():
        return JSONResponse({"message": 'failed\n  File "/srv/app/sglang/x.py", line 12, in handler\nat /opt/y.py'},
                            status_code=500)

    app.add_middleware(ScrubErrors)
    app.add_middleware(BodyLimit, max_bytes=LIMIT, flag="--max-request-body-bytes")
    return app


def post(path: str, content, headers: dict | None = None) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=guarded_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, content=content, headers=headers or {})

    return asyncio.run(send())


class Sleeper:
    """What AsleepHealth reads of the language worker."""

    def __init__(self) -> None:
        self.asleep = False

    def is_sleeping(self) -> bool:
        return self.asleep


def test_health_answers_at_once_while_asleep_and_reaches_sglangs_route_when_awake() -> None:
    app, connector = FastAPI(), Sleeper()

    @app.get("/health")
    @app.get("/health_generate")
    async def health():  # as SGLang's: waits for a generated token, which a paused scheduler never makes
        await asyncio.sleep(0 if not connector.asleep else HANDLER_WAIT_S)
        return JSONResponse({}, status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": connector.asleep})

    app.add_middleware(AsleepHealth, connector=connector)

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await asyncio.wait_for(client.get(path), AT_ONCE_S)

    assert asyncio.run(get("/health")).status_code == 200
    connector.asleep = True
    for path in ("/health", "/health_generate"):
        answer = asyncio.run(get(path))
        assert answer.status_code == 503 and answer.headers["retry-after"] == FailureKind.ASLEEP.retry_after
        assert answer.json()["sleeping"] is True and "asleep" in answer.json()["message"]
    assert asyncio.run(get("/is_sleeping")).json() == {"is_sleeping": True}  # other routes pass
    connector.asleep = False
    assert asyncio.run(get("/health_generate")).status_code == 200


def test_freeze_gc_is_deferred_to_the_wake_up_while_asleep() -> None:
    """SGLang's launcher calls /freeze_gc once warm; on a server booted asleep its handler waits
    for the paused scheduler (10 s, then a logged traceback). Asleep: answered at once, noted."""
    app, connector, pending = FastAPI(), Sleeper(), asyncio.Event()
    frozen = []

    @app.post("/freeze_gc")
    async def freeze_gc():  # as SGLang's: asks the scheduler
        await asyncio.sleep(0 if not connector.asleep else HANDLER_WAIT_S)
        frozen.append(True)
        return JSONResponse({}, status_code=200)

    app.add_middleware(FreezeGcAfterWake, connector=connector, pending=pending)

    async def post_freeze() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await asyncio.wait_for(client.post("/freeze_gc"), AT_ONCE_S)

    connector.asleep = True
    answer = asyncio.run(post_freeze())
    assert answer.status_code == 200 and answer.json()["deferred"] is True
    assert pending.is_set() and frozen == []
    connector.asleep = False
    assert asyncio.run(post_freeze()).status_code == 200 and frozen == [True]


def test_a_body_at_the_bound_passes_and_one_byte_more_is_413_declared_or_streamed() -> None:
    assert (post("/echo", b"x" * LIMIT)).json() == {"bytes": LIMIT}
    declared = post("/echo", b"x" * (LIMIT + 1))
    assert declared.status_code == 413 and "--max-request-body-bytes" in declared.json()["message"]

    async def stream():
        for _ in range(LIMIT // 100 + 1):
            yield b"y" * 100

    streamed = post("/echo", stream())  # no Content-Length: chunked
    assert streamed.status_code == 413 and "more than 1000" in streamed.json()["message"]
    bogus = post("/echo", b"{}", headers={"content-length": "-5"})
    assert bogus.status_code == 413


def test_error_answers_lose_stack_frames_and_source_paths() -> None:
    answer = post("/boom", b"")
    assert answer.status_code == 500
    message = answer.json()["message"]
    assert message.startswith("failed") and ".py" not in message and "File" not in message, message
    assert int(answer.headers["content-length"]) == len(answer.content)


def test_scrub_leaves_clean_bodies_alone_and_handles_json_escapes() -> None:
    clean = b'{"error": "image 3 is not a PNG"}'
    assert scrub(clean) is clean
    escaped = json.dumps({"message": 'bad body\n\n  File "/a/b/http_server.py", line 928, in generate_request\n'
                                     "    POST /generate"}).encode()
    cleaned = json.loads(scrub(escaped))["message"]
    assert "http_server.py" not in cleaned and cleaned.startswith("bad body") and "POST /generate" in cleaned


def test_error_answers_name_no_workers_address() -> None:
    """The reason reaches the client; the encoders' URLs and the peers' endpoints stay in the logs."""
    reason = json.dumps({"message": "request r: no encoder could encode part 0 (tried 2 of 3 encoders): encoder "
                                    "http://10.1.2.3:30001 answered 502: room 7 (rank 127.0.0.1:36525) aborted by "
                                    "language peer 127.0.0.1:33275; tcp://[fd00::5]:7001 and enc-2.cluster.local:8998 "
                                    "gone; a 640x480 image of 3.5 MB at 1.5x"}).encode()
    message = json.loads(scrub(reason))["message"]
    for address in ("10.1.2.3", "127.0.0.1", "fd00::5", "enc-2.cluster.local", "30001", "33275"):
        assert address not in message, message
    assert message == ("request r: no encoder could encode part 0 (tried 2 of 3 encoders): encoder <address> "
                       "answered 502: room 7 (rank <address>) aborted by language peer <address>; <address> and "
                       "<address> gone; a 640x480 image of 3.5 MB at 1.5x"), message


def test_prompts_too_long_for_any_context_are_refused_before_tokenizing() -> None:
    from types import SimpleNamespace as Req

    assert too_long(Req(text="a" * 16 * 100), 100) is None
    assert "cannot fit the model's context of 100" in too_long(Req(text="a" * (16 * 100 + 1)), 100)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 10**6}}
    chat = Req(messages=[{"role": "user", "content": [image, {"type": "text", "text": "x" * 900}]},
                         {"role": "assistant", "content": "y" * 900}])
    assert "1800 characters" in too_long(chat, 100)  # the conversation counts whole, images not at all
    batch = Req(text=["z" * 1_000_000] * 5)  # each fits a 100K context; together over the batch bound
    assert too_long(batch, 100_000) is not None and str(MAX_BATCH_CHARS) in too_long(batch, 100_000)


def test_secrets_are_redacted_in_fields_and_command_lines() -> None:
    fields = redact_fields({"admin_api_key": "K", "api_key": None, "ssl_keyfile_password": "p", "port": 1})
    assert fields == {"admin_api_key": "<redacted>", "api_key": None, "ssl_keyfile_password": "<redacted>", "port": 1}
    line = redact_command_line("--model-path m --admin-api-key K --api-key=A --control-secret S --port 8")
    assert line == ("--model-path m --admin-api-key <redacted> --api-key=<redacted> --control-secret <redacted> "
                    "--port 8")
    assert redact_command_line(["--api-key", "--api-key"]) == "--api-key <redacted>"


def test_our_language_mode_gives_sglang_its_bounds_and_cpu_defaults(tmp_path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"text_config": {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                              "hidden_size": 512, "max_position_embeddings": 4096}}
    (folder / "config.json").write_text(json.dumps(config))
    budget = cpu_kv_tokens(str(folder), memory=8 << 30)  # 2 x 4 x 2 x 64 x 2 = 2 KiB a token
    assert budget.bytes_per_token == 2048 and budget.tokens == 4 * 4096  # 4 contexts < 1 GiB's 512K tokens
    assert cpu_kv_tokens(str(folder), memory=64 << 20).tokens == (64 << 20) // 8 // 2048
    ours = argparse.Namespace(model_path=str(folder), max_images_per_request=5, checkpoint_dir=None, kv_budget=budget,
                              pd_role=None)
    argv = sglang_argv(["--disaggregation-mode", "language", "--model-path", str(folder), "--device", "cpu"], ours)
    assert argv[argv.index("--max-total-tokens") + 1] == str(budget.tokens)
    assert json.loads(argv[argv.index("--limit-mm-data-per-request") + 1]) == {"image": 5, "video": 5, "audio": 5}
    assert "--disaggregation-mode" not in argv and "--skip-server-warmup" not in argv
    own = sglang_argv(["--language-only", "--limit-mm-data-per-request", '{"image": 2}', "--device", "cpu"],
                      argparse.Namespace(**{**vars(ours), "kv_budget": None}))
    assert own.count("--limit-mm-data-per-request") == 1 and "--max-total-tokens" not in own
    prefill = sglang_argv(["--disaggregation-mode", "prefill", "--language-only", "--model-path", str(folder),
                           "--device", "cpu"], argparse.Namespace(**{**vars(ours), "pd_role": "prefill"}))
    assert prefill[prefill.index("--disaggregation-mode") + 1] == "prefill" and prefill.count("--language-only") == 1
    assert "--sleep-on-idle" in prefill and "--enable-mixed-chunk" not in prefill  # no decode batch to mix


def test_sglangs_pd_roles_get_the_cpu_path_where_the_user_set_none(tmp_path, monkeypatch) -> None:
    """On a CPU a PD decode keeps its retraction backup in plain tensors, both roles get the CPU
    backend, device and a KV pool sized to the machine, a prefill skips the early send of cached
    prefixes; nothing the user set is changed."""
    from sglang_ext.pd import EARLY_SEND_ENV, cpu_argv, cpu_environment, pd_role

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                     "num_key_value_heads": 2, "hidden_size": 256,
                                                     "max_position_embeddings": 4096}))
    decode = cpu_argv(["--disaggregation-mode", "decode", "--model-path", str(folder)], "decode")
    assert decode[decode.index("--disaggregation-decode-retraction-backup") + 1] == "cpu_tensor"
    assert decode[decode.index("--attention-backend") + 1] == "torch_native"
    assert decode[decode.index("--device") + 1] == "cpu"
    assert int(decode[decode.index("--max-total-tokens") + 1]) == cpu_kv_tokens(str(folder)).tokens
    mine = ["--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "none",
            "--max-total-tokens", "999", "--attention-backend", "sdpa"]
    assert cpu_argv(mine, "decode") == [*mine, "--device", "cpu", "--sleep-on-idle"]
    assert cpu_argv([*mine, "--sleep-on-idle"], "decode").count("--sleep-on-idle") == 1
    assert "--disaggregation-decode-retraction-backup" not in cpu_argv(["--model-path", str(folder)], "prefill")
    assert [pd_role(["--disaggregation-mode", m]) for m in ("prefill", "decode", "language", "null")] == [
        "prefill", "decode", None, None]
    monkeypatch.delenv(EARLY_SEND_ENV, raising=False)
    cpu_environment("decode")
    assert EARLY_SEND_ENV not in os.environ
    cpu_environment("prefill")
    assert os.environ[EARLY_SEND_ENV] == "0"


def test_the_two_request_flow_is_open_only_to_the_hosts_allowed_for_it() -> None:
    """A client names the room of the two-request flow, so only ``--allowed-bootstrap-hosts``
    opens it: an encoder the server sends images to (``--encoder-urls``) is not thereby one a
    client may name."""
    closed = BootstrapAllowList([])
    with pytest.raises(HTTPError) as refused:
        closed.check("127.0.0.1", 8998)
    assert refused.value.kind.http_status == 403 and "needs --allowed-bootstrap-hosts 127.0.0.1" in str(refused.value)
    BootstrapAllowList(["127.0.0.1"]).check("127.0.0.1", 8998)
    only_port = BootstrapAllowList(["10.0.0.5:8998"])
    only_port.check("10.0.0.5", 8998)
    with pytest.raises(HTTPError):
        only_port.check("10.0.0.5", 8999)


def test_rooms_a_peer_took_no_part_in_do_not_list_it_unless_it_is_gone() -> None:
    """Rooms made up by a client time out without the peer having joined them: however many,
    they do not list a healthy peer as failing. A peer found dead is listed all the same."""
    peers = FailingPeers(threshold=3)
    for _ in range(8):
        peers.failed("encoder-a", FailureKind.TIMEOUT, "no data within 300s", joined=False)
    assert peers.report() == []
    for _ in range(3):
        peers.failed("encoder-a", FailureKind.PEER_DEAD, "no heartbeat", joined=False)
    assert peers.report()[0]["rooms_failed_in_a_row"] == 3


def test_a_peers_failures_stop_degrading_health_once_they_stop() -> None:
    now = [0.0]
    peers = FailingPeers(threshold=3, window=30.0, clock=lambda: now[0])
    for _ in range(3):
        peers.failed("encoder-a", FailureKind.PEER_DEAD, "gone", joined=True)
    assert [p["peer"] for p in peers.report()] == ["encoder-a"]
    now[0] = 29.0
    assert peers.report()
    now[0] = 31.0  # no failure of it for the window: its other peers serve, the worker is not degraded
    assert peers.report() == []
    peers.failed("encoder-a", FailureKind.PEER_DEAD, "gone again", joined=True)  # still counted: one more failure lists it
    assert peers.report()[0]["rooms_failed_in_a_row"] == 4
    peers.succeeded("encoder-a")
    assert peers.report() == []
