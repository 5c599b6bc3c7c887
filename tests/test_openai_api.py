"""One request in: SGLang's own server as the language worker, with ``--encoder-urls``, takes OpenAI
requests (the official ``openai`` client, unmodified) and SGLang's ``image_data``, sends the
images to its encoders itself (split across them, a failed part sent again elsewhere: our
``EncoderDispatch`` under SGLang's tokenizer manager) and answers what SGLang's ``/generate``
answers for the same prompt and images, whose ids are transformers' monolithic greedy ones
(``monolithic.greedy_mismatch``).

Real processes, started once for the module: three encode workers (SGLang's encoder, as users
run it) and two SGLang language servers, started side by side: the first
sends to encoders 0 and 1, the second to encoder 0 (through a relay in this process, which a
test makes lie about the embedding's digest), 1 and 2.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests
from monolithic import greedy_mismatch
from sglang_stack import (
    IMAGE,
    connector_idle,
    encode_worker,
    encoder_health,
    generate,
    language_server,
    metric,
    start_together,
    text_reference,
    write_images,
)
from transfer_large_image import make_image

from connector.failures import FailureKind, TransferFailure
from harness.workers import WorkerProcess
from language_side.dispatch import (
    WATCH_INTERVAL,
    Encoder,
    EncoderDispatch,
    _EncoderFault,
    affinity_of,
    rendezvous_weight,
)
from language_side.embedding_cache import EmbeddingCache

pytestmark = pytest.mark.sglang

SYSTEM = "Be brief."
MESSAGES = [{"role": "system", "content": SYSTEM}]
# the chat template's prompt for MESSAGES and one user turn (what SGLang renders for chat_messages)
CHAT = "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\n{images}{text}<|im_end|>\n<|im_start|>assistant\n"
MAX_IMAGES = 40  # --max-images-per-request of the first server: the split test sends 40
PROBE_TIMEOUT_S = 2  # a /health probe's timeout (language_side.dispatch.EncoderDispatch._probe)
# SGLang's encoder on the 3840x2160 image here, at a serial test's priority (meta_info's encode_ms:
# 690 to 750 ms; its transfer to the language side takes as long again)
ENCODE_4K_S = 0.7


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(256, layers=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    paths = write_images(tmp_path_factory.mktemp("openai-images"))
    paths["224x224"] = str(Path(paths["other"]).with_name("224x224.png"))
    make_image(224, 224, seed=1).save(paths["224x224"])
    return paths


@pytest.fixture(scope="module")
def reference(folder):
    return text_reference(folder)


class Relay:
    """An encoder's HTTP API passed through (``/health``, ``/encode``) from a port of its own;
    with ``lying`` set, each ``/encode`` answer reports another digest than the embedding's."""

    def __init__(self, target: str) -> None:
        self.lying = False
        relay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                answer = requests.get(target + self.path, timeout=10)
                self._reply(answer.status_code, answer.content)

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                answer = requests.post(target + self.path, data=body, headers={"Content-Type": "application/json"},
                                       timeout=120)
                if answer.status_code != 200 or not relay.lying:
                    return self._reply(answer.status_code, answer.content)
                self._reply(200, json.dumps(answer.json() | {"sha256": "0" * 64}).encode())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Cluster:
    encoders: list[WorkerProcess]  # 0 and 1: the first server's; 0 (through the relay), 1 and 2: the second's
    lang: WorkerProcess
    second: WorkerProcess
    relay: Relay  # in front of encoder 0, for the second server


@pytest.fixture(scope="module")
def cluster(folder):
    encoders = start_together(*[functools.partial(encode_worker, folder) for _ in range(3)])
    relay = Relay(encoders[0].url)
    try:
        lang, second = start_together(
            functools.partial(language_server, folder, [e.url for e in encoders[:2]], "--max-images-per-request",
                              str(MAX_IMAGES)),
            functools.partial(language_server, folder, [relay.url, encoders[1].url, encoders[2].url]))
    except BaseException:
        relay.close()
        for e in encoders:
            e.stop()
        raise
    cluster = Cluster(encoders, lang, second, relay)
    try:
        yield cluster
    finally:
        for worker in (lang, second, *cluster.encoders):
            worker.stop()
        relay.close()


def client(lang: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lang.url}/v1", api_key="none", max_retries=0, timeout=240)


