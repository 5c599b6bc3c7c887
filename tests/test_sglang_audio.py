"""Audio through SGLang's encoder and the resumable connector: Qwen2-Audio
(``scripts/checkpoint_qwen2_audio.py``), the audio family upstream's encoder serves that
transformers has a monolithic model of.

SGLang's encoder reads a clip with soundfile (torchaudio's wheel is a CUDA build here: the CPU
shim's stand-in resamples), pads it to the 30 s window, and runs the audio tower with the
padding mask upstream leaves out (``sglang_ext/qwen2_audio_mask.py``). Greedy ids are checked
against transformers' own ``Qwen2AudioForConditionalGeneration.generate`` on the samples as
SGLang loads them (equal at every step: ``monolithic.greedy_mismatch``): clips of 1 s, 7.3 s and 30 s at 16 kHz, 2.5 s at 44.1 kHz,
two in one prompt, an OpenAI chat; a clip past the window is refused from its header.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import requests
from checkpoint_qwen2_audio import write_qwen2_audio_checkpoint
from monolithic import Greedy, greedy_generate, greedy_mismatch
from sglang_stack import AUDIO_CLIPS, NEW_TOKENS, encoder_health, sglang_pair, write_audio_clips

from harness.workers import WorkerProcess

pytestmark = pytest.mark.sglang

PROMPT = "<|im_start|>user\n{clips}What is this?<|im_end|>\n<|im_start|>assistant\n"
CLIP = "Audio {n}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"


def prompt(n_clips: int) -> str:
    return PROMPT.format(clips="".join(CLIP.format(n=n) for n in range(1, n_clips + 1)))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(write_qwen2_audio_checkpoint(tmp_path_factory.mktemp("qwen2-audio")))


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    return write_audio_clips(tmp_path_factory.mktemp("audio"), {**AUDIO_CLIPS, "31s": (31.0, 16000)})


@pytest.fixture(scope="module")
def workers(folder):
    with sglang_pair(folder, "--skip-server-warmup") as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' processor and model on each clip's samples as SGLang's encoder loads them
    (soundfile, then the stand-in resample to 16 kHz where the file has another rate)."""
    import soundfile
    import torch
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from sglang_ext.cpu.shim import resample

    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    rate = processor.feature_extractor.sampling_rate

    def greedy(paths: list[str]) -> Greedy:
        waves = []
        for path in paths:
            wave, file_rate = soundfile.read(path)
            if file_rate != rate:
                wave = resample(torch.from_numpy(wave).float()[None], file_rate, rate)[0].numpy()
            waves.append(wave)
        inputs = processor(text=[prompt(len(paths))], audio=waves, sampling_rate=rate, return_tensors="pt")
        inputs["input_features"] = inputs["input_features"].to(torch.bfloat16)
        return greedy_generate(model, inputs, NEW_TOKENS)

    return greedy


def generate(language: WorkerProcess, paths: list[str], rid: str) -> requests.Response:
    body = {"rid": rid, "text": prompt(len(paths)), "audio_data": paths,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    return requests.post(f"{language.url}/generate", json=body, timeout=300)


def test_the_encode_worker_runs_sglangs_encoder_for_audio(workers) -> None:
    encode, language = workers
    assert "encoder=sglang:qwen2_audio" in encode.ready_line, encode.ready_line
    assert encoder_health(encode)["modalities"] == ["audio"]
    # the language server's model is built without the audio tower and its projector, whose
    # weights are never read (sglang_ext.no_encoder_tower); the greedy tests below pass through it
    assert [line for line in language.log if "Qwen2AudioForConditionalGeneration built without its audio tower" in line]
    assert not [line for line in encode.log if "built without its" in line]


@pytest.mark.parametrize("clip", list(AUDIO_CLIPS))
def test_greedy_ids_equal_monolithic(workers, clips, reference, clip) -> None:
    _, language = workers
    answer = generate(language, [clips[clip]], f"audio-{clip}")
    assert answer.status_code == 200, answer.text
    assert greedy_mismatch(answer.json()["output_ids"], reference([clips[clip]])) is None


def test_two_clips_in_one_prompt_equal_monolithic(workers, clips, reference) -> None:
    _, language = workers
    answer = generate(language, [clips["1s"], clips["7.3s"]], "audio-two")
    assert answer.status_code == 200, answer.text
    assert greedy_mismatch(answer.json()["output_ids"], reference([clips["1s"], clips["7.3s"]])) is None


def test_an_openai_chat_with_an_audio_url_gets_generates_answer(workers, clips, folder) -> None:
    from openai import OpenAI

    _, language = workers
    data = "data:audio/wav;base64," + base64.b64encode(Path(clips["1s"]).read_bytes()).decode()
    chat = OpenAI(base_url=f"{language.url}/v1", api_key="unused").chat.completions.create(
        model=folder, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": data}},
                                               {"type": "text", "text": "What is this?"}]}])
    assert chat.choices[0].message.content == generate(language, [clips["1s"]], "audio-chat").json()["text"]


def test_a_clip_past_the_window_is_refused_from_its_header(workers, clips) -> None:
    _, language = workers
    answer = generate(language, [clips["31s"]], "audio-31s")
    assert answer.status_code == 400 and "31.0 s, over the 30 s limit" in answer.text, answer.text


def test_the_reference_depends_on_the_clip(reference, clips) -> None:
    assert reference([clips["1s"]]).ids != reference([clips["30s"]]).ids


def test_token_counts_before_encoding_are_the_encoders(workers, tmp_path) -> None:
    """From the header alone, odd lengths and rates (resampled) included: the worker answers 500
    when its count differs from the encoder's, and the prompt grows by the count foreseen."""
    _, language = workers
    paths = write_audio_clips(tmp_path, {"0.37s": (0.37, 16000), "3.31s-22k": (3.31, 22050), "2s-8k": (2.0, 8000)})
    expected = {"0.37s": 9, "3.31s-22k": 83, "2s-8k": 50}  # mel frames per 10 ms begun, then two halvings
    text_tokens = set()
    for name, path in paths.items():
        answer = generate(language, [path], f"audio-count-{name}")
        assert answer.status_code == 200, (name, answer.text)
        text_tokens.add(answer.json()["meta_info"]["prompt_tokens"] - expected[name])
    assert len(text_tokens) == 1, text_tokens  # the same text around each clip
