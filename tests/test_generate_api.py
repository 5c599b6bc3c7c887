"""The language worker as an LLM server, through real worker processes on the seeded checkpoint
folder: ``/generate`` with an image goes encode worker -> connector (with a resume round) ->
language engine and gives transformers' monolithic tokens; streaming gives the same tokens and
text; 8 concurrent mixed requests give what each gives alone; abort and a client that goes away
end a request in every phase and give back its blocks and KV; bad bodies get a 400."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from monolithic import reference_tokens
from transfer_large_image import make_image
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
from workers import InProcessWorker, model_workers

from embedding_side.encoders import QwenVisionEncoder

P = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(3584)


LANGUAGE_FLAGS = ("--embedding-default-allocate-buffer-size", "128", "--max-total-tokens", "8192")


@pytest.fixture(scope="module")
def workers(folder):
    """An encode worker and a language worker on the folder; the language side's default
    allocation is small, so a 448x448 image (256 tokens) needs a resume round."""
    with model_workers(folder, *LANGUAGE_FLAGS) as pair:
        yield pair


@pytest.fixture(scope="module")
def in_process_language(folder):
    """The same language worker, its app served in this process (the fast tier's path)."""
    worker = InProcessWorker("language", "--model-path", folder, *LANGUAGE_FLAGS)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("serve-images")
    paths = {}
    for name, (w, h, seed) in {"small": (224, 224, 1), "square": (448, 448, 2), "wide": (640, 336, 3)}.items():
        paths[name] = str(folder / f"{name}.png")
        make_image(w, h, seed=seed).save(paths[name])
    return paths


class Rooms:
    def __init__(self) -> None:
        self.next, self.lock = 1000, threading.Lock()

    def take(self) -> int:
        with self.lock:
            self.next += 1
            return self.next


ROOMS = Rooms()


def generate(workers, body: dict, image_paths: list[str] = (), stream: bool = False) -> dict:
    """One request: the encoder gets the images (in its own thread), the language worker the
    prompt. A streamed answer is folded into the same shape as a plain one."""
    encode, lang = workers
    body = dict(body, stream=stream)
    if image_paths:
        room = ROOMS.take()
        body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port, "bootstrap_room": room}
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(requests.post, f"{encode.url}/encode", json={
            "rid": body.get("rid", str(room)), "bootstrap_room": room, "images": list(image_paths)},
            timeout=300) if image_paths else None
        answer = requests.post(f"{lang.url}/generate", json=body, timeout=300, stream=stream)
        assert answer.status_code == 200, answer.text
        if sent is not None:
            assert sent.result().status_code == 200, sent.result().text
    if not stream:
        return answer.json()
    return fold_stream(answer)


