"""The seeded checkpoints decide their greedy ids: on the media and prompts the SGLang tests and the
main job compare with transformers' reference, every step of the reference leads its runner-up by
at least :data:`MIN_MARGIN_NATS` (log_softmax of its float32 logits), far above what bf16 rounding
moves a lead (see ``checkpoint_text.decisive_language_model``), it runs its full length (no EOS),
and two different media give different ids at a step with that lead.

A representative set, in-process and quick: per family the images or clips of up to 1920x1080 or
30 s and the prompts with two of them; Qwen2.5-VL's OpenAI chats and the main job's checked
request at both of its widths. Left out here (SGLang's video sampling and resampling cannot be
imported in the fast tier, and 3840x2160 is slow): the videos, 3840x2160, the 44.1 kHz clip and
the long runs. Each head direction in ``checkpoint_text.HEAD_SEEDS`` was chosen on all of those
but the long runs.
"""

from __future__ import annotations

import pytest
import torch
from image_cache import saved_image
from monolithic import Greedy, greedy_generate
from sglang_stack import NEW_TOKENS, prompt, text_reference, write_audio_clips

pytestmark = pytest.mark.fast

MIN_MARGIN_NATS = 0.1
# sglang_stack.write_images' sizes and seeds (its 3840x2160, seed 42, is left out)
IMAGES = {"448x448": (448, 448, 40), "other": (640, 336, 60), "1920x1080": (1920, 1080, 41)}
MAIN_JOB_TOKENS = 16  # generate_from_images.py's --new-tokens default
CHAT_TOKENS = 10  # test_openai_api's one-image chat


def assert_decided(references: dict[str, Greedy], new_tokens: dict[str, int], apart: tuple[str, str]) -> None:
    """Every reference leads by MIN_MARGIN_NATS at every step and runs ``new_tokens``; the two
    references named in ``apart`` differ at a step where both lead by that much."""
    for name, reference in references.items():
        margins = reference.margins()
        assert len(reference.ids) == new_tokens[name], (name, reference.ids)
        step = int(margins.argmin())
        assert margins[step] >= MIN_MARGIN_NATS, f"{name}: step {step} leads by {float(margins[step]):.3f} nats"
    first, second = (references[name] for name in apart)
    differ = [step for step, (a, b) in enumerate(zip(first.ids, second.ids, strict=True)) if a != b]
    assert differ, f"{apart}: the same ids {first.ids}"
    assert min(first.margins()[differ[0]], second.margins()[differ[0]]) >= MIN_MARGIN_NATS


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("margin-images")
    made = {name: saved_image(root / f"{name}.png", w, h, seed=seed) for name, (w, h, seed) in IMAGES.items()}
    return made | {"224x224": saved_image(root / "224x224.png", 224, 224, seed=1)}  # test_openai_api's


@pytest.fixture(scope="module")
def main_job_image(tmp_path_factory) -> str:
    """The main job's checked request: its first image (448x448, seed 0)."""
    return saved_image(tmp_path_factory.mktemp("margin-main") / "448x448-0.png", 448, 448, seed=0)


def test_qwen2_5_vl_of_the_sglang_tests_decides(seeded_checkpoint, images, main_job_image) -> None:
    from generate_from_images import prompt_for
    from test_openai_api import CHAT, IMAGE

    greedy = text_reference(seeded_checkpoint(256, layers=2))
    references = {name: greedy(prompt(1), [images[name]]) for name in ("448x448", "other", "1920x1080")}
    references["two images"] = greedy(prompt(2), [images["other"], images["448x448"]])
    references["main job"] = greedy(prompt_for(1), [main_job_image], MAIN_JOB_TOKENS)
    # test_openai_api's chats (the chat template's prompt, a system turn)
    references["chat, two images"] = greedy(CHAT.format(images=IMAGE * 2, text="Compare them."),
                                            [images["224x224"], images["448x448"]])
    references["chat"] = greedy(CHAT.format(images=IMAGE, text="What is it?"), [images["other"]], CHAT_TOKENS)
    assert_decided(references, {**dict.fromkeys(references, NEW_TOKENS), "main job": MAIN_JOB_TOKENS,
                                "chat": CHAT_TOKENS}, ("448x448", "other"))


