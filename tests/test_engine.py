"""The generation engine in-process on the seeded checkpoint: requests that join and leave
at any step give exactly the tokens they give alone, seeded sampling included; the KV budget
makes requests wait, never fail; abort and the stop conditions end a request and give its KV
back."""

from __future__ import annotations

import itertools

import pytest
import torch
from transfer_large_image import make_image
from transformers import AutoTokenizer

from embedding_side.encoders import QwenVisionEncoder
from language_side.engine import Engine, GenRequest, PassInterrupted, Phase, SamplingParams, sample
from language_side.model import LanguageModel, greedy
from language_side.prompt import IMAGE_PLACEHOLDER as P
from language_side.prompt import build_prompt

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def parts(seeded_checkpoint):
    folder = seeded_checkpoint(2048)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return QwenVisionEncoder(folder), LanguageModel(folder), tokenizer


def request(parts, rid: str, seed_image: int | None, text: str, **params) -> GenRequest:
    encoder, lm, tokenizer = parts
    if seed_image is None:
        return GenRequest(rid, build_prompt(tokenizer, text, [], lm.max_length), None, SamplingParams(**params))
    encoded = encoder.encode([make_image(448, 336, seed=seed_image)])
    prompt = build_prompt(tokenizer, f"{P}{text}", [tuple(g) for g in encoded.grid_thw], lm.max_length)
    return GenRequest(rid, prompt, encoded.embeddings, SamplingParams(**params))


def run(engine: Engine, joins: dict[int, list[GenRequest]] | None = None, limit: int = 500) -> dict[str, list[int]]:
    """Step until idle, adding ``joins[step]`` before that step; tokens per request."""
    joins = joins or {}
    tokens: dict[str, list[int]] = {}
    for step in range(limit):
        for req in joins.get(step, []):
            engine.add(req)
        if engine.idle and step > max(joins, default=0):
            return tokens
        for out in engine.step():
            tokens.setdefault(out.rid, []).append(out.token)
    raise AssertionError("the engine did not finish")


def new_engine(parts, budget: int = 100_000) -> Engine:
    _, lm, tokenizer = parts
    return Engine(lm, tokenizer, budget, {tokenizer.eos_token_id})


def test_requests_joining_at_any_step_give_the_tokens_they_give_alone(parts) -> None:
    _, lm, tokenizer = parts
    specs = [("a", 1, "Describe it.", {"max_new_tokens": 12}), ("b", None, "Text only, please.", {"max_new_tokens": 20}),
             ("c", 2, "And this one?", {"max_new_tokens": 6}),
             ("d", 3, "Sampled.", {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 7})]
    alone = {rid: run(new_engine(parts), {0: [request(parts, rid, img, text, **p)]})[rid]
             for rid, img, text, p in specs}
    for rid, img, text, p in specs[:3]:  # greedy alone is the reference loop's output
        req = request(parts, rid, img, text, **p)
        assert alone[rid] == greedy(lm, req.prompt, req.image_rows, p["max_new_tokens"], {tokenizer.eos_token_id})
    reqs = {rid: request(parts, rid, img, text, **p) for rid, img, text, p in specs}
    together = run(new_engine(parts), {0: [reqs["a"]], 2: [reqs["b"], reqs["d"]], 5: [reqs["c"]]})
    assert together == alone
    assert all(r.phase == Phase.FINISHED and r.finish_reason == "length" for r in reqs.values())


def test_a_new_request_gets_its_first_token_in_the_next_step(parts) -> None:
    engine = new_engine(parts)
    engine.add(request(parts, "long", 1, "x", max_new_tokens=50))
    engine.step()
    engine.add(request(parts, "late", None, "y", max_new_tokens=3))
    assert {out.rid for out in engine.step()} == {"long", "late"}
    run(engine)


def test_seeded_sampling_repeats_and_another_seed_differs(parts) -> None:
    params = {"max_new_tokens": 24, "temperature": 1.0, "seed": 11}
    first = run(new_engine(parts), {0: [request(parts, "s", 1, "go", **params)]})["s"]
    again = run(new_engine(parts), {0: [request(parts, "s", 1, "go", **params)]})["s"]
    other = run(new_engine(parts), {0: [request(parts, "s", 1, "go", **{**params, "seed": 12})]})["s"]
    assert first == again and first != other


def test_the_kv_budget_makes_requests_wait_and_refuses_one_that_can_never_fit(parts) -> None:
    one = request(parts, "one", 1, "a", max_new_tokens=8)
    budget = one.kv_tokens + 10  # room for one image request at a time
    engine = new_engine(parts, budget)
    two = request(parts, "two", 2, "b", max_new_tokens=8)
    engine.add(one)
    engine.add(two)
    assert [out.rid for out in engine.step()] == ["one"]
    assert one.phase == Phase.RUNNING and two.phase == Phase.WAITING and engine.kv_used == one.kv_tokens
    run(engine)
    assert len(one.output_ids) == len(two.output_ids) == 8 and engine.kv_used == 0
    with pytest.raises(ValueError, match=f"need {len(one.prompt.input_ids) + 100} KV tokens; the KV budget is {budget}"):
        engine.add(request(parts, "big", 1, "a", max_new_tokens=100))


