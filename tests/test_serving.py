"""The serving layer in process: incremental text over byte-level tokens, stop strings cut in
both modes, and an engine thread that ends every open request when it stops."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from language_side.engine import SamplingParams
from language_side.model import LanguageModel
from language_side.prompt import build_prompt
from language_side.serving import GenerationService, TextStream

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(2048)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder)


def pieces(stream: TextStream, ids: list[int]) -> list[str]:
    out = [stream.push([i]) for i in ids[:-1]]
    return out + [stream.push(ids[-1:], final=True)]


def test_characters_split_across_tokens_come_out_whole_and_in_order(tokenizer) -> None:
    text = "héllo 🙂 wörld ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, ())
    out = pieces(stream, ids)
    assert "".join(out) == text == stream.answer()
    assert all("\ufffd" not in piece for piece in out)


@pytest.mark.parametrize("stop", ["wör", "🙂", "o 🙂 w"])
def test_the_text_ends_before_the_stop_string_and_nothing_past_it_was_sent(tokenizer, stop) -> None:
    text = "héllo 🙂 wörld ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, (stop,))
    assert "".join(pieces(stream, ids)) == text[:text.index(stop)] == stream.answer()


def test_closing_the_service_ends_every_open_request_with_a_last_event(folder, tokenizer) -> None:
    service = GenerationService(LanguageModel(folder), tokenizer, 10_000)

    async def scenario():
        prompt = build_prompt(tokenizer, "tell me more", [], 32768)
        gens = [service.submit(f"r{i}", prompt, None, SamplingParams(max_new_tokens=5000), admit=lambda: None)
                for i in range(3)]
        await gens[0].events.get()  # running
        await asyncio.to_thread(service.close)
        last = []
        for gen in gens:
            while (event := await asyncio.wait_for(gen.events.get(), 10)).finish_reason is None:
                pass
            last.append((event.finish_reason, event.error))
        return last

    assert asyncio.run(scenario()) == [("abort", "the language worker is shutting down")] * 3
    assert service.engine.idle and service.engine.kv_used == 0 and service.active() == 0
