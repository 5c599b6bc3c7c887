"""SGLang's own encoder as the encode worker (``python -m sglang.launch_server
--disaggregation-mode encode``), sending through the resumable connector to SGLang's own language
server, on a family our former tower never knew: Qwen3-VL (16 px patches, deepstack rows of
256 x 3 = 768). Qwen2.5-VL runs the same way in test_sglang_language.

One encoder and one language server for the module. The language side allocates 2048 tokens
first, so the 3840x2160 image (8,160 tokens) is sent in several resume rounds. Every generated id
is checked against transformers' monolithic ``generate`` from the pixels (its own processor and
model) on the same checkpoint, whose greedy ids depend on the picture (checked too): equal at
every step (``monolithic.greedy_mismatch``). Videos (MP4) too: the
reference gets the frames SGLang's encoder samples, decoded by the same library.
"""

from __future__ import annotations

import base64
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
from make_checkpoint import write_qwen3_vl_checkpoint
from monolithic import greedy_mismatch
from sglang_stack import (
    CLIPS,
    NEW_TOKENS,
    SGLANG_LAUNCH,
    SIZES,
    encoder_health,
    family_reference,
    generate,
    generate_as_reference,
    generate_videos,
    sglang_pair,
    write_clips,
    write_images,
)
from test_faults import wait_for
from test_sleep_workers import sleep_, wake

from connector.poll import KVPoll
from connector.receiver import finish_receiving
from harness.workers import WorkerProcess

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("compiled_torch")]  # as users run it

FIRST_ALLOCATION = 2048  # tokens the language side allocates before it knows an image's size
ENCODER_PEAK_BYTES = 3 << 30  # the encode worker's resident peak with the 4K image (the bound)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(write_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3-vl")))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return write_images(tmp_path_factory.mktemp("qwen3-images"))


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    return write_clips(tmp_path_factory.mktemp("qwen3-clips"))


@pytest.fixture(scope="module")
def workers(folder):
    with sglang_pair(folder, "--max-total-tokens", "32768", "--skip-server-warmup",
                         "--embedding-default-allocate-buffer-size", str(FIRST_ALLOCATION)) as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' own Qwen3-VL ``generate`` from the pixels (``sglang_stack.family_reference``)."""
    return family_reference(folder)


def test_the_encode_worker_runs_sglangs_encoder_for_the_checkpoint(workers) -> None:
    encode, language = workers
    assert "encoder=sglang:qwen3_vl" in encode.ready_line, encode.ready_line
    health = encoder_health(encode)
    assert health["status"] == "ok" and health["preprocessing"], health
    # the language server's model is built without the tower (sglang_ext.no_encoder_tower); the
    # greedy tests below pass through it
    assert [line for line in language.log if "Qwen3VLForConditionalGeneration built without its vision tower" in line]
    assert not [line for line in encode.log if "built without its vision tower" in line]


@pytest.mark.parametrize("size", list(SIZES))
def test_greedy_ids_equal_monolithic(workers, images, reference, size) -> None:
    """The 4K image's 8,160 rows (768 wide: the tower's output and its two deepstack layers) come
    in resume rounds after the first 2,048-token allocation; the encoder stays under 3 GB."""
    encode, language = workers
    meta = generate_as_reference(language, [images[size]], f"qwen3-{size}", reference)["meta_info"]
    assert meta["encode_ms"] > 0, meta
    if size == "448x448":
        assert meta["resume_rounds"] == 0, meta
    if size == "3840x2160":
        assert meta["resume_rounds"] >= 1, meta
        peak = _peak_resident_bytes(encode.proc.pid)
        assert peak < ENCODER_PEAK_BYTES, f"the encoder peaked at {peak / 2**30:.2f} GiB"


def test_two_images_in_one_prompt_equal_monolithic(workers, images, reference) -> None:
    _, language = workers
    generate_as_reference(language, [images["448x448"], images["other"]], "qwen3-two", reference)


@pytest.mark.parametrize("clip", list(CLIPS))
def test_a_video_equals_monolithic(workers, clips, reference, clip) -> None:
    """An MP4 in /generate's video_data: SGLang's encoder decodes and samples it (8 frames of 8,
    and of 120), its rows and timestamps come through the connector, SGLang's language server
    lays out the frames with their times."""
    _, language = workers
    body = generate_videos(language, [clips[clip]], f"qwen3-video-{clip}")
    assert greedy_mismatch(body["output_ids"], reference([], [clips[clip]])) is None
    # 4 temporal patches of 2 frames, each (h/2) x (w/2) tokens of Qwen3-VL's 16 px patches
    assert body["meta_info"]["video_tokens"] == {"392x280x8": 4 * 9 * 12, "448x252x120": 4 * 8 * 14}[clip]


def test_an_image_and_a_video_in_one_prompt_equal_monolithic(workers, images, clips, reference) -> None:
    _, language = workers
    body = generate_videos(language, [clips["392x280x8"]], "qwen3-mixed", images=[images["other"]])
    assert greedy_mismatch(body["output_ids"], reference([images["other"]], [clips["392x280x8"]])) is None