def test_abort_in_either_phase_gives_the_kv_back_and_the_rest_go_on(parts) -> None:
    engine = new_engine(parts, 400)
    running, waiting, other = (request(parts, rid, None, "hello", max_new_tokens=200) for rid in ("r", "w", "o"))
    for req in (running, waiting, other):
        engine.add(req)
    engine.step()  # only "r" fits
    assert engine.abort("w") and waiting.phase == Phase.ABORTED and waiting.finish_reason == "abort"
    assert engine.abort("r") and running.phase == Phase.ABORTED and engine.kv_used == 0
    assert not engine.abort("r") and not engine.abort("nobody")
    other_tokens = run(engine)["o"]  # to its length, or to the end of its text
    assert (len(other_tokens) == 200 or other_tokens[-1] == parts[2].eos_token_id) and engine.kv_used == 0


def test_stop_tokens_and_stop_strings_end_a_request(parts) -> None:
    free = run(new_engine(parts), {0: [request(parts, "f", 1, "go", max_new_tokens=30)]})["f"]
    stop_id = free[5]
    by_id = run(new_engine(parts), {0: [request(parts, "i", 1, "go", max_new_tokens=30, stop_token_ids=(stop_id,))]})
    assert by_id["i"] == free[:free.index(stop_id) + 1]
    text = parts[2].decode(free[:9])
    by_text = run(new_engine(parts), {0: [request(parts, "t", 1, "go", max_new_tokens=30, stop=(text[-3:],))]})["t"]
    assert text[-3:] in parts[2].decode(by_text) and len(by_text) <= 9


@pytest.mark.parametrize("params, words", [
    ({"max_new_tokens": 0}, "max_new_tokens must be in"), ({"temperature": -1.0}, "temperature must be in"),
    ({"top_p": 0.0}, "top_p must be in"), ({"top_k": -2}, "top_k must be 0"), ({"seed": -1}, "seed must be in"),
    ({"stop": ("",)}, "stop must be"),
])
def test_bad_sampling_params_are_refused(parts, params, words) -> None:
    with pytest.raises(ValueError, match=words):
        new_engine(parts).add(request(parts, "x", None, "a", **params))


def test_top_k_and_top_p_only_ever_draw_the_tokens_they_allow() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_k=2), gen) for _ in range(300)}
    assert drawn == {0, 1}
    probs = torch.softmax(logits, -1)  # 0.64, 0.24, 0.09, ...: top_p 0.8 keeps the first two
    assert probs[0] < 0.8 <= probs[0] + probs[1]
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), gen) for _ in range(300)}
    assert drawn == {0, 1}
    assert sample(logits, SamplingParams(), gen) == 0  # greedy


def test_a_prefill_that_fails_ends_only_its_request_and_gives_its_kv_back(parts) -> None:
    engine = new_engine(parts)
    good = request(parts, "good", 1, "fine", max_new_tokens=5)
    bad = request(parts, "bad", 2, "broken", max_new_tokens=5)
    bad.image_rows = bad.image_rows[:10]  # fewer rows than the prompt's image tokens
    engine.add(bad)
    engine.add(good)
    first = engine.step()
    assert first[0].rid == "bad" and first[0].token is None and first[0].finish_reason == "abort"
    assert "prefill failed: ValueError: the prompt has" in first[0].error and bad.phase == Phase.ABORTED
    assert len(run(engine)["good"]) == 4 and engine.kv_used == 0


def test_a_stop_string_of_multibyte_characters_is_found(parts) -> None:
    _, lm, tokenizer = parts
    engine = new_engine(parts)
    req = request(parts, "emoji", None, "x", max_new_tokens=40, stop=("\U0001f642" * 4,))
    engine.add(req)
    engine.step()
    req.output_ids[:] = tokenizer("\U0001f642" * 4, add_special_tokens=False)["input_ids"]  # 16 byte tokens
    assert engine._finish_reason(req, req.output_ids[-1]) == "stop"


@pytest.mark.parametrize("level, sleep_kv", [(1, "keep"), (2, "keep"), (2, "recompute")])
def test_suspend_and_resume_between_any_two_steps_give_the_same_tokens(parts, level, sleep_kv) -> None:
    _, lm, tokenizer = parts

    def requests():
        return [request(parts, "img", 1, "Describe.", max_new_tokens=12),
                request(parts, "seeded", None, "Sampled.", max_new_tokens=12, temperature=0.9, top_k=30, seed=5)]

    reference = run_with_pause(new_engine(parts), requests(), lm, level, pause_at=None)
    for pause_at in (0, 1, 6):  # before any prefill, after it, mid-decode
        engine = Engine(lm, tokenizer, 100_000, {tokenizer.eos_token_id}, sleep_kv)
        assert run_with_pause(engine, requests(), lm, level, pause_at) == reference


