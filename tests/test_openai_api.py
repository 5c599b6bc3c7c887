"""One request in: a language worker with ``--encoder-urls`` takes OpenAI requests (the official
``openai`` client, unmodified) and SGLang's ``image_data``, sends the images to its encoders
itself (split across them, a failed part sent again elsewhere) and answers exactly what the
two-request flow answers for the same prompt and images (real processes: two encode workers,
one language worker)."""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from test_generate_api import P, generate, images, metric, wait_idle  # noqa: F401  (fixture)
from transfer_large_image import make_image
from workers import WorkerProcess

from connector.failures import FailureKind, TransferFailure
from language_side.dispatch import Encoder, EncoderDispatch, _EncoderFault
from language_side.embedding_cache import EmbeddingCache

MESSAGES = [{"role": "system", "content": "Be brief."}]


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(3584)


@pytest.fixture(scope="module")
def cluster(folder):
    """Two encode workers and a language worker that knows them (and can be used for the
    two-request flow too, with the first encoder)."""
    encoders = [WorkerProcess("encode", "--model-path", folder) for _ in range(2)]
    lang = WorkerProcess("language", "--model-path", folder, "--embedding-default-allocate-buffer-size", "128",
                         "--encoder-urls", *[e.url for e in encoders])
    try:
        yield encoders, lang
    finally:
        lang.stop()
        for e in encoders:
            e.stop()


def client(lang) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lang.url}/v1", api_key="none", max_retries=0)


