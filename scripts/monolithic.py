"""The reference every equality check compares with (tests and the main job): transformers' own
Qwen2.5-VL generate, from the pixels, in one process, on the same checkpoint folder.

Where our stack runs other code than transformers' for the same math (SGLang's vision tower and
language model), bf16 values differ from the reference's in the last bit here and there. The
seeded checkpoints are built so that this cannot change a greedy id on the media the tests use:
every step of the reference leads its runner-up by far more than that rounding moves a lead
(``tests/test_checkpoint_margins.py`` measures both). So :func:`greedy_mismatch` is strict: equal
ids at every step, equal length. Only a long run (:func:`long_run_mismatch`) may end its
comparison at a step where the reference's lead was within one bf16 step of its logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from language_side.layout import image_token_count

NEW_TOKENS = 24
IMAGE_PAD = "<|image_pad|>"


def reference_inputs(image_processor, tokenizer, text: str, images) -> dict:
    """What transformers' Qwen2.5-VL ``generate`` takes for ``text`` with ``images``: the prompt
    with each image's placeholder expanded, and the pixels as the checkpoint's image processor
    (``AutoProcessor.from_pretrained(folder).image_processor``) makes them."""
    kwargs = {}
    grids = []
    if images:
        inputs = image_processor(images=images, return_tensors="pt")
        kwargs = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    ids = torch.tensor([expand_image_pads(tokenizer, text, grids)])
    mm_types = (ids == tokenizer.convert_tokens_to_ids(IMAGE_PAD)).long()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": mm_types, **kwargs}


def expand_image_pads(tokenizer, text: str, grids: list[tuple[int, int, int]]) -> list[int]:
    """``text``'s ids with each image's one ``<|image_pad|>`` repeated once per embedding row."""
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokens.count(pad) != len(grids):
        raise ValueError(f"the prompt has {tokens.count(pad)} image placeholders for {len(grids)} images")
    rows = iter(image_token_count(g) for g in grids)
    return [t for token in tokens for t in ([pad] * next(rows) if token == pad else [token])]


def sampled_frames(path: str) -> tuple[np.ndarray, dict]:
    """The frames of the video at ``path`` that SGLang's encoder samples (``smart_nframes`` at its
    default rate, evenly spaced indices), decoded with the library it decodes with here (decord),
    and their metadata as transformers' video processors take it (with ``do_sample_frames=False``).
    The frames are not resized: callers use sizes that SGLang's first resize keeps (multiples of
    28 within its pixel bounds); transformers' processor then resizes as it would anyway."""
    import decord
    from sglang.srt.multimodal.processors.qwen_vl import smart_nframes

    reader = decord.VideoReader(path)
    total, fps = len(reader), reader.get_avg_fps()
    count = smart_nframes({}, total_frames=total, video_fps=fps)
    indices = np.unique(np.linspace(0, total - 1, num=count, dtype=np.int64)).tolist()
    return reader.get_batch(indices).asnumpy(), {"fps": fps, "frames_indices": indices, "total_num_frames": total}


@dataclass
class Greedy:
    """The reference's greedy ids and, per step, its log-probabilities over the vocabulary and the
    raw logit of the token it chose (bf16 values, as float32)."""

    ids: list[int]
    logprobs: torch.Tensor  # [steps, vocab], float32
    chosen_logits: torch.Tensor  # [steps], float32

    def margins(self) -> torch.Tensor:
        """Per step, how far (nats) the chosen token led the runner-up."""
        top = self.logprobs.topk(2, dim=-1).values
        return top[:, 0] - top[:, 1]

    def logit_steps(self) -> torch.Tensor:
        """Per step, one bf16 step at the chosen logit's magnitude: the finest difference two bf16
        logits of that size can have."""
        return bf16_step(self.chosen_logits)


def bf16_step(values: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at each of ``values``' magnitudes (8 significant bits)."""
    exponent = torch.floor(torch.log2(values.abs().clamp_min(2.0 ** -126)))
    return torch.exp2(exponent - 7)


def rows_mismatch(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when the embedding rows ``got`` ([rows, hidden]) are ``expected``'s in shape and order,
    each element within one bf16 step of the largest value of its row (what two implementations
    of the same tower round differently), else the first row that is not."""
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    got, expected = got.float(), expected.float()
    row_step = bf16_step(expected.abs().max(dim=1, keepdim=True).values)
    off = ((got - expected).abs() / row_step).max(dim=1).values
    wrong = (off > 1.0).nonzero()
    if len(wrong):
        row = int(wrong[0])
        return f"row {row}: an element {float(off[row]):.1f} bf16 steps (of its row's largest value) away"
    return None


def greedy_generate(model, inputs: dict, max_new_tokens: int) -> Greedy:
    """``model.generate`` (greedy) on processor ``inputs``, with the scores of each step."""
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    prompt_length = inputs["input_ids"].shape[1]
    ids = out.sequences[0, prompt_length:].tolist()
    logits = torch.stack([step[0].float() for step in out.scores])
    chosen = logits.gather(1, torch.tensor(ids)[:, None])[:, 0]
    return Greedy(ids, torch.log_softmax(logits, -1), chosen)


def greedy_mismatch(got: list[int], reference: Greedy) -> str | None:
    """None when ``got`` equals the reference's greedy ids at every step and in length, else the
    first step that differs and by how far the reference led there."""
    for step, (ours, theirs) in enumerate(zip(got, reference.ids, strict=False)):
        if ours != theirs:
            lead = float(reference.margins()[step])
            return (f"step {step}: {ours} where the reference chose {theirs} (which led its runner-up by "
                    f"{lead:.3f} nats): {got} vs {reference.ids}")
    if len(got) != len(reference.ids):
        return f"{len(got)} ids, the reference has {len(reference.ids)}: {got} vs {reference.ids}"
    return None


def long_run_mismatch(got: list[int], reference: Greedy) -> tuple[str | None, int]:
    """For a long run: ``(what differs, steps compared)``. Equal ids are compared up to the first
    step where the two differ; a difference there is accepted (and ends the comparison) only when
    the reference's lead at that step was at most one bf16 step of its logits, where two
    implementations of the same math may round either way."""
    margins, steps = reference.margins(), reference.logit_steps()
    for step, (ours, theirs) in enumerate(zip(got, reference.ids, strict=False)):
        if ours != theirs:
            if margins[step] <= steps[step]:
                return None, step
            return greedy_mismatch(got, reference), step
    return greedy_mismatch(got, reference), min(len(got), len(reference.ids))