def fold_stream(answer: requests.Response) -> dict:
    events = [line[len(b"data: "):] for line in answer.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("finish_reason" not in c for c in chunks[:-1]) and "finish_reason" in chunks[-1]
    return {"text": "".join(c["text"] for c in chunks), "output_ids": [t for c in chunks for t in c["output_ids"]],
            "meta_info": chunks[-1]["meta_info"], "usage": chunks[-1]["usage"], "chunks": len(chunks)}


@pytest.fixture(scope="module")
def reference(folder):
    encoder = QwenVisionEncoder(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    return lambda text, paths, n: reference_tokens(model, encoder, tokenizer, text, [_open(p) for p in paths], n)


def _open(path: str):
    from PIL import Image

    return Image.open(path).convert("RGB")


def test_generate_with_images_through_the_wire_gives_the_monolithic_tokens(workers, images, reference) -> None:
    cases = [
        (CHAT.format(f"{P}What is in the picture?"), [images["square"]]),
        (f"First {P} then, after some words, {P} and a question?", [images["small"], images["wide"]]),
        (CHAT.format("No image at all."), []),
    ]
    for text, paths in cases:
        answer = generate(workers, {"text": text, "sampling_params": {"max_new_tokens": 16}}, paths)
        assert answer["output_ids"] == reference(text, paths, 16), text
        meta = answer["meta_info"]
        assert meta["completion_tokens"] == len(answer["output_ids"]) and meta["finish_reason"]["type"] in (
            "length", "stop")
        if paths:
            assert answer["resume_rounds"] >= 1 and len(answer["sha256"]) == 64
            assert meta["image_tokens"] == answer["num_tokens"] and meta["transfer_ms"] > 0
        assert meta["prefill_ms"] > 0 and meta["first_token_ms"] >= meta["prefill_ms"]


def test_chat_messages_and_streaming_give_the_same_tokens_and_text(workers, images, folder) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    params = {"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 11}
    plain = generate(workers, {"messages": messages, "sampling_params": params}, [images["small"]])
    streamed = generate(workers, {"messages": messages, "sampling_params": params}, [images["small"]], stream=True)
    assert streamed["output_ids"] == plain["output_ids"] and streamed["text"] == plain["text"]
    assert plain["text"] == tokenizer.decode(plain["output_ids"], skip_special_tokens=True)
    assert streamed["chunks"] == len(plain["output_ids"])  # one event per token
    assert streamed["usage"]["completion_tokens"] == len(plain["output_ids"])
    assert streamed["usage"]["prompt_tokens"] == plain["meta_info"]["prompt_tokens"] > 64


def test_a_stop_string_ends_the_text_before_it_in_both_modes(workers) -> None:
    free = generate(workers, {"text": "Go on.", "sampling_params": {"max_new_tokens": 40}})
    text = free["text"]
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isprintable() and text[i:i + 2].strip())
    body = {"text": "Go on.", "sampling_params": {"max_new_tokens": 40, "stop": [stop]}}
    for stream in (False, True):
        answer = generate(workers, body, stream=stream)
        assert answer["text"] == text[:text.index(stop)]
        assert answer["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.load
def test_eight_concurrent_mixed_requests_give_what_each_gives_alone(workers, images) -> None:
    specs = [
        ({"text": CHAT.format(f"{P}Describe."), "sampling_params": {"max_new_tokens": 20}}, [images["square"]], False),
        ({"text": CHAT.format("Only text."), "sampling_params": {"max_new_tokens": 30}}, [], True),
        ({"text": f"{P} and {P}?", "sampling_params": {"max_new_tokens": 12, "temperature": 0.7, "seed": 5}},
         [images["small"], images["wide"]], False),
        ({"text": CHAT.format(f"{P}Sampled."), "sampling_params": {"max_new_tokens": 25, "temperature": 1.0,
                                                                     "top_p": 0.8, "seed": 9}}, [images["wide"]], True),
        ({"text": "Short.", "sampling_params": {"max_new_tokens": 4}}, [], False),
        ({"text": CHAT.format(f"{P}Long one."), "sampling_params": {"max_new_tokens": 40}}, [images["small"]], True),
        ({"text": "Seeded text.", "sampling_params": {"max_new_tokens": 16, "temperature": 0.5, "top_k": 20,
                                                      "seed": 123}}, [], False),
        ({"text": CHAT.format(f"{P}{P}Two."), "sampling_params": {"max_new_tokens": 18}},
         [images["square"], images["small"]], True),
    ]
    alone = [generate(workers, body, paths, stream)["output_ids"] for body, paths, stream in specs]
    with ThreadPoolExecutor(len(specs)) as pool:
        together = list(pool.map(lambda spec: generate(workers, spec[0], spec[1], spec[2])["output_ids"], specs))
    assert together == alone
    _, lang = workers
    assert wait_idle(lang)["generating"] == 0


def wait_idle(lang, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = requests.get(f"{lang.url}/health", timeout=10).json()
        if (health["generating"] == 0 and health["free_blocks"] == health["num_blocks"]
                and health["transferring"] == 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def metric(lang, name: str) -> float:
    text = requests.get(f"{lang.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_abort_and_disconnect_end_a_request_in_each_phase_and_give_everything_back(workers) -> None:
    encode, lang = workers
    # waiting for its embedding (inited, the encoder has no /encode for it): /abort_request
    body = {"rid": "wait-emb", "text": f"{P}?", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": encode.bootstrap_port, "bootstrap_room": ROOMS.take()}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, f"{lang.url}/generate", json=body, timeout=60)
        _until(lambda: requests.get(f"{lang.url}/health").json()["transferring"] == 1)
        assert requests.post(f"{lang.url}/abort_request", json={"rid": "wait-emb"}).json()["aborted"] is True
        assert pending.result().status_code == 499 and "aborted by /abort_request" in pending.result().text
    # decoding, streamed: /abort_request ends the stream with finish_reason abort
    aborted_running = metric(lang, 'epd_generations_aborted_total{phase="running"}')
    answer = requests.post(f"{lang.url}/generate", json={"rid": "long", "text": "x", "stream": True,
                                                         "sampling_params": {"max_new_tokens": 5000}},
                           stream=True, timeout=60)
    lines = answer.iter_lines()
    assert next(line for line in lines if line.startswith(b"data: "))
    assert requests.post(f"{lang.url}/abort_request", json={"rid": "long"}).json()["aborted"] is True
    rest = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert rest[-1]["finish_reason"]["type"] == "abort" and rest[-1]["meta_info"]["completion_tokens"] < 5000
    # decoding, the client goes away
    answer = requests.post(f"{lang.url}/generate", json={"rid": "gone", "text": "y", "stream": True,
                                                         "sampling_params": {"max_new_tokens": 5000}},
                           stream=True, timeout=60)
    assert next(line for line in answer.iter_lines() if line.startswith(b"data: "))
    answer.close()
    _until(lambda: metric(lang, 'epd_generations_aborted_total{phase="running"}') == aborted_running + 2)
    # prefill of a long prompt: the abort lands at the step boundary after it
    with ThreadPoolExecutor(1) as pool:
        long_prompt = pool.submit(requests.post, f"{lang.url}/generate", json={
            "rid": "prefill", "text": "word " * 1200, "sampling_params": {"max_new_tokens": 2000}}, timeout=120)
        time.sleep(0.2)
        assert requests.post(f"{lang.url}/abort_request", json={"rid": "prefill"}).json()["aborted"] is True
        ended = long_prompt.result().json()
    assert ended["meta_info"]["finish_reason"]["type"] == "abort" and len(ended["output_ids"]) <= 2
    health = wait_idle(lang)
    assert health["generating"] == 0 and health["free_blocks"] == health["num_blocks"]
    assert metric(lang, "epd_kv_tokens_used") == 0
    assert requests.post(f"{lang.url}/abort_request", json={"rid": "nobody"}).json()["aborted"] is False


def _until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("body, message", [
    ({"text": "x", "bogus": 1}, "bogus: Extra inputs are not permitted"),
    ({"text": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one of text and messages"),
    ({}, "exactly one of text and messages"),
    ({"text": ""}, "the prompt is empty"),
    ({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be in"),
    ('{"text": "x", "sampling_params": {"temperature": Infinity}}', "sampling_params.temperature"),
    ('{"text": "x", "sampling_params": {"max_new_tokens": 4.5}}', "sampling_params.max_new_tokens"),
    ('[1, 2]', "Input should be an object"),
    ({"text": "x", "sampling_params": {"stop": [""]}}, "stop must be"),
    ({"text": "x", "bootstrap_room": 5}, "go together"),
    ({"text": f"a {P}"}, "1 image placeholders but no bootstrap_room"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"text": "word " * 33000}, "the model takes at most 32768"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 9000}}, "the KV budget is 8192"),
])
@pytest.mark.parametrize("where", ["process", pytest.param("in_process", marks=pytest.mark.fast)])
def test_bad_bodies_get_400_naming_the_problem(request, where, body, message) -> None:
    lang = request.getfixturevalue("in_process_language") if where == "in_process" else request.getfixturevalue(
        "workers")[1]
    raw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) else {"json": body}
    answer = requests.post(f"{lang.url}/generate", timeout=60, **raw)
    assert answer.status_code == 400 and message in answer.json()["error"], answer.text


def test_an_embedding_that_does_not_match_the_placeholders_is_a_400_and_its_blocks_come_back(workers, images) -> None:
    encode, lang = workers
    room = ROOMS.take()
    body = {"rid": "mismatch", "text": f"{P} and {P}", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": encode.bootstrap_port, "bootstrap_room": room}
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(requests.post, f"{encode.url}/encode",
                           json={"rid": "mismatch", "bootstrap_room": room, "images": [images["small"]]}, timeout=60)
        answer = requests.post(f"{lang.url}/generate", json=body, timeout=60)
        assert sent.result().status_code == 200
    assert answer.status_code == 400 and "2 image placeholders for 1 images" in answer.json()["error"]
    assert wait_idle(lang)["free_blocks"] == wait_idle(lang)["num_blocks"]


def test_sleep_without_preserve_state_ends_running_generations_clearly(workers) -> None:
    _, lang = workers
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(requests.post, f"{lang.url}/generate", json={
            "rid": "sleepy", "text": "z", "sampling_params": {"max_new_tokens": 5000}}, timeout=60)
        _until(lambda: requests.get(f"{lang.url}/health").json()["generating"] == 1)
        assert requests.post(f"{lang.url}/sleep?preserve_state=false", timeout=30).status_code == 200
        finish = running.result().json()["meta_info"]["finish_reason"]
    assert finish == {"type": "abort", "message": "the language worker went to sleep (preserve_state=false)"}
    refused = requests.post(f"{lang.url}/generate", json={"text": "asleep?"}, timeout=30)
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert requests.post(f"{lang.url}/wake_up", timeout=30).status_code == 200
    assert generate(workers, {"text": "awake", "sampling_params": {"max_new_tokens": 3}})["meta_info"][
        "completion_tokens"] == 3


def test_the_3b_width_works_end_to_end_the_same_way(seeded_checkpoint, images) -> None:
    """A 2048-wide seeded model (the 3B geometry): both workers with --hidden-size 2048."""
    folder = seeded_checkpoint(2048)
    text = CHAT.format(f"{P}Describe.")
    with model_workers(folder, "--embedding-default-allocate-buffer-size", "128", both=("--hidden-size", "2048")) as pair:
        answer = generate(pair, {"text": text, "sampling_params": {"max_new_tokens": 12}}, [images["square"]])
    assert answer["resume_rounds"] >= 1
    encoder = QwenVisionEncoder(folder)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    expected = reference_tokens(model, encoder, AutoTokenizer.from_pretrained(folder), text,
                                [_open(images["square"])], 12)
    assert answer["output_ids"] == expected
