"""What the tests of the SGLang stacks (SGLang's encoder in our encode worker, SGLang's language
server, the connector between) share: the launcher, the prompt, the images and the request."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import requests
import torch
from image_cache import saved_image
from monolithic import Greedy, greedy_generate, greedy_mismatch, reference_inputs, sampled_frames

from harness import hub_cache
from harness.workers import SGLANG_LAUNCH, SGLANG_READY, WorkerProcess, smg_gateway, start_together  # noqa: F401  (the modules import them here)

ROOT = Path(__file__).resolve().parent.parent
ENCODE_ROWS = Path(__file__).resolve().parent / "encode_rows.py"
NEW_TOKENS = 12
PROMPT = "<|im_start|>user\n{images}Describe it.<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
# (width, height, frames, fps): 8 frames at 2 fps are what SGLang samples of the first; of the
# second (4 s at 30 fps) it samples 8 of 120. Both sizes are multiples of 28 within its pixel
# bounds, so its first resize keeps them and the reference needs no resize of its own.
CLIPS = {"392x280x8": (392, 280, 8, 2), "448x252x120": (448, 252, 120, 30)}
SIZES = {"448x448": (448, 448), "1920x1080": (1920, 1080), "3840x2160": (3840, 2160)}


def encoded_rows(folder: str, paths: list[str], out: Path, plugins: bool = True,
                 extra: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Each image's rows (bf16 bytes, uint8 ``[tokens, width * 2]``) through SGLang's encoder on
    ``folder``, one image per forward pass, in a process of its own (``encode_rows.py``): with our
    plugin (as the encode worker runs it; forked from the worker zygote when the tests use one) or
    with none (as upstream SGLang runs it: a fresh interpreter, nothing of ours imported); ``extra``
    is added to its environment."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from harness import worker_zygote

    env = {key: value for key, value in os.environ.items() if key != "SGLANG_PLUGINS"}
    env |= {"PYTHONPATH": str(ROOT)} | ({} if plugins else {"SGLANG_PLUGINS": "none"}) | (extra or {})
    argv = [folder, str(out), *paths]
    if plugins and os.environ.get("EPD_FORK_WORKERS") == "1":
        log = out.with_suffix(".log")
        proc = worker_zygote.run_script(str(ENCODE_ROWS), argv, env, str(ROOT), str(log))
        try:
            assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
        finally:
            proc.kill()  # a no-op once it has ended
    else:
        done = subprocess.run([sys.executable, str(ENCODE_ROWS), *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    return load_file(out)


def write_images(root: Path) -> dict[str, str]:
    """One image of each of :data:`SIZES` and a 640x336 ``other``, as PNG files under ``root``."""
    return {name: saved_image(root / f"{name}.png", w, h, seed=60 if name == "other" else 40 + i)
            for i, (name, (w, h)) in enumerate([*SIZES.items(), ("other", (640, 336))])}


def write_clips(root: Path) -> dict[str, str]:
    """One MP4 (MPEG-4 part 2) of each of :data:`CLIPS` under ``root``: moving stripes and noise."""
    import av

    paths = {}
    for seed, (name, (width, height, frames, fps)) in enumerate(CLIPS.items()):
        paths[name] = str(root / f"{name}.mp4")
        rng = np.random.default_rng(seed)
        y, x = np.mgrid[0:height, 0:width]
        with av.open(paths[name], "w", format="mp4") as media:
            stream = media.add_stream("mpeg4", rate=fps)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for i in range(frames):
                wave = np.sin(x / 17.0 + i / 3 + seed) * 80 + np.cos(y / (13.0 + seed)) * 40 + 128
                pixels = np.clip(wave[..., None] + rng.normal(0, 10, (height, width, 3)), 0, 255).astype(np.uint8)
                media.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
            media.mux(stream.encode())
    return paths


# (seconds, sample rate): Qwen2-Audio's window is 30 s; 44.1 kHz is resampled by the encoder
AUDIO_CLIPS = {"1s": (1.0, 16000), "7.3s": (7.3, 16000), "30s": (30.0, 16000), "2.5s-44k": (2.5, 44100)}


def write_audio_clips(root: Path, clips: dict[str, tuple[float, int]] = AUDIO_CLIPS) -> dict[str, str]:
    """One 16-bit WAV of each of ``clips`` under ``root``: a few tones and noise, seeded."""
    import soundfile

    paths = {}
    for seed, (name, (seconds, rate)) in enumerate(clips.items()):
        paths[name] = str(root / f"{name}.wav")
        t = np.arange(int(seconds * rate)) / rate
        rng = np.random.default_rng(seed)
        wave = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(110, 1760, 3)) / 4 + rng.normal(0, 0.05, t.size)
        soundfile.write(paths[name], np.clip(wave, -1, 1).astype(np.float32), rate, subtype="PCM_16")
    return paths


def prompt(n_images: int, n_videos: int = 0) -> str:
    return PROMPT.format(images=IMAGE * n_images + VIDEO * n_videos)


def generate(language: WorkerProcess, paths: list[str], rid: str, new_tokens: int = NEW_TOKENS,
             **extra) -> requests.Response:
    """A greedy ``/generate`` of ``new_tokens`` for ``paths`` in the prompt (``extra``: more body fields)."""
    body = {"rid": rid, "text": prompt(len(paths)), "image_data": paths,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}} | extra
    return requests.post(f"{language.url}/generate", json=body, timeout=300)


def generate_videos(language: WorkerProcess, clips: list[str], rid: str, images: list[str] = ()) -> dict:
    """A greedy ``/generate`` of :data:`NEW_TOKENS` for ``images`` then ``clips`` in the prompt,
    checked for 200; the response body."""
    answer = generate(language, list(images), rid, text=prompt(len(images), len(clips)), video_data=clips)
    assert answer.status_code == 200, answer.text
    return answer.json()


def generate_as_reference(language: WorkerProcess, paths: list[str], rid: str, reference) -> dict:
    """:func:`generate`, checked: 200, and the greedy ids of ``reference(paths)`` (a
    ``monolithic.Greedy``) as ``monolithic.greedy_mismatch`` compares them; the response body."""
    answer = generate(language, paths, rid)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    why = greedy_mismatch(body["output_ids"], reference(paths))
    assert why is None, why
    return body


def family_reference(folder: str):
    """``greedy(paths, videos=())``: transformers' own model of the checkpoint's family (bf16)
    ``generate`` from the pixels, a ``monolithic.Greedy``: its processor expands the placeholders
    and makes the patches, its model runs the tower; videos are the frames SGLang's encoder samples,
    with their times (the processor puts each temporal patch's timestamp in the prompt)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16).eval()

    def greedy(paths: list[str], videos: list[str] = ()) -> Greedy:
        pictures = [Image.open(p).convert("RGB") for p in paths] or None
        sampled = [sampled_frames(v) for v in videos]
        clips = {"videos": [f for f, _ in sampled], "video_metadata": [m for _, m in sampled],
                 "do_sample_frames": False} if videos else {}
        return greedy_generate(model, processor(text=[prompt(len(paths), len(videos))], images=pictures,
                                                return_tensors="pt", **clips), NEW_TOKENS)

    return greedy


def image_reference(folder: str, model=None):
    """``greedy(paths, new_tokens)``: transformers' monolithic greedy ids (a ``monolithic.Greedy``)
    of :func:`prompt` with ``paths``, from the pixels: :func:`text_reference` on that prompt."""
    greedy = text_reference(folder, model)
    return lambda paths, new_tokens=NEW_TOKENS: greedy(prompt(len(paths)), paths, new_tokens)


def video_greedy(folder: str, model):
    """``greedy(videos)``: transformers' own processor on the frames SGLang's encoder samples of
    each video (their rate gives Qwen2.5-VL's seconds per temporal patch), and ``model``'s greedy
    ids (a ``monolithic.Greedy``) of :func:`prompt` with those videos."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)

    def greedy(videos: list[str]) -> Greedy:
        sampled = [sampled_frames(v) for v in videos]
        inputs = processor(text=[prompt(0, len(videos))], videos=[f for f, _ in sampled], do_sample_frames=False,
                           video_metadata=[m for _, m in sampled], return_tensors="pt")
        return greedy_generate(model, inputs, NEW_TOKENS)

    return greedy


# ---- what test_openai_api and test_no_silent_hang share: several workers, the connector's state ----

# SGLang's language server as these tests start it: a small KV pool, no warm-up (it starts faster)
LANGUAGE_FLAGS = ("--max-total-tokens", "32768", "--skip-server-warmup")


def encode_worker(folder: str, *flags: str, **kwargs) -> WorkerProcess:
    """Our encode worker running SGLang's encoder on ``folder``, through SGLang's launcher, as
    users start it; ``kwargs`` as :class:`WorkerProcess` takes them (a restart's ``port`` and
    ``bootstrap_port``)."""
    return WorkerProcess("encode", "--model-path", folder, *flags, command=SGLANG_LAUNCH, **kwargs)


def language_server(folder: str, encoders: list[str], *flags: str) -> WorkerProcess:
    """SGLang's own server as the language worker on ``folder``, sending images to ``encoders``
    (their URLs), with :data:`LANGUAGE_FLAGS` and ``flags``."""
    return WorkerProcess("language", "--model-path", folder, *LANGUAGE_FLAGS, *flags, "--encoder-urls", *encoders,
                         command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=300)


@contextlib.contextmanager
def sglang_pair(folder: str, *language_flags: str) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """SGLang's encoder on ``folder``, then SGLang's server as the language worker sending images
    to it (with ``language_flags``); both stopped on leaving. Both take the checkpoint by hub id,
    from the run's offline Hugging Face cache, as a deployment names it (every family this starts)."""
    repo_id = hub_cache.install(folder, f"probe/{Path(folder).name}-{hashlib.sha1(folder.encode()).hexdigest()[:8]}")
    encode = WorkerProcess("encode", "--model-path", repo_id, command=SGLANG_LAUNCH)
    try:
        language = WorkerProcess("language", "--model-path", repo_id, "--encoder-urls", encode.url, *language_flags,
                                 command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=300)
    except BaseException:
        encode.stop()
        raise
    try:
        yield encode, language
    finally:
        language.stop()
        encode.stop()


def metric(worker: WorkerProcess, name: str) -> float:
    """The sum of the worker's ``/metrics`` samples whose line starts with ``name`` (a metric's
    name, or its name and labels as the page writes them)."""
    text = requests.get(f"{worker.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def encoder_health(encoder: WorkerProcess) -> dict:
    """An encode worker's ``/health`` (its state, pool, rooms, queues and modalities)."""
    return requests.get(f"{encoder.url}/health", timeout=10).json()


def connector_health(language: WorkerProcess) -> dict:
    """The language server's connector: ``/epd/health`` (pool, rooms in each phase, failing encoders)."""
    return requests.get(f"{language.url}/epd/health", timeout=10).json()


def connector_idle(language: WorkerProcess, timeout: float = 30.0) -> dict:
    """:func:`connector_health` once no image is being resolved, queued or transferred and every
    block of the pool is free (as it stands after ``timeout`` seconds otherwise: callers assert)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        health = connector_health(language)
        idle = not (health["resolving"] or health["queued"] or health["transferring"])
        if (idle and health["free_blocks"] == health["num_blocks"]) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def connector_address(language: WorkerProcess) -> tuple[str, int, str]:
    """``(host, port, session)``: where the language server's connector takes the encoders' ZMQ
    messages, and its Mooncake session, as its log says when it starts."""
    import re

    for line in language.log:
        if found := re.search(r"epd-resume: .*zmq=tcp://([\d.]+):(\d+) mooncake=(\S+)", line):
            return found.group(1), int(found.group(2)), found.group(3)
    raise AssertionError("the language server's log does not say where its connector listens")


def text_reference(folder: str, model=None):
    """``greedy(text, paths, new_tokens)``: transformers' monolithic greedy ids (a
    ``monolithic.Greedy``) of the prompt ``text`` (one ``<|image_pad|>`` per image of ``paths``),
    from the pixels, by ``model`` (Qwen2.5-VL on ``folder``, loaded at the first computation when
    None). Each answer is kept beside the checkpoint for the test session (every module and
    xdist worker computes a prompt, images and length once; see :class:`ReferenceCache`)."""
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    cache = ReferenceCache(folder)

    @functools.cache
    def loaded():  # noqa: ANN202 - the image processor, the tokenizer and the model, at the first miss
        return (AutoProcessor.from_pretrained(folder).image_processor, AutoTokenizer.from_pretrained(folder),
                model or Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval())

    def compute(text: str, paths: list[str], new_tokens: int) -> Greedy:
        image_processor, tokenizer, reference_model = loaded()
        pictures = [Image.open(p).convert("RGB") for p in paths]
        return greedy_generate(reference_model, reference_inputs(image_processor, tokenizer, text, pictures),
                               new_tokens)

    def greedy(text: str, paths: list[str], new_tokens: int = NEW_TOKENS) -> Greedy:
        return cache.get(text, paths, new_tokens, lambda: compute(text, paths, new_tokens))

    return greedy


class ReferenceCache:
    """Reference generations of one checkpoint folder, in files beside it: the key is the sha256 of
    the checkpoint's files (names, sizes, mtimes, its config), the prompt, the images' bytes and
    the length, so a changed input is a new entry. The seeded checkpoints are written once per
    test session in a folder every xdist worker shares; a worker computing an entry holds its
    lock, and one that needs it meanwhile waits for it instead of computing it again."""

    def __init__(self, folder: str) -> None:
        self.root = Path(folder).parent / f"{Path(folder).name}.references"
        self.root.mkdir(exist_ok=True)
        checkpoint = hashlib.sha256()
        for file in sorted(Path(folder).iterdir()):
            stat = file.stat()
            checkpoint.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
        checkpoint.update((Path(folder) / "config.json").read_bytes())
        self.checkpoint = checkpoint.hexdigest()

    def get(self, text: str, paths: list[str], new_tokens: int, compute) -> Greedy:
        key = hashlib.sha256(f"{self.checkpoint}|{new_tokens}|{text}".encode())
        for path in paths:
            key.update(hashlib.sha256(Path(path).read_bytes()).digest())
        entry = self.root / f"{key.hexdigest()}.npz"
        with open(entry.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if entry.exists():
                with np.load(entry, allow_pickle=False) as saved:
                    return Greedy(saved["ids"].tolist(), torch.from_numpy(saved["logprobs"]),
                                  torch.from_numpy(saved["chosen_logits"]))
            answer = compute()
            partial = entry.with_suffix(".partial.npz")
            np.savez(partial, ids=np.asarray(answer.ids, dtype=np.int64), logprobs=answer.logprobs.float().numpy(),
                     chosen_logits=answer.chosen_logits.float().numpy())
            partial.rename(entry)
            return answer