def test_qwen2_5_vl_of_the_main_job_decides(seeded_checkpoint, images, main_job_image, tmp_path) -> None:
    """The main job's default width: its checked request, and the 448x448 picture beside another of the same size and kind (seed 41)."""
    from generate_from_images import prompt_for

    greedy = text_reference(seeded_checkpoint(3584))
    another = saved_image(tmp_path / "448x448-41.png", 448, 448, seed=41)
    references = {"main job": greedy(prompt_for(1), [main_job_image], MAIN_JOB_TOKENS),
                  "448x448": greedy(prompt(1), [images["448x448"]]), "another 448x448": greedy(prompt(1), [another])}
    assert_decided(references, {**dict.fromkeys(references, NEW_TOKENS), "main job": MAIN_JOB_TOKENS},
                   ("448x448", "another 448x448"))


def test_qwen3_vl_decides(tmp_path_factory, images) -> None:
    """test_sglang_encoder's reference: transformers' processor and model from the pixels."""
    from make_checkpoint import write_qwen3_vl_checkpoint
    from PIL import Image
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    folder = write_qwen3_vl_checkpoint(tmp_path_factory.mktemp("margin-qwen3-vl"))
    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()

    def greedy(names: list[str]) -> Greedy:
        pictures = [Image.open(images[name]).convert("RGB") for name in names]
        return greedy_generate(model, processor(text=[prompt(len(names))], images=pictures, return_tensors="pt"),
                               NEW_TOKENS)

    references = {name: greedy([name]) for name in ("448x448", "other", "1920x1080")}
    references["two images"] = greedy(["448x448", "other"])
    assert_decided(references, dict.fromkeys(references, NEW_TOKENS), ("448x448", "other"))


def test_minimax_m3_vl_decides(tmp_path_factory, images) -> None:
    """test_sglang_minimax's reference: transformers' processor and model on the image as SGLang's
    rule resizes it (448x448 kept, 640x336 to 644x336 by bicubic: SGLang's function, whose module
    this fast test cannot import, as importing it runs ldconfig)."""
    from checkpoint_minimax import write_minimax_m3_vl_checkpoint
    from PIL import Image
    from test_sglang_minimax import prompt as minimax_prompt
    from transformers import AutoProcessor, MiniMaxM3SparseForConditionalGeneration

    folder = write_minimax_m3_vl_checkpoint(tmp_path_factory.mktemp("margin-minimax"))
    processor = AutoProcessor.from_pretrained(folder)
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    sizes = {"448x448": (448, 448), "other": (644, 336)}

    def picture(name: str) -> Image.Image:
        image = Image.open(images[name]).convert("RGB")  # 448x448 kept, 640x336 made 644x336
        return image if image.size == sizes[name] else image.resize(sizes[name], Image.Resampling.BICUBIC)

    def greedy(names: list[str]) -> Greedy:
        return greedy_generate(model, processor(text=[minimax_prompt(len(names))], images=[picture(n) for n in names],
                                                do_resize=False, return_tensors="pt"), NEW_TOKENS)

    references = {name: greedy([name]) for name in sizes}
    references["two images"] = greedy(["other", "448x448"])
    assert_decided(references, dict.fromkeys(references, NEW_TOKENS), ("448x448", "other"))


def test_qwen2_audio_decides(tmp_path_factory) -> None:
    """test_sglang_audio's reference on its 16 kHz clips (the 44.1 kHz one needs SGLang's resample)."""
    import soundfile
    from checkpoint_qwen2_audio import write_qwen2_audio_checkpoint
    from sglang_stack import AUDIO_CLIPS
    from test_sglang_audio import prompt as audio_prompt
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    root = tmp_path_factory.mktemp("margin-qwen2-audio")
    folder = write_qwen2_audio_checkpoint(root / "checkpoint")
    clips = write_audio_clips(root, AUDIO_CLIPS)
    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    rate = processor.feature_extractor.sampling_rate

    def greedy(names: list[str]) -> Greedy:
        waves = [soundfile.read(clips[name]) for name in names]
        assert all(file_rate == rate for _, file_rate in waves)
        inputs = processor(text=[audio_prompt(len(names))], audio=[wave for wave, _ in waves], sampling_rate=rate,
                           return_tensors="pt")
        inputs["input_features"] = inputs["input_features"].to(torch.bfloat16)
        return greedy_generate(model, inputs, NEW_TOKENS)

    references = {name: greedy([name]) for name in ("1s", "7.3s", "30s")}
    references["two clips"] = greedy(["1s", "7.3s"])
    assert_decided(references, dict.fromkeys(references, NEW_TOKENS), ("1s", "30s"))

