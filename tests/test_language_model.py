"""The language side's model against transformers' monolithic Qwen2.5-VL on the same checkpoint
folder: our encoder's embedding, sent as bf16 bytes (in process; and through a real encode
worker, the connector with resume rounds and a real language worker's engine), spliced into our
prompt and decoded, gives the tokens ``Qwen2_5_VLForConditionalGeneration.generate`` gives from
the pixels."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from monolithic import NEW_TOKENS, reference_tokens
from transfer_large_image import make_image
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
from workers import model_workers

from embedding_side.encoders import QwenVisionEncoder
from language_side.model import LanguageModel, greedy
from language_side.prompt import IMAGE_PLACEHOLDER as P
from language_side.prompt import build_prompt


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(3584)


@pytest.fixture(scope="module")
def sides(folder):
    """What each worker loads from the folder: the encode side's tower, the language side's model."""
    return QwenVisionEncoder(folder), LanguageModel(folder), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def monolithic(folder):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()


@pytest.mark.fast
@pytest.mark.parametrize("text, sizes", [
    (f"<|im_start|>user\n{P}What is in the picture?<|im_end|>\n<|im_start|>assistant\n", [(448, 448)]),
    (f"First {P} then, after some words, {P} and a question?", [(448, 448), (1000, 300)]),
    ("<|im_start|>user\nNo image at all.<|im_end|>\n<|im_start|>assistant\n", []),
])
def test_greedy_tokens_equal_the_monolithic_model(sides, monolithic, text, sizes) -> None:
    encoder, lm, tokenizer = sides
    images = [make_image(w, h, seed=i + 1) for i, (w, h) in enumerate(sizes)]
    expected = reference_tokens(monolithic, encoder, tokenizer, text, images)
    encoded = encoder.encode(images) if images else None
    grids = [tuple(g) for g in encoded.grid_thw] if encoded else []
    prompt = build_prompt(tokenizer, text, grids, lm.max_length)
    ours = greedy(lm, prompt, encoded.embeddings if encoded else None, NEW_TOKENS, {tokenizer.eos_token_id})
    assert ours == expected
    assert len(ours) == NEW_TOKENS or ours[-1] == tokenizer.eos_token_id


@pytest.mark.fast
def test_the_language_side_reads_no_vision_tensor_and_keeps_the_checkpoint_dtype(sides) -> None:
    _, lm, _ = sides
    names = [name for name, _ in lm.model.named_parameters()]
    assert names and not any("visual" in name for name in names)
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16} and lm.lm_head.weight.dtype == torch.bfloat16
    assert lm.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.fast
def test_a_checkpoint_with_sliding_window_layers_is_refused(folder, tmp_path) -> None:
    """Its cache keeps more than keys and values: sleep's KV and interrupted passes would not be exact."""
    config = json.loads(Path(folder, "config.json").read_text())
    config["text_config"] |= {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}
    del config["text_config"]["layer_types"]  # as in Qwen's own configs: derived from the three above
    for item in Path(folder).iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\['sliding_attention'\] \(use_sliding_window\) are not supported"):
        LanguageModel(tmp_path)


@pytest.mark.fast
def test_an_embedding_of_the_wrong_size_is_refused(sides) -> None:
    encoder, lm, tokenizer = sides
    encoded = encoder.encode([make_image(448, 448, seed=1)])
    prompt = build_prompt(tokenizer, f"{P}", [(1, 32, 32)], lm.max_length)  # 256 tokens expected
    with pytest.raises(ValueError, match="the prompt has 256 image tokens of width 3584; the embedding is"):
        lm.prefill(prompt, encoded.embeddings[:100])


@pytest.fixture(scope="module")
def served(folder):
    """Both workers on the folder; the language side allocates 2048 tokens first, so every
    image here needs resume rounds."""
    with model_workers(folder, "--embedding-cache-buffer-size", "128",
                       "--embedding-default-allocate-buffer-size", "2048") as pair:
        yield pair


@pytest.mark.parametrize("sizes, text", [
    ([(3840, 2160)], f"<|im_start|>user\n{P}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"),
    ([(448, 448), (1024, 1024), (640, 480), (448, 336)], f"One {P} two {P} three {P} and four {P}: compare."),
], ids=["4k", "4-images"])
def test_through_the_wire_with_a_resume_round_the_tokens_equal_the_monolithic_model(
        sides, monolithic, served, tmp_path, sizes, text) -> None:
    """A real encode worker process on the folder's tower -> Mooncake with resume rounds -> a real
    language worker: the grids come from the positions on the wire; its prompt, model and engine."""
    encoder, _, tokenizer = sides
    encode, lang = served
    images = [make_image(w, h, seed=i + 3) for i, (w, h) in enumerate(sizes)]
    paths = []
    for i, image in enumerate(images):
        paths.append(str(tmp_path / f"{i}.png"))
        image.save(paths[-1])
    room = 9 + len(sizes)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(requests.post, f"{encode.url}/encode",
                           json={"rid": "w", "bootstrap_room": room, "images": paths}, timeout=300)
        answer = requests.post(f"{lang.url}/generate", timeout=300, json={
            "rid": "w", "text": text, "bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port,
            "bootstrap_room": room, "sampling_params": {"max_new_tokens": NEW_TOKENS}})
        assert sent.result().status_code == 200, sent.result().text
    assert answer.status_code == 200, answer.text
    out = answer.json()
    assert out["resume_rounds"] >= 1 and out["sha256"] == sent.result().json()["sha256"]
    grids = [tuple(g) for g in encoder.processor(images=images, return_tensors="pt")["image_grid_thw"].tolist()]
    assert [tuple(g) for g in sent.result().json()["grid_thw"]] == grids
    assert out["meta_info"]["image_tokens"] == sum(t * h * w // 4 for t, h, w in grids)
    assert out["output_ids"] == reference_tokens(monolithic, encoder, tokenizer, text, images)
