"""The language model of a Qwen2.5-VL checkpoint, without its vision tower: transformers' own
``Qwen2_5_VLTextModel`` plus the output head, in the checkpoint's dtype.

Only the language model's tensors are read from the safetensors shards (real checkpoints
name them ``model.*``, transformers 5 saves ``model.language_model.*``; both load). Prefill
takes the prompt's token ids with the received image embedding scattered into the image rows
and explicit M-RoPE positions (:mod:`language_side.prompt`); each decode step continues at
``cache length + delta`` on all three axes. Every request has its own KV cache object, so
nothing is shared between requests on the model (transformers' ``rope_deltas`` is never used).

A pass can be interrupted between two decoder layers (a sleep does not wait for a long prefill
or a deep model's whole pass): ``interrupt()`` is asked before each layer and, once it is
true, the pass raises the engine's :class:`PassInterrupted` with the sequence as it was before
the pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import DynamicCache, Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, Qwen2_5_VLTextModel

from language_side.engine import PassInterrupted
from language_side.prompt import Prompt

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Sequence:
    """One request's state in the model: its KV cache and where decoding goes on."""

    cache: DynamicCache
    delta: int  # position of the next token = cache length + delta
    last_logits: torch.Tensor = field(repr=False)  # float32 [vocab], after the last token fed

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()


