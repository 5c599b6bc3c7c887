"""Every architecture SGLang accepts for encoder disaggregation has one outcome here: served end to
end, served in the encode role, or refused by both roles in one line that names it and says why
(``sglang_ext.families``), before SGLang reads more than its config: no traceback for any."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_ext import plugin
from sglang_ext.families import REFUSED

# architecture -> the test module that shows it served (both roles, ids equal transformers')
SERVED = {
    "Qwen2VLForConditionalGeneration": "test_sglang_families",
    "Qwen2_5_VLForConditionalGeneration": "test_sglang_language",
    "Qwen3VLForConditionalGeneration": "test_sglang_encoder",
    "Qwen3VLMoeForConditionalGeneration": "test_sglang_families",
    "MiniMaxM3SparseForConditionalGeneration": "test_sglang_minimax",
    "Qwen2AudioForConditionalGeneration": "test_sglang_audio",
}
# served in the encode role (rows equal transformers' tower), the language role refused on a CPU
ENCODE_ROLE = {
    "Qwen3_5ForConditionalGeneration": "test_sglang_qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "test_sglang_qwen3_5",
}
ROLES = {
    "encode": ["--disaggregation-mode", "encode"],
    "language": ["--disaggregation-mode", "language", "--encoder-urls", "http://127.0.0.1:1"],
    "prefill": ["--disaggregation-mode", "prefill", "--language-only"],
    "upstream encoder": ["--encoder-only"],
}


def sglangs_epd_architectures() -> set[str]:
    """The list in SGLang's own check (``arg_groups/pd_disaggregation_hook.py``), read from its source."""
    import sglang.srt.arg_groups.pd_disaggregation_hook as hook

    source = Path(hook.__file__).read_text()
    listed = re.search(r"model_arch not in \[(.*?)\]", source, re.S)
    assert listed, "SGLang's list of encoder-disaggregation architectures moved"
    return set(re.findall(r'"(\w+)"', listed.group(1)))


def test_each_architecture_sglang_lists_has_one_outcome_and_its_test_exists() -> None:
    listed = sglangs_epd_architectures()
    assert len(listed) == 18
    outcomes = [set(SERVED), set(ENCODE_ROLE), set(REFUSED)]
    assert set().union(*outcomes) == listed
    assert sum(len(o) for o in outcomes) == len(listed)  # one outcome each
    here = Path(__file__).parent
    for module in {**SERVED, **ENCODE_ROLE}.values():
        assert (here / f"{module}.py").exists(), module


def checkpoint(folder: Path, name: str) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [name], "model_type": name.lower()}))
    return str(folder)


def never(*args, **kwargs):  # SGLang's own prepare_server_args: a refusal comes before it
    raise AssertionError("SGLang parsed the arguments of a refused architecture")


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_architecture_exits_in_one_line_in_every_role(name, tmp_path) -> None:
    folder = checkpoint(tmp_path / "ckpt", name)
    for role, flags in ROLES.items():
        with pytest.raises(SystemExit) as exited:
            plugin._around_prepare_server_args(never, ["--model-path", folder, *flags])
        message = str(exited.value.code)
        assert "\n" not in message, role
        assert message.startswith(f"error: {name} is not served by epd-resume"), (role, message)
        assert REFUSED[name] in message and "SGLANG_PLUGINS=none" in message, (role, message)


@pytest.mark.fast
def test_a_served_architecture_and_sglangs_own_modes_go_on(tmp_path) -> None:
    """A served architecture is not refused; a refused one in SGLang's own roles (no mode of ours)
    is SGLang's to serve."""
    served = checkpoint(tmp_path / "served", "Qwen2VLForConditionalGeneration")
    refused = checkpoint(tmp_path / "refused", "KimiVLForConditionalGeneration")
    plugin.refuse_family(served)
    plugin.refuse_family(str(tmp_path / "nowhere"))  # no config here: the role's own loading says so
    plugin.refuse_family("probe/not-in-the-cache")
    parsed = SimpleNamespace(disaggregation_mode="null", encoder_only=False, language_only=False)
    calls = []
    assert plugin._around_prepare_server_args(lambda argv: calls.append(argv) or parsed,
                                              ["--model-path", refused]) is parsed
    assert calls == [["--model-path", refused]]