def test_an_openai_chat_with_a_video_url_gets_generates_answer(workers, clips, folder) -> None:
    """The openai client's ``video_url`` part (a data: URI) through the chat template: the same
    text as /generate for the same clip (which equals the reference above)."""
    from openai import OpenAI

    _, language = workers
    data = "data:video/mp4;base64," + base64.b64encode(Path(clips["392x280x8"]).read_bytes()).decode()
    chat = OpenAI(base_url=f"{language.url}/v1", api_key="unused").chat.completions.create(
        model=folder, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data}},
                                               {"type": "text", "text": "Describe it."}]}])
    assert chat.usage.prompt_tokens_details.video_tokens == 432, chat.usage
    assert chat.choices[0].message.content == generate_videos(language, [clips["392x280x8"]], "qwen3-video-chat")["text"]


def test_the_reference_depends_on_the_picture(reference, images, clips) -> None:
    """Else the equality checks above would pass for any embedding."""
    assert reference([images["448x448"]]).ids != reference([images["other"]]).ids
    assert reference([], [clips["392x280x8"]]).ids != reference([], [clips["448x252x120"]]).ids


def test_concurrent_requests_are_batched_by_sglangs_scheduler(workers, images) -> None:
    """Eight 1920x1080 requests at once: all answered, and SGLang's encoder fused some of them
    into one forward pass (its log says so for every batch of more than one)."""
    encode, language = workers
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: generate(language, [images["1920x1080"]], f"qwen3-batch-{i}", 1), range(8)))
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers if a.status_code != 200]
    batched = [line for line in encode.log if "IMAGE requests completed" in line]
    assert batched, "no fused batch in the encoder's log"


def test_a_deep_sleep_drops_the_weights_and_the_wake_up_reads_them_again(workers, images, reference) -> None:
    """Level 2: SGLang's model is dropped; meanwhile a request is refused, saying the encoder
    sleeps; after /wake_up (the weights read again with SGLang's loader) the ids are the same."""
    encode, language = workers
    slept = requests.post(f"{encode.url}/sleep", params={"level": "2", "preserve_state": "true"}, timeout=60)
    assert slept.status_code == 200 and slept.json()["is_sleeping"], slept.text
    # the encoder's 503 to the /encode or its room failed asleep, whichever reaches the language
    # side first: either way 503 (come back later), saying why
    refused = generate(language, [images["other"]], "qwen3-asleep")
    assert refused.status_code == 503 and "the encode worker is asleep" in refused.text, refused.text
    assert refused.headers["Retry-After"], refused.headers
    woke = requests.post(f"{encode.url}/wake_up", timeout=120)
    assert woke.status_code == 200 and not woke.json()["is_sleeping"], woke.text
    generate_as_reference(language, [images["other"]], "qwen3-awake", reference)


def test_a_room_kept_on_disk_continues_after_kill_9(folder, images, make_language, tmp_path) -> None:
    """SGLang's encoder in an encode worker with ``--checkpoint-dir``: a 4K room between resume
    rounds, the worker asleep on disk, killed with SIGKILL, started again on the folder (it boots
    asleep), woken: the room finishes with the bytes the first process encoded."""
    args = ("--model-path", folder, "--checkpoint-dir", str(tmp_path / "ckpt"))
    encode = WorkerProcess("encode", *args, command=SGLANG_LAUNCH)
    lang = make_language(num_blocks=128, hidden_size=768, heartbeat_interval=1.0)
    try:
        encoded = requests.post(f"{encode.url}/encode", json={"rid": "disk", "bootstrap_room": 11, "images": [
            images["3840x2160"]], "wait_for_delivery": False}, timeout=120)
        assert encoded.status_code == 200 and encoded.json()["num_tokens"] == 8160, encoded.text
        receiver = lang.manager.create_receiver(f"127.0.0.1:{encode.bootstrap_port}", 11)
        receiver.init(lang.allocator.allocate(16))  # 2,048 of 8,160 tokens: more rounds follow
        wait_for(lambda: receiver.poll() == KVPoll.Transferring, 30, "the first round")
        assert sleep_(encode)["kept_bytes"] > 0
        wait_for(lambda: lang.manager.stats["durable_sleepers_seen"] == 1, 10, "the language side to see it on disk")
        os.kill(encode.proc.pid, signal.SIGKILL)
        encode.proc.wait()
        encode = WorkerProcess("encode", *args, bootstrap_port=encode.bootstrap_port, command=SGLANG_LAUNCH)
        assert "asleep: a checkpoint waits" in encode.ready_line
        assert wake(encode).json()["restored_requests"] == 1
        embedding = finish_receiving(receiver, 60)
        assert embedding.sha256() == encoded.json()["sha256"]
        embedding.release()
    finally:
        encode.stop()


def _peak_resident_bytes(pid: int) -> int:
    """The process's resident high-water mark (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return psutil.Process(pid).memory_info().rss