class LanguageModel:
    def __init__(self, folder: str | Path, device: str = "cpu") -> None:
        folder = Path(folder)
        config = Qwen2_5_VLConfig.from_pretrained(folder)
        text = config.text_config
        text._attn_implementation = "sdpa"
        self.config, self.text_config, self.device = config, text, torch.device(device)
        self.dtype = _DTYPES.get(str(getattr(text, "dtype", None) or _checkpoint_dtype(folder)).replace("torch.", ""),
                                 torch.bfloat16)
        if sliding := [t for t in getattr(text, "layer_types", None) or [] if t != "full_attention"]:
            # a sliding cache keeps other state than keys and values: KV export and the
            # rollback of an interrupted pass would not be exact
            raise ValueError(f"{folder}: layers of type {sorted(set(sliding))} (use_sliding_window) are not "
                             f"supported; only full attention")
        self.hidden_size, self.vocab_size = text.hidden_size, text.vocab_size
        self.max_length = int(text.max_position_embeddings)
        self.image_token_id = int(config.image_token_id)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        # keys and values of every layer, per token, in the model dtype
        self.kv_bytes_per_token = (2 * text.num_hidden_layers * text.num_key_value_heads * head_dim
                                   * torch.empty((), dtype=self.dtype).element_size())
        self.folder = folder
        # what saved KV and token ids must match to be used with this model (a disk checkpoint)
        self.geometry = {"config_sha256": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(),
                         "dtype": str(self.dtype).removeprefix("torch."), "layers": text.num_hidden_layers,
                         "kv_heads": text.num_key_value_heads, "head_dim": head_dim, "vocab_size": self.vocab_size}
        with torch.device("meta"):  # no memory until the checkpoint's tensors are assigned
            self.model = Qwen2_5_VLTextModel(text)
            self.lm_head = torch.nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.model.eval()
        self._interrupt: Callable[[], bool] | None = None  # asked before each decoder layer of a pass
        for layer in self.model.layers:
            layer.register_forward_pre_hook(self._before_layer)
        self.weights = "none"  # "device", "host" (level-1 sleep) or "none" (level-2 sleep)
        self.load_weights()

    def load_weights(self) -> None:
        """Read the language model's tensors from the folder onto the device."""
        body, head = _language_tensors(self.folder, tie=bool(self.config.tie_word_embeddings))
        self.model.load_state_dict({k: v.to(self.device, self.dtype) for k, v in body.items()}, strict=True, assign=True)
        self.lm_head.load_state_dict({"weight": head.to(self.device, self.dtype)}, strict=True, assign=True)
        with torch.device(self.device):  # non-persistent float32 buffers (rotary frequencies), built for real
            self.model.rotary_emb = Qwen2_5_VLRotaryEmbedding(config=self.text_config)
        self.weights = "device"

    def release_weights(self, level: int) -> None:
        """Sleep: level 1 moves the weights to host memory (where they already are on a CPU),
        level 2 drops them (:meth:`restore_weights` reads the folder again)."""
        if level == 1:
            if self.device.type != "cpu":  # on a CPU they are in host memory already
                self.model.to("cpu")
                self.lm_head.to("cpu")
            self.weights = "host"
        else:
            self.model.to("meta")
            self.lm_head.to("meta")
            self.weights = "none"

    def restore_weights(self) -> None:
        if self.weights == "host":
            if self.device.type != "cpu":
                self.model.to(self.device)
                self.lm_head.to(self.device)
            self.weights = "device"
        elif self.weights == "none":
            self.load_weights()

    def export_kv(self, seq: Sequence) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A sequence's KV cache on the host: per layer, keys and values ``[tokens, kv_heads,
        head_dim]`` in the model dtype; the cache itself can go. From a GPU one copy each; on a
        CPU device they already are in host memory: views of the cache's own tensors, no copy
        (a cache never writes into a tensor it has handed out: each step concatenates anew)."""
        return [(layer.keys[0].transpose(0, 1).to("cpu"), layer.values[0].transpose(0, 1).to("cpu"))
                for layer in seq.cache.layers]

    def import_kv(self, kv: list[tuple[torch.Tensor, torch.Tensor]], delta: int) -> Sequence:
        """The sequence :meth:`export_kv` saved, on the device again (its next step feeds the
        last generated token, so no logits are needed)."""
        cache = DynamicCache(config=self.text_config)
        for layer, (keys, values) in zip(cache.layers, kv, strict=True):
            k, v = keys.transpose(0, 1)[None].to(self.device), values.transpose(0, 1)[None].to(self.device)
            # the tensors themselves, not ``update`` (which would concatenate them onto an empty
            # one: a copy that the next step's concatenation makes anyway)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return Sequence(cache, delta, torch.empty(0))

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, image_rows: np.ndarray | None,
                interrupt: Callable[[], bool] | None = None) -> Sequence:
        """Run the prompt; ``image_rows`` is the received embedding as bf16 bytes ``[n, hidden*2]``
        (or None for a text-only prompt), ``n`` equal to the prompt's image tokens.
        :class:`PassInterrupted` once ``interrupt()`` is true (no sequence)."""
        ids = torch.from_numpy(prompt.input_ids).to(self.device)[None]
        embeds = self.model.embed_tokens(ids)
        if prompt.image_tokens:
            if image_rows is None or image_rows.shape != (prompt.image_tokens, self.hidden_size * 2):
                got = None if image_rows is None else image_rows.shape
                raise ValueError(f"the prompt has {prompt.image_tokens} image tokens of width {self.hidden_size}; "
                                 f"the embedding is {got} bytes")
            rows = torch.from_numpy(np.ascontiguousarray(image_rows)).view(torch.bfloat16).to(self.device, self.dtype)
            embeds[0, torch.from_numpy(prompt.image_mask).to(self.device)] = rows
        cache = DynamicCache(config=self.text_config)
        positions = torch.from_numpy(prompt.positions).to(self.device)[:, None, :]
        with self._interruptible(interrupt):
            out = self.model(inputs_embeds=embeds, position_ids=positions, past_key_values=cache, use_cache=True)
        return Sequence(cache, prompt.delta, self._logits(out.last_hidden_state[0, -1]))

    @torch.inference_mode()
    def decode(self, seq: Sequence, token: int, interrupt: Callable[[], bool] | None = None) -> None:
        """Feed one generated token; ``seq.last_logits`` is then the next token's.
        :class:`PassInterrupted` once ``interrupt()`` is true, ``seq`` as it was."""
        ids = torch.tensor([[token]], device=self.device)
        position = torch.full((3, 1, 1), seq.length + seq.delta, device=self.device)
        # each layer's update concatenates into new tensors: putting these back undoes a pass
        before = [(layer.keys, layer.values) for layer in seq.cache.layers]
        try:
            with self._interruptible(interrupt):
                out = self.model(input_ids=ids, position_ids=position, past_key_values=seq.cache, use_cache=True)
        except PassInterrupted:
            for layer, (keys, values) in zip(seq.cache.layers, before, strict=True):
                layer.keys, layer.values = keys, values
            raise
        seq.last_logits = self._logits(out.last_hidden_state[0, -1])

    @contextlib.contextmanager
    def _interruptible(self, interrupt: Callable[[], bool] | None) -> Iterator[None]:
        self._interrupt = interrupt
        try:
            yield
        finally:
            self._interrupt = None

    def _before_layer(self, _layer: torch.nn.Module, _args: tuple) -> None:
        if self._interrupt is not None and self._interrupt():
            raise PassInterrupted

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def greedy(model: LanguageModel, prompt: Prompt, image_rows: np.ndarray | None, max_new_tokens: int,
           stop_ids: set[int]) -> list[int]:
    """Greedy decoding of one request, token by token (the reference loop the engine batches)."""
    seq = model.prefill(prompt, image_rows)
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(seq.last_logits.argmax())
        out.append(token)
        if token in stop_ids or len(out) == max_new_tokens:
            break
        model.decode(seq, token)
    return out


def _checkpoint_dtype(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")


def _language_tensors(folder: Path, tie: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The text model's tensors (names as ``Qwen2_5_VLTextModel`` has them) and the head's."""
    body: dict[str, torch.Tensor] = {}
    head = None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files")
    for file in files:
        with safe_open(file, "pt") as shard:
            for key in shard.keys():
                if key == "lm_head.weight":
                    head = shard.get_tensor(key)
                elif key.startswith("model.language_model."):
                    body[key[len("model.language_model."):]] = shard.get_tensor(key)
                elif key.startswith("model.") and not key.startswith("model.visual."):
                    body[key[len("model."):]] = shard.get_tensor(key)
    if head is None and tie:
        head = body.get("embed_tokens.weight")
    if head is None or not body:
        raise ValueError(f"{folder}: no language model tensors (model.* and lm_head.weight)")
    return body, head