def run_with_pause(engine: Engine, reqs: list[GenRequest], lm: LanguageModel, level: int,
                   pause_at: int | None) -> dict[str, list[int]]:
    for req in reqs:
        engine.add(req)
    tokens: dict[str, list[int]] = {}
    step = 0
    while not engine.idle or step == pause_at:
        if step == pause_at:
            kept = engine.suspend()
            if engine.sleep_kv == "keep":
                assert kept == sum(lm.kv_bytes_per_token * r.seq_tokens for r in engine.running.values())
                assert (kept > 0) == bool(engine.running)  # nothing runs before the first step
            else:
                assert kept == 0 and all(r.image_rows is not None for r in engine.running.values() if r.rid == "img")
            assert all(r.seq is None for r in engine.running.values())
            with pytest.raises(RuntimeError, match="the engine is suspended"):
                engine.step()
            lm.release_weights(level)
            assert lm.weights == ("host" if level == 1 else "none")
            lm.restore_weights()
            assert engine.resume() == []
        for out in engine.step():
            tokens.setdefault(out.rid, []).append(out.token)
        step += 1
    return tokens


def test_an_abort_while_suspended_gives_the_kv_back(parts) -> None:
    engine = new_engine(parts)
    engine.add(request(parts, "a", None, "x", max_new_tokens=50))
    engine.add(request(parts, "b", None, "y", max_new_tokens=50))
    engine.step()
    engine.suspend()
    assert engine.abort("a") and engine.kv_used == engine.running["b"].kv_tokens
    engine.resume()
    assert len(run(engine)["b"]) == 49 and engine.kv_used == 0


@pytest.fixture(scope="module")
def deep_parts(seeded_checkpoint):
    """Three decoder layers: a pass can be cut between two of them."""
    folder = seeded_checkpoint(512, layers=3)
    return QwenVisionEncoder(folder), LanguageModel(folder), AutoTokenizer.from_pretrained(folder)


def test_an_interrupted_pass_leaves_the_sequence_as_it_was(deep_parts) -> None:
    _, lm, tokenizer = deep_parts
    prompt = build_prompt(tokenizer, "Cut me.", [], lm.max_length)

    def after(layers: int):
        asked = itertools.count()
        return lambda: next(asked) >= layers

    for cut in range(3):  # before the first, second or third layer
        with pytest.raises(PassInterrupted):
            lm.prefill(prompt, None, interrupt=after(cut))
    seq, twin = lm.prefill(prompt, None), lm.prefill(prompt, None)
    lm.decode(twin, 65)
    for cut in range(3):
        before = [(layer.keys, layer.values) for layer in seq.cache.layers]
        with pytest.raises(PassInterrupted):
            lm.decode(seq, 65, interrupt=after(cut))
        assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(seq.cache.layers, before, strict=True))
        assert seq.length == len(prompt.input_ids)
    lm.decode(seq, 65)
    assert torch.equal(seq.last_logits, twin.last_logits)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(seq.cache.layers, twin.cache.layers, strict=True))


def test_a_step_cut_at_any_layer_changes_no_request_tokens(deep_parts) -> None:
    """A sleep waits for one decoder layer, not a pass or a step: a step cut before any layer
    of any request's prefill or decode drops that pass, leaves the others for the next step,
    and every request still gives its uninterrupted tokens (images, greedy and seeded)."""
    def requests_():
        return [request(deep_parts, "a", 1, "Image.", max_new_tokens=8),
                request(deep_parts, "b", None, "Text b.", max_new_tokens=10, temperature=0.8, seed=1),
                request(deep_parts, "c", 2, "Image c.", max_new_tokens=9, temperature=0.8, seed=2)]

    asked = 0

    def cut_after(calls: int):
        def pause() -> bool:
            nonlocal asked
            asked += 1
            return asked > calls
        return pause

    reference = run(new_engine(deep_parts), {0: requests_()})
    engine = new_engine(deep_parts)
    for req in requests_():
        engine.add(req)
    assert engine.step(pause=lambda: True) == [] and len(engine.waiting) == 3  # nothing ran
    tokens: dict[str, list[int]] = {}
    cuts = itertools.cycle(range(1, 12))  # 3 layers a pass: every layer of every request's pass
    while not engine.idle:
        asked = 0
        outputs = engine.step(pause=cut_after(next(cuts)))
        for out in outputs:
            tokens.setdefault(out.rid, []).append(out.token)
        for req in engine.running.values():  # a dropped pass left nothing in the cache
            assert req.seq.length == req.seq_tokens
        assert engine.kv_used == sum(r.kv_tokens for r in engine.running.values())
    assert tokens == reference
