"""The language side's model against transformers' monolithic Qwen2.5-VL on the same checkpoint
folder: our encoder's embedding, sent as bf16 bytes (in process, and through a real encode
worker and the connector with resume rounds), spliced into our prompt, decoded by our loop,
gives the tokens ``Qwen2_5_VLForConditionalGeneration.generate`` gives from the pixels."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from make_checkpoint import write_checkpoint
from transfer_large_image import make_image
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
from workers import WorkerProcess

from connector.receiver import receive_embedding
from embedding_side.encoders import QwenVisionEncoder
from language_side.model import LanguageModel, greedy
from language_side.prompt import IMAGE_PLACEHOLDER as P
from language_side.prompt import build_prompt, grids_from_positions

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("qwen-lm"), 3584))


@pytest.fixture(scope="module")
def sides(folder):
    """What each worker loads from the folder: the encode side's tower, the language side's model."""
    return QwenVisionEncoder(folder), LanguageModel(folder), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def monolithic(folder):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()


def reference_tokens(model, encoder, tokenizer, text: str, images) -> list[int]:
    """transformers' own generate, from pixels, in one process."""
    kwargs = {}
    grids = []
    if images:
        inputs = encoder.processor(images=images, return_tensors="pt")
        kwargs = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    prompt = build_prompt(tokenizer, text, grids, max_length=32768)
    ids = torch.from_numpy(prompt.input_ids)[None]
    mm_types = torch.from_numpy(prompt.image_mask.astype("int64"))[None]
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm_types,
                             max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


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


def test_the_language_side_reads_no_vision_tensor_and_keeps_the_checkpoint_dtype(sides) -> None:
    _, lm, _ = sides
    names = [name for name, _ in lm.model.named_parameters()]
    assert names and not any("visual" in name for name in names)
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16} and lm.lm_head.weight.dtype == torch.bfloat16
    assert lm.model.rotary_emb.inv_freq.dtype == torch.float32


def test_an_embedding_of_the_wrong_size_is_refused(sides) -> None:
    encoder, lm, tokenizer = sides
    encoded = encoder.encode([make_image(448, 448, seed=1)])
    prompt = build_prompt(tokenizer, f"{P}", [(1, 32, 32)], lm.max_length)  # 256 tokens expected
    with pytest.raises(ValueError, match="the prompt has 256 image tokens of width 3584; the embedding is"):
        lm.prefill(prompt, encoded.embeddings[:100])


@pytest.mark.parametrize("sizes, text", [
    ([(3840, 2160)], f"<|im_start|>user\n{P}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"),
    ([(448, 448), (1024, 1024), (640, 480), (448, 336)], f"One {P} two {P} three {P} and four {P}: compare."),
], ids=["4k", "4-images"])
def test_through_the_wire_with_a_resume_round_the_tokens_equal_the_monolithic_model(
        folder, sides, monolithic, make_language, tmp_path, sizes, text) -> None:
    """A real encode worker process on the folder's tower -> Mooncake with resume rounds -> our
    receiver; the grids come from the positions on the wire; our prompt, model and engine loop."""
    encoder, lm, tokenizer = sides
    images = [make_image(w, h, seed=i + 3) for i, (w, h) in enumerate(sizes)]
    paths = []
    for i, image in enumerate(images):
        paths.append(str(tmp_path / f"{i}.png"))
        image.save(paths[-1])
    encode = WorkerProcess("encode", "--model-path", folder)
    try:
        lang = make_language(num_blocks=128, default_allocate_tokens=2048)  # forces resume rounds
        bootstrap = f"127.0.0.1:{encode.bootstrap_port}"
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(requests.post, f"{encode.url}/encode",
                               json={"rid": "w", "bootstrap_room": 9, "images": paths}, timeout=300)
            emb, receiver = receive_embedding(lang.manager, bootstrap, 9, timeout=300)
            assert sent.result().status_code == 200, sent.result().text
        try:
            assert receiver.resume_rounds >= 1
            grids = grids_from_positions(emb.mrope_positions)
            prompt = build_prompt(tokenizer, text, grids, lm.max_length)
            ours = greedy(lm, prompt, emb.embeddings, NEW_TOKENS, {tokenizer.eos_token_id})
        finally:
            emb.release()
    finally:
        assert encode.stop() == 0
    assert grids == [tuple(g) for g in encoder.processor(images=images, return_tensors="pt")["image_grid_thw"].tolist()]
    assert ours == reference_tokens(monolithic, encoder, tokenizer, text, images)