def data_uri(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def chat_messages(text: str, sources: list[str]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": s}} for s in sources] + [{"type": "text", "text": text}]
    return MESSAGES + [{"role": "user", "content": parts}]


def chat(lang: WorkerProcess, text: str, sources: list[str], max_tokens: int, **extra):
    """A greedy chat of ``max_tokens`` (no EOS: every token comes) with ``sources`` before ``text``."""
    return client(lang).chat.completions.create(model="qwen", messages=chat_messages(text, sources),
                                                max_tokens=max_tokens, temperature=0,
                                                extra_body={"ignore_eos": True}, **extra)


def answer_of(lang: WorkerProcess, text: str, sources: list[str], max_tokens: int) -> str:
    return chat(lang, text, sources, max_tokens).choices[0].message.content


def chat_as_generate(lang: WorkerProcess, text: str, paths: list[str], max_tokens: int, rid: str) -> dict:
    """The same chat as a ``/generate`` of the chat template's prompt: its body, checked for 200."""
    answer = generate(lang, paths, rid, max_tokens, text=CHAT.format(images=IMAGE * len(paths), text=text))
    assert answer.status_code == 200, answer.text
    return answer.json()


def parts(lang: WorkerProcess, encoder: str, outcome: str = "ok") -> float:
    return metric(lang, f'epd_encoder_parts_total{{encoder="{encoder}",outcome="{outcome}"}}')


def healthy_encoders_become(lang: WorkerProcess, want: int, timeout: float = 30.0) -> None:
    """Until ``epd_encoders_healthy`` reads ``want``: the background probes take an encoder in or
    out of rotation within an interval and a probe's timeout, and a busy live encoder whose probe
    timed out is back at the next one (the deadline is for "never")."""
    deadline = time.monotonic() + timeout
    while (healthy := metric(lang, "epd_encoders_healthy")) != want:
        assert time.monotonic() < deadline, f"{healthy:g} encoders healthy after {timeout:g} s, not {want}"
        time.sleep(WATCH_INTERVAL / 10)


def assert_idle(lang: WorkerProcess) -> None:
    health = connector_idle(lang)
    assert health["free_blocks"] == health["num_blocks"] and health["transferring"] == 0, health


def test_chat_with_images_streamed_or_not_answers_what_generate_does_which_is_monolithic(cluster, images,
                                                                                       reference) -> None:
    """Two images (a local path and a data: URI): one part per encoder. The chat's text, token
    counts and finish reason are those of ``/generate`` with the chat template's prompt, whose ids
    are transformers' monolithic ones; the stream gives the same text and usage."""
    lang, encoders = cluster.lang, cluster.encoders
    paths = [images["224x224"], images["448x448"]]
    direct = chat_as_generate(lang, "Compare them.", paths, 12, "chat-direct")
    text = CHAT.format(images=IMAGE * 2, text="Compare them.")
    assert greedy_mismatch(direct["output_ids"], reference(text, paths, 12)) is None
    sources = [paths[0], data_uri(paths[1])]  # a local path the encoders may read, and a data: URI
    healthy_encoders_become(lang, 2)  # both in rotation: a part each
    before = [parts(lang, e.url) for e in encoders[:2]]
    answer = chat(lang, "Compare them.", sources, 12)
    assert answer.object == "chat.completion" and answer.model == "qwen" and answer.id
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == direct["text"]
    assert answer.choices[0].finish_reason == direct["meta_info"]["finish_reason"]["type"] == "length"
    assert answer.usage.prompt_tokens == direct["meta_info"]["prompt_tokens"]
    assert answer.usage.completion_tokens == len(direct["output_ids"]) == 12
    assert [parts(lang, e.url) for e in encoders[:2]] == [b + 1 for b in before]  # each encoder got a part
    chunks = list(chat(lang, "Compare them.", sources, 12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == answer.choices[0].finish_reason
    assert_idle(lang)


def test_generate_with_image_data_as_a_path_or_a_url_gives_the_monolithic_tokens(cluster, images, reference) -> None:
    """``image_data`` as a local path and as an http:// URL (the encoders fetch it): the same ids,
    transformers' monolithic ones."""
    lang = cluster.lang
    text = CHAT.format(images=IMAGE, text="What is it?")
    expected = reference(text, [images["other"]], 10)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(Path(images["other"]).parent)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{Path(images['other']).name}"
        answers = []
        for i, source in enumerate((images["other"], url)):
            answer = generate(lang, [source], f"image-data-{i}", 10, text=text)
            assert answer.status_code == 200, answer.text
            answers.append(answer.json())
            assert greedy_mismatch(answer.json()["output_ids"], expected) is None, source
    finally:
        server.shutdown()
        server.server_close()
    assert answers[0]["output_ids"] == answers[1]["output_ids"]
    assert answers[0]["meta_info"]["image_tokens"] == answers[1]["meta_info"]["image_tokens"] == 12 * 23


def test_completions_models_and_errors_in_openai_shape(cluster, folder) -> None:
    """``/v1/models`` names the checkpoint; a completion (plain and streamed) is ``/generate``'s text;
    sampling parameters out of range are the client's 400 naming them, in SGLang's error shape; an
    image the encoders refuse is the client's 400 too."""
    lang = cluster.lang
    oai = client(lang)
    [model] = oai.models.list().data
    assert model.object == "model" and model.id == folder
    direct = generate(lang, [], "once-upon", 8, text="Once upon")
    assert direct.status_code == 200, direct.text
    direct = direct.json()
    answer = oai.completions.create(model=model.id, prompt="Once upon", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert answer.object == "text_completion" and answer.choices[0].text == direct["text"]
    assert answer.usage.completion_tokens == len(direct["output_ids"]) == 8
    streamed = oai.completions.create(model=model.id, prompt="Once upon", max_tokens=8, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == direct["text"]
    cases = [({"max_tokens": -1}, "max_new_tokens"), ({"top_p": 5}, "top_p"),
             ({"frequency_penalty": 9}, "frequency_penalty"), ({"extra_body": {"top_k": -5}}, "top_k")]
    for extra, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hi"}], **extra)
        assert caught.value.status_code == 400 and words in caught.value.body["message"], caught.value.body
        assert caught.value.body["type"] == "BadRequestError", caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:  # an image the encoders refuse: the client's error
        oai.chat.completions.create(model="qwen", messages=chat_messages("?", ["/etc/passwd"]), max_tokens=2)
    # the encoder's own answer ("refused the image"), or, when the room's failure came first and
    # that answer not within the grace, the room's reason: the same cause either way
    assert "only read inside --allowed-local-media-path" in caught.value.body["message"], caught.value.body
    assert_idle(lang)


def test_a_killed_encoder_costs_a_retry_not_a_request(cluster, images, folder) -> None:
    """The second encoder is killed: a part that goes to it before the background probe finds it
    dead is sent again to the first, invisibly (at most once); the dead one gets nothing new until
    its /health answers (it is started again on its port, the probes find it within seconds, and
    it takes parts again)."""
    lang, encoders = cluster.lang, cluster.encoders
    paths = [images["224x224"], images["other"]]
    before_kill = answer_of(lang, "Again?", paths, 8)  # one part on each encoder
    victim = encoders[1]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    retries = metric(lang, "epd_encoder_retries_total")
    for _ in range(3):
        assert answer_of(lang, "Again?", paths, 8) == before_kill
    assert metric(lang, "epd_encoder_retries_total") - retries in (0, 1)  # then it is out of rotation
    healthy_encoders_become(lang, 1)
    encoders[1] = encode_worker(folder, port=victim.port, bootstrap_port=victim.bootstrap_port)
    healthy_encoders_become(lang, 2)  # found back by the probes, with no request
    assert answer_of(lang, "Again?", paths, 8) == before_kill
    healthy_encoders_become(lang, 2)  # both in rotation: a part each
    taken = parts(lang, victim.url)
    assert answer_of(lang, "Again?", paths, 8) == before_kill
    assert parts(lang, victim.url) == taken + 1
    assert_idle(lang)


def test_an_image_sent_again_comes_from_the_cache_and_one_pixel_makes_another(cluster, tmp_path) -> None:
    """A multi-turn chat re-sends its image: the second turn asks no encoder (no part sent, a
    cache hit) and answers exactly as the first; an image one pixel away is encoded anew."""
    lang = cluster.lang
    image = make_image(320, 240, seed=21)
    other = image.copy()
    other.putpixel((5, 5), tuple((c + 7) % 256 for c in image.getpixel((5, 5))))
    sources = {}
    for name, im in (("same", image), ("other", other)):
        im.save(tmp_path / f"{name}.png")
        sources[name] = data_uri(str(tmp_path / f"{name}.png"))

    def ask(source: str) -> str:
        return answer_of(lang, "Turn?", [source], 6)

    sent = "epd_encoder_parts_total"
    first = ask(sources["same"])
    before, hits = metric(lang, sent), metric(lang, "epd_embedding_cache_hits_total")
    assert ask(sources["same"]) == first and ask(sources["same"]) == first
    assert metric(lang, sent) == before and metric(lang, "epd_embedding_cache_hits_total") == hits + 2
    ask(sources["other"])
    assert metric(lang, sent) == before + 1 and metric(lang, "epd_embedding_cache_entries") >= 2
    assert metric(lang, "epd_embedding_cache_hits_total") == hits + 2


# Not a `faults` test although it kills an encoder: it asserts answers, not timing, so it runs beside others.
@pytest.mark.fast
@pytest.mark.parametrize("encoders, tried", [(1, 1), (2, 2), (4, 3)])
def test_a_part_is_tried_once_per_encoder_at_most_three_times_and_the_error_says_so(monkeypatch, encoders,
                                                                                    tried) -> None:
    """Each attempt goes to an encoder the part has not failed on (the
    same one would most likely fail it again, a detection later): min(3, encoders) attempts,
    and the error says which of them it made."""
    dispatch = EncoderDispatch([f"http://127.0.0.1:{9000 + i}" for i in range(encoders)], None, EmbeddingCache(0))
    asked: list[str] = []

    async def failing(enc, part_rid, sources, modality, cache_salt=None):
        asked.append(enc.url)
        raise _EncoderFault(f"encoder {enc.url} failed the room")

    async def healthy(enc) -> bool:
        return True

    monkeypatch.setattr(dispatch, "_encode_and_receive", failing)
    monkeypatch.setattr(dispatch, "_probe", healthy)
    with pytest.raises(TransferFailure) as failure:
        asyncio.run(dispatch._part("rid", 0, ["image.png"]))
    assert len(asked) == len(set(asked)) == tried
    assert f"(tried {tried} of {encoders} encoders, one attempt each, at most 3)" in str(failure.value)


@pytest.mark.fast
@pytest.mark.parametrize("busy, kind", [([True, True], FailureKind.OVERLOADED), ([True, False], FailureKind.PEER_FAILED)])
def test_a_part_every_encoder_refused_as_busy_is_a_503_not_a_502(monkeypatch, busy, kind) -> None:
    """Encoders that answered 429/503 (over their queue, or asleep) everywhere the part was tried:
    the client is told to come back (503, Retry-After), not that the encoders failed (502)."""
    dispatch = EncoderDispatch([f"http://127.0.0.1:{9000 + i}" for i in range(len(busy))], None, EmbeddingCache(0))
    answers = iter(busy)

    async def refusing(enc, part_rid, sources, modality, cache_salt=None):
        raise _EncoderFault(f"encoder {enc.url} answered 503: the encode worker is asleep", busy=next(answers))

    async def healthy(enc) -> bool:
        return True

    monkeypatch.setattr(dispatch, "_encode_and_receive", refusing)
    monkeypatch.setattr(dispatch, "_probe", healthy)
    with pytest.raises(TransferFailure) as failure:
        asyncio.run(dispatch._part("rid", 0, ["image.png"]))
    assert failure.value.kind == kind and "the encode worker is asleep" in str(failure.value)


@pytest.mark.fast
def test_the_healthy_encoders_gauge_follows_their_health_without_traffic(monkeypatch) -> None:
    """Three encoders answering /health (real HTTP servers); one stops, no request comes: from
    the first scrape on, the background probes take it out of rotation and the gauge reads 2
    within the round under way and the next (an interval and a probe's timeout each), and 3
    again once it answers."""
    import language_side.dispatch as dispatch_module

    interval = 0.2
    monkeypatch.setattr(dispatch_module, "WATCH_INTERVAL", interval)
    within = 2 * (interval + PROBE_TIMEOUT_S)  # the probes' round under way at the stop, then the next

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = json.dumps({"bootstrap_port": 8998, "preprocessing": "p", "modalities": ["image"]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health) for _ in range(3)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    dispatch = EncoderDispatch([f"http://127.0.0.1:{s.server_address[1]}" for s in servers], None, EmbeddingCache(0))

    def gauge() -> float:
        line = [x for x in dispatch.render_metrics().decode().splitlines() if x.startswith("epd_encoders_healthy ")]
        return float(line[0].split()[1])

    async def scrape_until(want: float) -> float:
        dispatch.watch()
        deadline = time.monotonic() + 30  # for "never": the time is asserted below
        while gauge() != want and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return gauge()

    async def run() -> tuple[float, float, float]:
        try:
            first = await scrape_until(3)
            port = servers[1].server_address[1]
            servers[1].shutdown()
            servers[1].server_close()
            stopped_at = time.monotonic()
            after_stop = await scrape_until(2)
            assert time.monotonic() - stopped_at < within, time.monotonic() - stopped_at
            servers[1] = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
            threading.Thread(target=servers[1].serve_forever, daemon=True).start()
            return first, after_stop, await scrape_until(3)
        finally:
            await dispatch.close()

    try:
        assert asyncio.run(run()) == (3, 2, 3)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.mark.fast
def test_a_room_this_worker_failed_is_its_own_answer_though_the_encoders_echo_came_with_it(monkeypatch) -> None:
    """This worker's pool full ("no free blocks ... within 60s", 503): it tells the encoder, whose
    /encode then answers 502 "aborted by language peer". When both are in by the time the part
    looks, the worker's own reason decides (503, come back), not the echo (502, blaming the
    encoder), and no other encoder is tried."""
    from concurrent.futures import Future

    full = TransferFailure(FailureKind.OVERLOADED, "no free blocks for the default allocation within 60s")

    class PoolFull:
        def submit(self, rid: str, bootstrap_addr: str, room: int) -> Future:
            self.room = Future()
            return self.room

        def cancel(self, rid: str, reason: str) -> None:
            pass

    dispatch = EncoderDispatch(["http://127.0.0.1:9000", "http://127.0.0.1:9001"], PoolFull(), EmbeddingCache(0))
    asked: list[str] = []

    async def echo(enc, part_rid, room, media):
        asked.append(enc.url)
        dispatch.worker.room.set_exception(full)  # failed here first ...
        raise _EncoderFault(f"encoder {enc.url} answered 502: room {room} aborted by language peer")  # ... then told

    async def healthy(enc) -> bool:
        enc.bootstrap_port = 8998
        return True

    monkeypatch.setattr(dispatch, "_post_encode", echo)
    monkeypatch.setattr(dispatch, "_probe", healthy)
    monkeypatch.setattr(dispatch, "_session", "unused: /encode is answered above")
    with pytest.raises(TransferFailure) as failure:
        asyncio.run(dispatch._part("rid", 0, ["image.png"]))
    assert failure.value.kind == FailureKind.OVERLOADED and "no free blocks" in str(failure.value), failure.value
    assert len(asked) == 1


@pytest.mark.fast
def test_an_encoders_busy_refusal_through_the_room_goes_to_another_encoder_ours_does_not() -> None:
    """An encoder asleep or over its queue may tell the language side by failing the room before
    its /encode answers 503: that part goes to another encoder (busy). This worker's own refusal
    of the same kind is the client's answer as it is."""
    encoder = Encoder("http://127.0.0.1:9000", "127.0.0.1")

    async def received(failure: TransferFailure):
        done = asyncio.get_running_loop().create_future()
        done.set_exception(failure)
        return await EncoderDispatch._received(encoder, done)

    with pytest.raises(_EncoderFault) as theirs:
        asyncio.run(received(TransferFailure(FailureKind.ASLEEP, "the encode worker is asleep", by_peer=True)))
    assert theirs.value.busy
    with pytest.raises(TransferFailure) as ours:
        asyncio.run(received(TransferFailure(FailureKind.ASLEEP, "this worker is asleep")))
    assert ours.value.kind == FailureKind.ASLEEP


@pytest.mark.serial
def test_more_images_than_an_encoder_takes_are_split_to_its_limit(cluster, tmp_path) -> None:
    """40 images in one request (the server's cap is 40), two encoders that take 16 each (their
    /health says so): three parts, not two of 20 that both encoders refuse."""
    lang = cluster.lang
    paths = []
    for i in range(40):
        paths.append(str(tmp_path / f"small{i}.png"))
        make_image(56, 56, seed=500 + i).save(paths[-1])
    sent = metric(lang, "epd_encoder_parts_total")
    answer = generate(lang, paths, "forty-images", 2, text=CHAT.format(images=IMAGE * 40, text="How many?"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["image_tokens"] == 40 * 4  # 56x56: four merged patches each
    assert metric(lang, "epd_encoder_parts_total") == sent + 3


def test_a_clients_bad_input_is_its_400_and_blames_no_encoder(cluster, images) -> None:
    """An image reference with a NUL byte is refused as the client's error (400, the encoder's
    words), not an encoder failure (502, the encoder out of rotation); an empty chat, and a
    ``/generate`` with no prompt, are 400; the encoder's /encode refuses fields it does not know."""
    lang, encoders = cluster.lang, cluster.encoders
    retries = metric(lang, "epd_encoder_retries_total")
    failed = [parts(lang, e.url, "failed") for e in encoders[:2]]
    nul = generate(lang, [images["224x224"] + "\x00.png"], "nul", 2)
    assert nul.status_code == 400, nul.text
    assert "must not contain a NUL character" in nul.json()["error"]["message"], nul.text
    empty_chat = requests.post(f"{lang.url}/v1/chat/completions", json={"model": "qwen", "messages": []}, timeout=60)
    assert empty_chat.status_code == 400 and "messages" in empty_chat.json()["message"].lower(), empty_chat.text
    no_prompt = requests.post(f"{lang.url}/generate", json={"messages": []}, timeout=60)
    assert no_prompt.status_code == 400 and "text, input_ids or input_embeds" in no_prompt.text, no_prompt.text
    unknown = requests.post(f"{encoders[0].url}/encode", timeout=60, json={
        "rid": "unknown-field", "bootstrap_room": 12345, "images": [images["224x224"]], "nonsense": 1})
    assert unknown.status_code == 400 and "unknown field(s) 'nonsense'" in unknown.json()["error"], unknown.text
    # no part failed on an encoder (which takes it out of rotation) and none was sent again
    assert [parts(lang, e.url, "failed") for e in encoders[:2]] == failed
    assert metric(lang, "epd_encoder_retries_total") == retries


@pytest.mark.serial  # timed: an abort answered before the encode ends
def test_asleep_or_aborted_requests_blame_no_encoder(cluster, images) -> None:
    """A language server asleep answers 503 with Retry-After before asking any encoder; an
    /abort_request while its images are being encoded ends the request at once (499) and gives
    every block back; neither takes an encoder out of rotation (no part ends, failed or not)."""
    lang = cluster.lang
    big = images["3840x2160"]  # the encoder takes ENCODE_4K_S
    sent = metric(lang, "epd_encoder_parts_total")
    assert requests.post(f"{lang.url}/sleep?level=1&preserve_state=true", timeout=60).status_code == 200
    try:
        asleep = generate(lang, [big], "asleep", 2)
        assert asleep.status_code == 503 and asleep.headers.get("Retry-After"), asleep.text
    finally:
        assert requests.post(f"{lang.url}/wake_up", timeout=60).status_code == 200
    assert metric(lang, "epd_encoder_parts_total") == sent
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate, lang, [big], "abort-me", 2)
        # its part at an encoder: the rid is the server's (an abort before it would find nothing)
        deadline = time.monotonic() + 30
        while not any(encoder_health(e)["pending"] for e in cluster.encoders[:2]):
            assert time.monotonic() < deadline, "no /encode reached an encoder"
            time.sleep(0.05)
        started = time.monotonic()
        assert requests.post(f"{lang.url}/abort_request", json={"rid": "abort-me"}, timeout=10).status_code == 200
        answer = pending.result()
        answered = time.monotonic() - started
    assert answer.status_code == 499, answer.text
    assert "aborted by /abort_request" in answer.json()["error"]["message"]
    print(f"\nan abort while the 4K image is encoded answered in {answered * 1000:.0f} ms")
    # halfway to the end of the encode the part had just begun (where an abort that waited for it would be)
    assert answered < ENCODE_4K_S / 2, answered
    assert metric(lang, "epd_encoder_parts_total") == sent  # none failed: no encoder out of rotation
    assert_idle(lang)


def test_an_encoder_whose_digest_lies_loses_the_part_to_another(cluster, images, tmp_path) -> None:
    """The embedding's digest is checked end to end: an encoder (the relay in front of a real
    one) that reports another digest than what landed has its part sent again to the next
    encoder, and leaves the rotation; the client gets the answer of the same chat through one
    honest encoder (the other server's). The image goes by a path that hashes to the liar."""
    second, liar = cluster.second, cluster.relay.url
    urls = [liar, *(e.url for e in cluster.encoders[1:])]

    def hashed_to(path: str) -> str:
        return max(urls, key=lambda url: rendezvous_weight(affinity_of(path, None), url))

    path = next(p for p in (str(tmp_path / f"{i}.png") for i in range(256)) if hashed_to(p) == liar)
    shutil.copy(images["224x224"], path)
    honest = answer_of(cluster.lang, "Honest?", [images["224x224"]], 6)
    failed, taken = parts(second, liar, "failed"), parts(second, liar)
    exits = metric(second, f'epd_encoder_rotation_exits_total{{encoder="{liar}"}}')
    others = sum(parts(second, e.url) for e in cluster.encoders[1:])
    cluster.relay.lying = True
    try:
        assert answer_of(second, "Honest?", [path], 6) == honest
    finally:
        cluster.relay.lying = False
    assert parts(second, liar, "failed") == failed + 1 and parts(second, liar) == taken
    assert sum(parts(second, e.url) for e in cluster.encoders[1:]) == others + 1
    # the liar left the rotation (counted when it happens: the gauge of healthy encoders is back at 3
    # once the background probe, every 2 s, finds the relay's /health answering)
    assert metric(second, f'epd_encoder_rotation_exits_total{{encoder="{liar}"}}') >= exits + 1
    assert_idle(second)


def test_three_encoders_two_language_servers_32_chats_one_encoder_killed_halfway(cluster, images) -> None:
    """Last in the module: encoder 1, which both servers send to, is killed (not started again).
    Every chat completes with the answer it gives without the kill: the parts on the killed
    encoder are sent again to the others, invisibly to the clients."""
    langs = [cluster.lang, cluster.second]
    kinds = [[images["224x224"]], [images["448x448"], images["other"]],
             [images["other"], images["224x224"], images["448x448"]], []]
    chats = [(f"Chat {i}?", kinds[i % 4], 4 + i % 5) for i in range(8)] * 4  # 8 kinds of chat, 4 of each

    def ask(i: int) -> str:
        text, paths, max_tokens = chats[i]
        return answer_of(langs[i % 2], text, paths, max_tokens)

    with ThreadPoolExecutor(8) as pool:  # each kind once, without the kill
        alone = list(pool.map(ask, range(8))) * 4
    retries = sum(metric(lang, "epd_encoder_retries_total") for lang in langs)
    victim = cluster.encoders[1]
    in_flight = f'epd_encoder_outstanding_tokens{{encoder="{victim.url}"}}'

    def kill_once_a_part_is_on_it() -> bool:
        if not any(metric(lang, in_flight) > 0 for lang in langs):
            return False
        os.kill(victim.proc.pid, signal.SIGKILL)
        return True

    with ThreadPoolExecutor(32) as pool:
        running, killed = [], False
        for i in range(32):  # arriving over three seconds; the kill lands halfway, with a part on it
            running.append(pool.submit(ask, i))
            killed = killed or (i >= 16 and kill_once_a_part_is_on_it())
            time.sleep(0.1)
        while not killed:  # none on it since the 16th: it gets one while the last chats run
            assert not all(f.done() for f in running), "no part went to encoder 1 after the 16th chat"
            killed = kill_once_a_part_is_on_it() or time.sleep(0.05)
        done = [f.result() for f in running]
    assert done == alone
    retries = sum(metric(lang, "epd_encoder_retries_total") for lang in langs) - retries
    assert retries >= 1  # some part went to the dead encoder and was sent again
    print(f"\n32 chats over 3 encoders and 2 language servers, one encoder killed halfway: all exact, "
          f"{retries:.0f} parts sent again")
    for lang in langs:
        assert_idle(lang)