def data_uri(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def chat_messages(text: str, sources: list[str]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": s}} for s in sources] + [{"type": "text", "text": text}]
    return MESSAGES + [{"role": "user", "content": parts}]


def two_request(cluster, text: str, paths: list[str], max_tokens: int) -> dict:
    """The same chat through the two-request flow (the first encoder, a shared room)."""
    encoders, lang = cluster
    content = [{"type": "image"} for _ in paths] + [{"type": "text", "text": text}]
    return generate((encoders[0], lang), {"messages": MESSAGES + [{"role": "user", "content": content}],
                                          "sampling_params": {"max_new_tokens": max_tokens}}, paths)


def test_chat_with_images_streamed_or_not_answers_what_the_two_request_flow_does(cluster, images) -> None:  # noqa: F811
    encoders, lang = cluster
    paths = [images["square"], images["small"]]  # two images: one part per encoder
    reference = two_request(cluster, "Compare them.", paths, 12)
    oai = client(lang)
    sources = [paths[0], data_uri(paths[1])]  # a local path the encoders may read, and a data: URI
    answer = oai.chat.completions.create(model="qwen", messages=chat_messages("Compare them.", sources),
                                         max_tokens=12, temperature=0)
    assert answer.object == "chat.completion" and answer.model == "qwen" and answer.id.startswith("chatcmpl-")
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == reference["text"]
    assert answer.choices[0].finish_reason == reference["meta_info"]["finish_reason"]["type"]
    assert answer.usage.prompt_tokens == reference["meta_info"]["prompt_tokens"]
    assert answer.usage.completion_tokens == len(reference["output_ids"])
    for enc in encoders:  # each encoder got a part
        assert metric(lang, f'epd_encoder_parts_total{{encoder="{enc.url}",outcome="ok"}}') >= 1
    chunks = list(oai.chat.completions.create(model="qwen", messages=chat_messages("Compare them.", sources),
                                              max_tokens=12, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference["output_ids"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == answer.choices[0].finish_reason
    health = wait_idle(lang)
    assert health["generating"] == 0 and health["free_blocks"] == health["num_blocks"]


def test_generate_with_image_data_gives_the_two_request_tokens(cluster, images) -> None:  # noqa: F811
    """``image_data`` as a local path and as an http:// URL (the encoders fetch it)."""
    encoders, lang = cluster
    text = f"<|im_start|>user\n{P}What is it?<|im_end|>\n<|im_start|>assistant\n"
    reference = generate((encoders[0], lang), {"text": text, "sampling_params": {"max_new_tokens": 10}},
                         [images["wide"]])
    folder = Path(images["wide"]).parent
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{Path(images['wide']).name}"
        for source in (images["wide"], url):
            answer = requests.post(f"{lang.url}/generate", json={"text": text, "image_data": source,
                                                                 "sampling_params": {"max_new_tokens": 10}},
                                   timeout=120)
            assert answer.status_code == 200, answer.text
            assert answer.json()["output_ids"] == reference["output_ids"], source
            assert answer.json()["num_tokens"] == reference["num_tokens"]
    finally:
        server.shutdown()


def test_completions_models_and_errors_in_openai_shape(cluster, folder) -> None:
    _, lang = cluster
    oai = client(lang)
    [model] = oai.models.list().data
    assert model.object == "model" and model.id == folder
    reference = generate((None, lang), {"text": "Once upon", "sampling_params": {"max_new_tokens": 8}})
    answer = oai.completions.create(model=model.id, prompt="Once upon", max_tokens=8, temperature=0)
    assert answer.object == "text_completion" and answer.choices[0].text == reference["text"]
    assert answer.usage.completion_tokens == len(reference["output_ids"])
    streamed = oai.completions.create(model=model.id, prompt="Once upon", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reference["text"]
    cases = [({"n": 2}, "n"), ({"temperature": 3}, "temperature"), ({"extra_body": {"nonsense": 1}}, "nonsense")]
    for extra, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hi"}], **extra)
        assert caught.value.status_code == 400 and words in caught.value.body["message"], caught.value.body
        assert caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:  # an image the encoders refuse: the client's error
        oai.chat.completions.create(model="qwen", messages=chat_messages("?", ["/etc/passwd"]), max_tokens=2)
    assert "refused the image" in caught.value.body["message"]
    assert wait_idle(lang)["free_blocks"] == wait_idle(lang)["num_blocks"]


def test_a_killed_encoder_costs_a_retry_not_a_request(cluster, images, folder) -> None:  # noqa: F811
    """The second encoder is killed: requests whose part went to it are sent again to the first,
    invisibly; the dead one gets nothing new until its /health answers (it is started again on
    its port and takes parts again)."""
    encoders, lang = cluster
    paths = [images["small"], images["wide"]]
    reference = two_request(cluster, "Again?", paths, 8)["text"]
    victim = encoders[1]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    oai = client(lang)
    before = metric(lang, "epd_encoder_retries_total")
    for _ in range(3):
        answer = oai.chat.completions.create(model="qwen", messages=chat_messages("Again?", paths), max_tokens=8,
                                             temperature=0)
        assert answer.choices[0].message.content == reference
    assert metric(lang, "epd_encoder_retries_total") == before + 1  # once; then it is out of rotation
    assert metric(lang, "epd_encoders_healthy") == 1
    encoders[1] = WorkerProcess("encode", "--model-path", folder, port=victim.port,
                                bootstrap_port=victim.bootstrap_port)
    time.sleep(1.2)  # a probe is due
    answer = oai.chat.completions.create(model="qwen", messages=chat_messages("Again?", paths), max_tokens=8,
                                         temperature=0)
    assert answer.choices[0].message.content == reference
    assert metric(lang, "epd_encoders_healthy") == 2
    health = wait_idle(lang)
    assert health["generating"] == 0 and health["free_blocks"] == health["num_blocks"]


def test_an_image_sent_again_comes_from_the_cache_and_one_pixel_makes_another(cluster, tmp_path) -> None:
    """A multi-turn chat re-sends its image: the second turn asks no encoder (no part sent, a
    cache hit) and answers exactly as the first; an image one pixel away is encoded anew."""
    _, lang = cluster
    image = make_image(320, 240, seed=21)
    other = image.copy()
    other.putpixel((5, 5), tuple((c + 7) % 256 for c in image.getpixel((5, 5))))
    sources = {}
    for name, im in (("same", image), ("other", other)):
        im.save(tmp_path / f"{name}.png")
        sources[name] = data_uri(str(tmp_path / f"{name}.png"))
    oai = client(lang)

    def ask(source: str) -> str:
        return oai.chat.completions.create(model="qwen", messages=chat_messages("Turn?", [source]), max_tokens=6,
                                           temperature=0).choices[0].message.content

    parts = "epd_encoder_parts_total"
    first = ask(sources["same"])
    sent, hits = metric(lang, parts), metric(lang, "epd_embedding_cache_hits_total")
    assert ask(sources["same"]) == first and ask(sources["same"]) == first
    assert metric(lang, parts) == sent and metric(lang, "epd_embedding_cache_hits_total") == hits + 2
    ask(sources["other"])
    assert metric(lang, parts) == sent + 1 and metric(lang, "epd_embedding_cache_entries") >= 2
    assert metric(lang, "epd_embedding_cache_hits_total") == hits + 2


# Not a `faults` test although it kills an encoder: it asserts answers, not timing, so it runs beside others.
@pytest.mark.fast
@pytest.mark.parametrize("encoders, tried", [(1, 1), (2, 2), (4, 3)])
def test_a_part_is_tried_once_per_encoder_at_most_three_times_and_the_error_says_so(monkeypatch, encoders,
                                                                                    tried) -> None:
    """Issue 34 (3): with two encoders a part got two attempts and its 502 said "(2 tried)" where
    the README said 3 attempts. Each attempt goes to an encoder the part has not failed on (the
    same one would most likely fail it again, a detection later): min(3, encoders) attempts,
    and the error says which of them it made."""
    dispatch = EncoderDispatch([f"http://127.0.0.1:{9000 + i}" for i in range(encoders)], None, EmbeddingCache(0))
    asked: list[str] = []

    async def failing(enc, part_rid, sources, modality):
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

    async def refusing(enc, part_rid, sources, modality):
        raise _EncoderFault(f"encoder {enc.url} answered 503: the encode worker is asleep", busy=next(answers))

    async def healthy(enc) -> bool:
        return True

    monkeypatch.setattr(dispatch, "_encode_and_receive", refusing)
    monkeypatch.setattr(dispatch, "_probe", healthy)
    with pytest.raises(TransferFailure) as failure:
        asyncio.run(dispatch._part("rid", 0, ["image.png"]))
    assert failure.value.kind == kind and "the encode worker is asleep" in str(failure.value)


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


def test_three_encoders_two_language_workers_32_chats_one_encoder_killed_halfway(folder, images) -> None:  # noqa: F811
    """Every chat completes with the answer it gives without the kill: the parts on the killed
    encoder are sent again to the others, invisibly to the clients."""
    encoders = [WorkerProcess("encode", "--model-path", folder) for _ in range(3)]
    urls = [e.url for e in encoders]
    langs = []
    try:
        langs = [WorkerProcess("language", "--model-path", folder, "--embedding-default-allocate-buffer-size", "128",
                               "--image-embedding-cache-bytes", "0", "--encoder-urls", *urls) for _ in range(2)]
        kinds = [[images["small"]], [images["square"], images["wide"]], [images["wide"], images["small"],
                                                                          images["square"]], []]
        chats = [(f"Chat {i}?", kinds[i % 4], 4 + i % 5) for i in range(8)] * 4  # 8 kinds of chat, 4 of each

        def ask(i: int) -> str:
            text, paths, max_tokens = chats[i]
            return client(langs[i % 2]).chat.completions.create(
                model="qwen", messages=chat_messages(text, paths), max_tokens=max_tokens,
                temperature=0).choices[0].message.content

        with ThreadPoolExecutor(8) as pool:  # each kind once, without the kill
            alone = list(pool.map(ask, range(8))) * 4
        with ThreadPoolExecutor(32) as pool:
            running = []
            for i in range(32):  # arriving over three seconds; the kill lands halfway, parts in flight
                running.append(pool.submit(ask, i))
                if i == 16:
                    os.kill(encoders[2].proc.pid, signal.SIGKILL)
                time.sleep(0.1)
            done = [f.result() for f in running]
        assert done == alone
        retries = sum(metric(lang, "epd_encoder_retries_total") for lang in langs)
        assert retries >= 1  # some part went to the dead encoder and was sent again
        print(f"\n32 chats over 3 encoders and 2 language workers, one encoder killed halfway: all exact, "
              f"{retries:.0f} parts sent again")
        for lang in langs:
            health = wait_idle(lang)
            assert health["generating"] == 0 and health["free_blocks"] == health["num_blocks"]
    finally:
        for worker in langs + encoders:
            worker.stop()


@pytest.mark.serial
def test_more_images_than_an_encoder_takes_are_split_to_its_limit(cluster, tmp_path) -> None:
    """40 images in one request, two encoders that take 16 each (their /health says so): three
    parts, not two of 20 that both encoders refuse."""
    _, lang = cluster
    paths = []
    for i in range(40):
        paths.append(str(tmp_path / f"small{i}.png"))
        make_image(56, 56, seed=500 + i).save(paths[-1])
    parts = metric(lang, "epd_encoder_parts_total")
    answer = requests.post(f"{lang.url}/generate", timeout=120, json={
        "text": f"<|im_start|>user\n{P * 40}How many?<|im_end|>\n<|im_start|>assistant\n", "image_data": paths,
        "sampling_params": {"max_new_tokens": 2}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["num_tokens"] == 40 * 4  # 56x56: four merged patches each
    assert metric(lang, "epd_encoder_parts_total") == parts + 3


def test_a_clients_bad_input_is_its_400_and_blames_no_encoder(cluster, images) -> None:  # noqa: F811
    """An image reference with a NUL byte is refused as the client's error (400), not an encoder
    failure (502, the encoder out of rotation); an empty chat is 400; the encoder's /encode
    refuses fields it does not know."""
    encoders, lang = cluster
    retries = metric(lang, "epd_encoder_retries_total")
    nul = requests.post(f"{lang.url}/generate", timeout=60, json={
        "text": f"<|im_start|>user\n{P}?<|im_end|>\n<|im_start|>assistant\n", "image_data": [images["small"] + "\x00.png"]})
    assert nul.status_code == 400 and "must not contain a NUL character" in nul.json()["error"], nul.text
    chat = requests.post(f"{lang.url}/v1/chat/completions", json={"model": "qwen", "messages": []}, timeout=60)
    assert chat.status_code == 400 and "messages" in chat.text, chat.text
    empty = requests.post(f"{lang.url}/generate", json={"messages": []}, timeout=60)
    assert empty.status_code == 400 and "messages" in empty.text, empty.text
    unknown = requests.post(f"{encoders[0].url}/encode", timeout=60, json={
        "rid": "unknown-field", "bootstrap_room": 12345, "images": [images["small"]], "nonsense": 1})
    assert unknown.status_code == 400 and "unknown field(s) 'nonsense'" in unknown.json()["error"], unknown.text
    assert metric(lang, "epd_encoders_healthy") == 2 and metric(lang, "epd_encoder_retries_total") == retries


def test_asleep_or_aborted_requests_blame_no_encoder(cluster, tmp_path) -> None:
    """A language worker asleep answers 503 with Retry-After before asking any encoder; an
    /abort_request while its images are being encoded ends the request at once and gives every
    block back; neither takes an encoder out of rotation."""
    _, lang = cluster
    big = str(tmp_path / "big.png")
    make_image(3840, 2160, seed=8).save(big)
    text = f"<|im_start|>user\n{P}Big?<|im_end|>\n<|im_start|>assistant\n"
    assert requests.post(f"{lang.url}/sleep?level=1&preserve_state=true", timeout=60).status_code == 200
    try:
        asleep = requests.post(f"{lang.url}/generate", json={"text": text, "image_data": big}, timeout=60)
        assert asleep.status_code == 503 and asleep.headers.get("Retry-After"), asleep.text
    finally:
        assert requests.post(f"{lang.url}/wake_up", timeout=60).status_code == 200
    sent = metric(lang, "epd_encoder_parts_total")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, f"{lang.url}/generate", json={
            "rid": "abort-me", "text": text, "image_data": big}, timeout=120)
        time.sleep(0.5)  # a 4K frame takes the encoder about two seconds
        started = time.monotonic()
        assert requests.post(f"{lang.url}/abort_request", json={"rid": "abort-me"}, timeout=10).json()["aborted"]
        answer = pending.result()
    assert answer.status_code == 499, answer.text
    assert "aborted by /abort_request" in answer.json()["error"] and time.monotonic() - started < 1.5
    assert metric(lang, "epd_encoders_healthy") == 2 and metric(lang, "epd_encoder_parts_total") == sent
    health = wait_idle(lang)
    assert health["free_blocks"] == health["num_blocks"] and health["transferring"] == 0


def test_an_encoder_whose_digest_lies_loses_the_part_to_another(cluster, images, folder) -> None:  # noqa: F811
    """The embedding's digest is checked end to end: an encoder (here a proxy in front of a real
    one) that reports another digest than what landed has its part sent again to the next
    encoder, and leaves the rotation; the client sees the right answer."""
    encoders, lang = cluster
    real = encoders[0].url

    class Lying(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            answer = requests.get(real + self.path, timeout=10)
            self._reply(answer.status_code, answer.content)

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            answer = requests.post(real + self.path, data=body, headers={"Content-Type": "application/json"},
                                   timeout=120)
            reply = answer.json() | {"sha256": "0" * 64} if answer.status_code == 200 else answer.json()
            self._reply(answer.status_code, json.dumps(reply).encode())

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lying)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    liar = f"http://127.0.0.1:{proxy.server_address[1]}"
    other = WorkerProcess("language", "--model-path", folder, "--encoder-urls", liar, encoders[1].url)
    try:
        reference = two_request(cluster, "Honest?", [images["small"]], 6)["text"]
        answer = client(other).chat.completions.create(model="qwen", messages=chat_messages("Honest?", [
            images["small"]]), max_tokens=6, temperature=0)
        assert answer.choices[0].message.content == reference
        assert metric(other, f'epd_encoder_parts_total{{encoder="{liar}",outcome="failed"}}') == 1
        assert metric(other, f'epd_encoder_parts_total{{encoder="{encoders[1].url}",outcome="ok"}}') == 1
        assert metric(other, "epd_encoders_healthy") == 1  # the liar is out until its /health answers
        health = wait_idle(other)
        assert health["free_blocks"] == health["num_blocks"] and health["transferring"] == 0
    finally:
        other.stop()
        proxy.shutdown()
