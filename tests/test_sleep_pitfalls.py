"""One test per pitfall the reference interruptible-inference work on a vLLM engine ran into
(issue 14), in its order of damage, on the engine in-process and through a disk checkpoint
read back by a fresh engine (what a restarted worker does). The real-process tests of the same
behaviour are in ``test_sleep_generation.py``; pitfall 6 (sleep and wake serialised) is there."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from test_engine import new_engine, parts, request  # noqa: F401  (fixture)

from connector.checkpoint import CheckpointError
from language_side import checkpoint
from language_side.engine import Engine, GenRequest, Phase

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent


def geometry(lm) -> dict:
    return {"block_size": 64, "hidden_size": lm.hidden_size, "dtype": "bfloat16", "model": lm.geometry}


def steps(engine: Engine, count: int | None = None) -> dict[str, list[int]]:
    """``count`` steps (or until idle); the tokens per request."""
    tokens: dict[str, list[int]] = {}
    done = 0
    while not engine.idle and (count is None or done < count):
        for out in engine.step():
            tokens.setdefault(out.rid, []).append(out.token)
        done += 1
    return tokens


def through_disk(engine: Engine, folder: Path, lm) -> Engine:
    """Suspend ``engine``, write its requests to a checkpoint and restore them into a fresh
    engine of the same model, resumed (what a worker killed asleep and restarted does)."""
    engine.suspend()
    saved = [*engine.running.values(), *engine.waiting]
    checkpoint.save(folder, geometry(lm), [], 0, saved)
    _, restored = checkpoint.load(folder, geometry(lm))
    fresh = Engine(lm, engine.tokenizer, engine.kv_budget, engine.eos_ids, engine.sleep_kv)
    fresh.restore(restored)
    assert fresh.resume() == []
    return fresh


def save_mid_decode(parts, folder: Path) -> None:  # noqa: F811
    """The two ``specs`` three tokens into decoding, suspended and written to ``folder``."""
    _, lm, _ = parts
    engine = new_engine(parts)
    for req in specs(parts):
        engine.add(req)
    steps(engine, 3)
    engine.suspend()
    checkpoint.save(folder, geometry(lm), [], 0, list(engine.running.values()))


def specs(parts) -> list[GenRequest]:  # noqa: F811
    return [request(parts, "img", 1, "Describe.", max_new_tokens=14),
            request(parts, "seeded", None, "Sampled.", max_new_tokens=14, temperature=0.9, top_p=0.95, seed=11)]


def uninterrupted(parts) -> dict[str, list[int]]:  # noqa: F811
    engine = new_engine(parts)
    for req in specs(parts):
        engine.add(req)
    return steps(engine)


def merged(*runs: dict[str, list[int]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for run in runs:
        for rid, tokens in run.items():
            out.setdefault(rid, []).extend(tokens)
    return out


@pytest.mark.parametrize("sleep_kv", ["keep", "recompute"])
def test_pitfall_1_the_kv_is_kept_over_the_sleep_not_thrown_away(parts, tmp_path, sleep_kv) -> None:  # noqa: F811
    """Woken requests decode from their own KV (kept, or recomputed exactly), never from
    nothing: the keys and values read back are the bytes exported, and the tokens are those of
    an uninterrupted run."""
    _, lm, tokenizer = parts
    engine = Engine(lm, tokenizer, 100_000, {tokenizer.eos_token_id}, sleep_kv)
    for req in specs(parts):
        engine.add(req)
    before = steps(engine, 5)
    exported = {rid: lm.export_kv(r.seq) for rid, r in engine.running.items()}
    kept = engine.suspend()
    expected = sum(lm.kv_bytes_per_token * r.seq_tokens for r in engine.running.values())
    assert kept == (expected if sleep_kv == "keep" else 0)
    checkpoint.save(tmp_path, geometry(lm), [], 0, list(engine.running.values()))
    _, restored = checkpoint.load(tmp_path, geometry(lm))
    for req in restored:
        if sleep_kv == "keep":
            assert all(torch.equal(a, b) and a.dtype == lm.dtype for pair_read, pair_out in
                       zip(req.saved_kv, exported[req.rid], strict=True) for a, b in zip(pair_read, pair_out, strict=True))
        else:
            assert req.saved_kv is None
    fresh = Engine(lm, tokenizer, 100_000, engine.eos_ids, sleep_kv)
    fresh.restore(restored)
    fresh.resume()
    for rid, req in fresh.running.items():  # the rebuilt cache is the one that was exported
        assert all(torch.equal(a, b) for pair_now, pair_out in zip(lm.export_kv(req.seq), exported[rid], strict=True)
                   for a, b in zip(pair_now, pair_out, strict=True))
    assert merged(before, steps(fresh)) == uninterrupted(parts)


def test_pitfall_2_kv_reservations_are_restored_not_just_serialised(parts, tmp_path) -> None:  # noqa: F811
    """The restored engine holds exactly the reservations it had: what is used, what waits for
    budget, and every token back once all end."""
    _, lm, tokenizer = parts
    reqs = specs(parts)
    budget = reqs[0].kv_tokens + 3  # the second waits for the first to end
    engine = Engine(lm, tokenizer, budget, {tokenizer.eos_token_id})
    for req in reqs:
        engine.add(req)
    before = steps(engine, 3)
    used, waiting = engine.kv_used, [r.rid for r in engine.waiting]
    assert used == reqs[0].kv_tokens and waiting == ["seeded"]
    fresh = through_disk(engine, tmp_path, lm)
    assert fresh.kv_used == used and [r.rid for r in fresh.waiting] == waiting and list(fresh.running) == ["img"]
    assert merged(before, steps(fresh)) == uninterrupted(parts)
    assert fresh.kv_used == 0 and fresh.idle
    smaller = Engine(lm, tokenizer, reqs[0].kv_tokens - 1, {tokenizer.eos_token_id})
    engine = Engine(lm, tokenizer, budget, {tokenizer.eos_token_id})
    engine.add(request(parts, "img", 1, "Describe.", max_new_tokens=14))
    steps(engine, 2)
    engine.suspend()
    with pytest.raises(ValueError, match="KV budget"):  # a worker with less KV budget refuses, whole
        smaller.restore(list(engine.running.values()))
    assert smaller.idle and smaller.kv_used == 0


def test_pitfall_3_no_per_step_state_survives_into_the_first_step_after_wake(parts, tmp_path) -> None:  # noqa: F811
    """Sleep right after the step that prefilled a request (its KV holds only the prompt, its
    first token is sampled but not fed) while another was added and never stepped: the first
    step after the wake feeds exactly the right token to each, nothing from before the sleep
    is reused (a woken sequence carries no logits)."""
    _, lm, _ = parts
    engine = new_engine(parts)
    first, second = specs(parts)
    engine.add(first)
    before = steps(engine, 1)
    engine.add(second)
    fresh = through_disk(engine, tmp_path, lm)
    assert all(r.seq.last_logits.numel() == 0 for r in fresh.running.values())
    after_one = {out.rid: out.token for out in fresh.step()}
    assert set(after_one) == {"img", "seeded"}  # one decode and one prefill, in that first step
    alone = uninterrupted(parts)
    assert after_one["img"] == alone["img"][1] and after_one["seeded"] == alone["seeded"][0]
    assert merged(before, {k: [v] for k, v in after_one.items()}, steps(fresh)) == alone


def test_pitfall_4_image_embeddings_are_kept_for_requests_that_still_need_them(parts, tmp_path) -> None:  # noqa: F811
    """A request not yet prefilled keeps its received embedding over the sleep (there is no
    encoder to ask again); once prefilled (KV kept) it is dropped."""
    _, lm, tokenizer = parts
    reqs = specs(parts)
    engine = Engine(lm, tokenizer, reqs[0].kv_tokens, {tokenizer.eos_token_id})
    engine.add(reqs[1])  # text-only first: the image request waits for budget
    engine.add(reqs[0])
    before = steps(engine, 2)
    assert engine.waiting[0].rid == "img" and engine.waiting[0].image_rows is not None
    engine.suspend()
    checkpoint.save(tmp_path, geometry(lm), [], 0, [*engine.running.values(), *engine.waiting])
    _, restored = checkpoint.load(tmp_path, geometry(lm))
    waiting = next(r for r in restored if r.rid == "img")
    assert waiting.phase == Phase.WAITING and np.array_equal(waiting.image_rows, reqs[0].image_rows)
    fresh = Engine(lm, tokenizer, engine.kv_budget, engine.eos_ids)
    fresh.restore(restored)
    fresh.resume()
    assert merged(before, steps(fresh)) == uninterrupted(parts)
    broken = json.loads((tmp_path / "language.json").read_bytes())  # a checkpoint that lost it is refused
    tensors = dict(_tensors(tmp_path))
    del tensors[f"g{[g['rid'] for g in broken['generations']].index('img')}.image_rows"]
    _write(tmp_path, broken, tensors)
    with pytest.raises(CheckpointError, match="needs its image embedding"):
        checkpoint.load(tmp_path, geometry(lm))


def test_pitfall_5_derived_fields_are_the_same_after_a_restore(parts, tmp_path) -> None:  # noqa: F811
    """Everything derived from a request (prompt length, positions and delta, its reservation,
    the tokens in its cache, every sampling and stop field, the generator's state) reads back
    equal, so it ends exactly where it would have."""
    _, lm, tokenizer = parts
    engine = new_engine(parts)
    req = request(parts, "img", 2, "Why?", max_new_tokens=9, temperature=0.7, top_k=40, top_p=0.8, seed=3,
                  stop=("zzz",), stop_token_ids=(7,))
    engine.add(req)
    steps(engine, 4)
    engine.suspend()
    checkpoint.save(tmp_path, geometry(lm), [], 0, [req])
    _, (back,) = checkpoint.load(tmp_path, geometry(lm))
    assert back.params == req.params and back.output_ids == req.output_ids and back.phase == Phase.RUNNING
    assert back.kv_tokens == req.kv_tokens and back.seq_tokens == req.seq_tokens
    assert back.prompt.delta == req.prompt.delta and back.prompt.image_tokens == req.prompt.image_tokens
    for name in ("input_ids", "positions", "image_mask"):
        assert np.array_equal(getattr(back.prompt, name), getattr(req.prompt, name))
    assert torch.equal(back.generator.get_state(), req.generator.get_state())
    fresh = Engine(lm, tokenizer, 100_000, engine.eos_ids)
    fresh.restore([back])
    fresh.resume()
    steps(fresh)
    assert back.finish_reason in ("length", "stop") and len(back.output_ids) <= 9


def test_pitfall_7_checkpoints_are_json_and_safetensors_nothing_is_pickled(parts, tmp_path) -> None:  # noqa: F811
    """The files are plain JSON and a safetensors blob (a JSON header and raw arrays), read
    without any unpickler; no module of the workers can unpickle anything."""
    _, lm, _ = parts
    save_mid_decode(parts, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["language.json", "language.safetensors", "language.sha256"]
    meta = json.loads((tmp_path / "language.json").read_bytes())
    assert [g["rid"] for g in meta["generations"]] == ["img", "seeded"]
    blob = (tmp_path / "language.safetensors").read_bytes()
    header = json.loads(blob[8:8 + struct.unpack("<Q", blob[:8])[0]])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} <= {"I64", "BOOL", "U8", "I16"}
    sources = [p for d in ("connector", "language_side", "embedding_side", "sglang_ext") for p in (ROOT / d).glob("*.py")]
    assert sources
    for path in sources:
        text = path.read_text()
        assert not re.search(r"import (c?pickle|dill|joblib)|from (c?pickle|dill|joblib) |torch\.load\(|np\.load\(|"
                             r"allow_pickle\s*=\s*True|weights_only\s*=\s*False", text), path


def test_the_streamed_safetensors_file_reads_back_with_safetensors_itself(tmp_path) -> None:
    """The checkpoint writer lays out the safetensors file itself, array by array (no joined
    copy of a gigabyte of KV): safetensors' own loader reads back every dtype and shape it
    writes (a transposed view, an empty array, a scalar), and an array it has no dtype for is
    refused before anything is written."""
    from safetensors.numpy import load

    from connector import checkpoint as files
    arrays = {"kv": np.arange(24, dtype=np.int16).reshape(2, 3, 4).transpose(1, 0, 2), "mask": np.array([True, False]),
              "bytes": np.arange(5, dtype=np.uint8), "empty": np.ones((0, 3), np.float32),
              "scalar": np.array(7, np.int64), "ids": np.arange(4, dtype=np.int32), "f": np.linspace(0, 1, 3)}
    size = files.save(tmp_path, "language", {"x": 1}, arrays)
    blob = (tmp_path / "language.safetensors").read_bytes()
    assert size == len(blob) + len((tmp_path / "language.json").read_bytes())
    back = load(blob)
    assert set(back) == set(arrays)
    header_size = struct.unpack("<Q", blob[:8])[0]
    assert header_size % 8 == 0
    for name, entry in json.loads(blob[8:8 + header_size]).items():  # each array starts aligned
        assert entry["data_offsets"][0] % arrays[name].dtype.itemsize == 0, name
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape and np.array_equal(back[name], array)
    assert files.load(tmp_path, "language", {"x": 1})[0]["x"] == 1  # the checksum covers what was streamed
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="no safetensors dtype"):
        files.save(tmp_path, "language", {}, {"big_endian": np.zeros(2, ">i4")})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # the good checkpoint is untouched


def test_a_tampered_or_mismatched_generation_checkpoint_is_refused_whole(parts, tmp_path) -> None:  # noqa: F811
    """Checksums catch damage; a checkpoint rewritten with a valid checksum is still checked
    field by field, and one of another model is refused before anything is read."""
    _, lm, _ = parts
    save_mid_decode(parts, tmp_path)
    meta, tensors = json.loads((tmp_path / "language.json").read_bytes()), dict(_tensors(tmp_path))
    cases = [
        (lambda m, t: m["generations"][0].update(output_ids=[lm.vocab_size]), "outside the vocabulary"),
        (lambda m, t: t.update({"g0.k0": t["g0.k0"][:-1]}), "tensor g0.k0 is"),
        (lambda m, t: t.pop("g1.generator"), "tensor g1.generator is missing"),
        (lambda m, t: m["generations"][1].update(phase="finished"), "is finished with"),
        (lambda m, t: m["generations"][1]["params"].update(top_p=0.0), "top_p must be in"),
        (lambda m, t: m["generations"][0].update(delta=2**62), "do not agree"),
        (lambda m, t: m["generations"][0].update(prefill_seconds=float("inf")), "prefill_seconds inf"),
        (lambda m, t: m["generations"][0]["params"].update(max_new_tokens=3), "running with 3 tokens generated"),
        (lambda m, t: m["model"].update(config_sha256="0" * 64), "model="),  # another checkpoint's config.json
        (lambda m, t: m["model"].update(layers=2), "model="),
        (lambda m, t: m["model"].update(dtype="float32"), "model="),
        (lambda m, t: m.update(block_size=128), "block_size=128"),
    ]
    for damage, words in cases:
        m, t = json.loads(json.dumps(meta)), dict(tensors)
        damage(m, t)
        _write(tmp_path, m, t)
        with pytest.raises(CheckpointError, match=re.escape(words)):
            checkpoint.load(tmp_path, geometry(lm))
    (tmp_path / "language.safetensors").write_bytes((tmp_path / "language.safetensors").read_bytes()[:-3])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        checkpoint.load(tmp_path, geometry(lm))


def _tensors(folder: Path):
    from safetensors.numpy import load
    return load((folder / "language.safetensors").read_bytes()).items()


def _write(folder: Path, meta: dict, tensors: dict[str, np.ndarray]) -> None:
    """A checkpoint as a hostile writer would leave it: any content, a valid checksum."""
    from safetensors.numpy import save
    body, blob = json.dumps(meta).encode(), save(tensors)
    (folder / "language.json").write_bytes(body)
    (folder / "language.safetensors").write_bytes(blob)
    (folder / "language.sha256").write_bytes(hashlib.sha256(body + blob).hexdigest().encode())
