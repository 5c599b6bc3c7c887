"""What every seeded checkpoint family shares: an offline byte-level tokenizer with the family's
special tokens and chat template, and a language model re-drawn so that its greedy ids are decided
far above bf16 rounding and by the media (:func:`decisive_language_model`). The families' writers:
``make_checkpoint.py`` (Qwen2.5-VL, Qwen3-VL, and the command line), ``checkpoint_minimax.py``,
``checkpoint_qwen2_audio.py``."""

from __future__ import annotations

from pathlib import Path

# Qwen's special tokens, in the order they get ids after the 256 byte tokens.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
VOCAB_SIZE = 512  # 256 bytes + the special tokens, rounded up (the model's table covers every id)

# Chat messages -> prompt, as Qwen2.5-VL lays them out: each turn in <|im_start|>role ...
# <|im_end|>, each image (video) part as one vision_start / image_pad (video_pad) / vision_end
# placeholder (the language side expands the pad to the image's or video's token count).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or part['type'] == 'video_url' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def byte_symbols() -> list[str]:
    """One printable character per byte value (the byte-level BPE convention): printable
    Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, shift = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shift)
            shift += 1
    return [symbols[b] for b in range(256)]


def write_tokenizer(folder: Path, special: tuple[str, ...] = SPECIAL_TOKENS, template: str = CHAT_TEMPLATE,
                    **roles: str) -> dict[str, int]:
    """A byte-level tokenizer (every byte one token, no merges) plus the ``special`` tokens (the
    first two are the pad/bos and the chat-role ones of ``roles``: Qwen's by default), saved so
    ``AutoTokenizer.from_pretrained(folder)`` loads it; returns the special tokens' ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    # as in Qwen's own tokenizer, the chat and vision tokens are special (clients that sample
    # random prompts, such as SGLang's benchmark, leave them out)
    roles = roles or {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **roles, model_max_length=32768,
                                        extra_special_tokens=[t for t in special if t not in roles.values()])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in special}
    assert list(ids.values()) == list(range(256, 256 + len(special))), ids
    return ids


# The initializer_range the configs carry: what MiniMax's vision tower and the projectors are drawn
# at (every language model is re-drawn by decisive_language_model).
TEXT_INIT = 0.2

# What the seeded language models answer: at each step the token just read (one of ANSWER_STATES:
# the prompt's last token, a newline, or an answer) picks a pair of answer tokens, one of
# ANSWER_PLUS and one of ANSWER_MINUS (:func:`answer_pair`), and the sign of u.h picks within the
# pair (h: the final normalized hidden state, rms 1; u: a unit vector, so u.h is roughly N(0, 1)).
ANSWER_PLUS, ANSWER_MINUS = "abcdefgh", "ABCDEFGH"
ANSWER_STATES = "\n" + ANSWER_PLUS + ANSWER_MINUS
# A state token's embedding is STATE_SCALE on a coordinate of its own (its index in ANSWER_STATES),
# and no layer writes to those coordinates: at the last position they hold exactly the token read.
STATE_SCALE = 16.0
# The pair leads the other answer tokens by about PAIR_LEAD nats, the tokens outside the answers
# (all at exactly 0) by more; within the pair, "plus" scores +HEAD_SCALE * u.h, "minus" the
# opposite, so the pick leads by 2 * HEAD_SCALE * |u.h|. STATE_READ: a state coordinate's value
# after the final norm, about STATE_SCALE / rms of the last position's residual stream.
PAIR_LEAD, STATE_READ, HEAD_SCALE = 1.5, 8.0, 1.5
# Attention scores at std ~4 (queries and keys at twice the unit scale): a position attends to
# some of its context, not an even average of it, so u.h follows the media's content.
QK_GAIN = 2.0
# The last position's state led by what it attends to (the media) rather than by its own token.
ATTENTION_OUT_GAIN, MLP_OUT_GAIN = 2.0, 0.5
# The head direction u of each shape the tests generate with, (family, hidden size, layers, seed)
# -> the seed of u: the hidden states do not depend on u, so head seeds were tried in turn (about 1
# in 100 passes on Qwen2.5-VL's 150 steps) for one with which, on the tests' media and prompts
# (tests/test_checkpoint_margins.py checks a part of them), every greedy step of transformers'
# reference leads its runner-up by at least 0.1 nats (0.14 to 0.30 here) and the media give
# different ids. New test media or prompts may need another search; any other shape or seed draws
# u from its seed, with no such guarantee (about 1 step in 50 then leads by under 0.1 nats).
HEAD_SEEDS: dict[tuple[str, int, int, int], int] = {
    ("qwen2_5_vl", 256, 2, 0): 993,  # the SGLang tests' and the main job's --quick checkpoint
    ("qwen2_5_vl", 3584, 1, 0): 99,  # the main job's default checkpoint
    ("qwen3_vl", 256, 2, 0): 20,
    ("qwen2_vl", 256, 2, 0): 6,
    ("qwen3_vl_moe", 256, 2, 0): 5,
    ("minimax_m3_vl", 256, 2, 0): 189,
    ("qwen2_audio", 256, 2, 0): 21,
}


def answer_pair(state: int) -> tuple[int, int]:
    """The (plus, minus) answer token ids after the ``state``-th token of ANSWER_STATES: each
    answer token follows at least two states, so every answer is reachable."""
    return ord(ANSWER_PLUS[3 * state % 8]), ord(ANSWER_MINUS[(5 * state + 1) % 8])


def head_direction(hidden_size: int, head_seed: int):  # noqa: ANN201 - a torch tensor
    """The unit vector u the head's sign reads, drawn from ``head_seed``, off the state coordinates."""
    import torch

    u = torch.randn(hidden_size, generator=torch.Generator().manual_seed(head_seed), dtype=torch.float64)
    u[:len(ANSWER_STATES)] = 0
    return (u / u.norm()).float()


def set_answer_head(lm_head, direction) -> None:
    """``lm_head`` (the [vocab, hidden] output projection) as ANSWER_PLUS's comment says: every
    token outside the answers scores exactly 0."""
    import torch

    weight = lm_head.weight
    with torch.no_grad():
        weight.zero_()
        for state in range(len(ANSWER_STATES)):
            for token in answer_pair(state):
                weight[token, state] = PAIR_LEAD / STATE_READ
        for plus, minus in zip(ANSWER_PLUS, ANSWER_MINUS, strict=True):
            weight[ord(plus)] += HEAD_SCALE * direction
            weight[ord(minus)] -= HEAD_SCALE * direction


def decisive_language_model(model, family: str, seed: int, layers: int, norm_offset: float = 0.0) -> None:
    """Re-draw ``model``'s language model so that each greedy id is decided far above what bf16
    rounding moves, and still by the media.

    Why: at the configs' init (0.2) activations grow tenfold a layer and attention is one-hot,
    so bf16 rounding moves the final hidden state by ~4% (a bf16 vs a float32 forward), and a
    random 512-way head often has its top two within that (the top two of 512 Gaussian logits
    are close): two bf16 implementations part at random steps. Here instead:

    * every linear layer of the language model (a mixture's router and fused experts too) is drawn
      at unit scale (std 1/sqrt(inputs); times
      :data:`QK_GAIN`, :data:`ATTENTION_OUT_GAIN`, :data:`MLP_OUT_GAIN`), the token embeddings at
      std 1: activations stay near 1, and bf16 rounding moves the final hidden state ~0.5%
      (u.h by ~0.005, at most ~0.04 over the tests' steps);
    * the head (:func:`set_answer_head`) makes each step a choice between two tokens by the sign
      of u.h, which leads the runner-up by 2 * HEAD_SCALE * |u.h| nats: the bf16 rounding of the
      logits (1/256 of them, 1.5 to 7 here) is far below that, and only the hidden state's
      rounding can flip a step, one whose |u.h| is within it of 0. The head direction of the
      tests' shapes is chosen (:data:`HEAD_SEEDS`) so that no step of theirs is. The pair comes
      from the token read, exactly (its own coordinates), and u.h follows the media through
      attention, so media give different ids. EOS (at 0) never wins; at temperature 1 most of
      the mass is on the ~500 tokens at 0, so sampling still spreads.

    ``norm_offset``: 1 where the model's norms scale by 1 + weight (Gemma's), for the query/key
    norms' gain."""
    import torch

    text = model.get_decoder()
    generator = torch.Generator().manual_seed(seed)
    gains = {"q_proj": QK_GAIN, "k_proj": QK_GAIN, "o_proj": ATTENTION_OUT_GAIN, "down_proj": MLP_OUT_GAIN}
    states = len(ANSWER_STATES)
    with torch.no_grad():
        for name, module in text.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, torch.nn.Linear):
                weight = torch.randn(module.weight.shape, generator=generator) / module.in_features ** 0.5
                module.weight.copy_(weight * gains.get(leaf, 1.0))
                if module.bias is not None:
                    module.bias.zero_()
                if leaf in ("o_proj", "down_proj"):  # what writes to the residual stream: not to the states'
                    module.weight[:states] = 0
            elif leaf in ("q_norm", "k_norm"):  # normalized queries and keys: their norms set the score scale
                module.weight.copy_((module.weight + norm_offset) * QK_GAIN - norm_offset)
            elif leaf == "experts" and hasattr(module, "gate_up_proj"):  # fused experts: [experts, out, in] each
                module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=generator)
                                          / module.gate_up_proj.shape[-1] ** 0.5)
                down = torch.randn(module.down_proj.shape, generator=generator) / module.down_proj.shape[-1] ** 0.5
                module.down_proj.copy_(down * MLP_OUT_GAIN)
                module.down_proj[:, :states] = 0
            elif leaf == "gate" and isinstance(getattr(module, "weight", None), torch.nn.Parameter):  # a router
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) / module.weight.shape[-1] ** 0.5)
        embed = model.get_input_embeddings().weight
        embed.copy_(torch.randn(embed.shape, generator=generator))
        embed[:, :states] = 0  # no other token on the state coordinates either
        for state, token in enumerate(ANSWER_STATES):
            embed[ord(token)] = 0
            embed[ord(token), state] = STATE_SCALE
    hidden_size = embed.shape[1]
    head_seed = HEAD_SEEDS.get((family, hidden_size, layers, seed), seed)
    set_answer_head(model.get_output_embeddings(), head_direction(hidden_size, head_seed))
