"""Request bodies of the language worker's generation API, validated by pydantic (strict types,
unknown fields refused, every size bounded). A :class:`BodyError` carries the 400 message."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from language_side.engine import SamplingParams
from worker_infra.http import StrictBody

MAX_TEXT_CHARS = 1 << 20
MAX_MESSAGES = 512
MAX_IMAGES = 64  # per request
MAX_IMAGE_SOURCE_CHARS = 64 << 20  # a data: URI holds the whole image


class BodyError(ValueError):
    """A body that does not validate: the message names the fields."""


class TextPart(StrictBody):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class ImagePart(StrictBody):
    """Where an image goes. In the two-request flow the image itself went to the encoder; a URL
    here is ignored."""

    type: Literal["image", "image_url"]
    image_url: dict[str, str] | str | None = Field(None)


class Message(StrictBody):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart | ImagePart] = Field(max_length=MAX_TEXT_CHARS)

    def for_template(self) -> dict:
        """As chat templates take it: every image part as ``{"type": "image"}`` (Qwen's own
        template looks for that type, or an ``image`` key, never a bare ``image_url``)."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        parts = [p.model_dump() if isinstance(p, TextPart) else {"type": "image"} for p in self.content]
        return {"role": self.role, "content": parts}


class SamplingIn(StrictBody):
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1)  # SGLang's -1 means all tokens, as 0 does
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)

    def params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        params = SamplingParams(self.max_new_tokens, self.temperature, self.top_p, max(self.top_k, 0), self.seed,
                                stop, tuple(self.stop_token_ids or ()))
        try:
            params.check()
        except ValueError as exc:
            raise BodyError(f"sampling_params: {exc}") from None
        return params


class GenerateIn(StrictBody):
    rid: str | None = Field(None, min_length=1, max_length=256)
    bootstrap_host: str | None = Field(None, max_length=253)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, lt=2**63)
    text: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    messages: list[Message] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    # SGLang's field: images this worker sends to its --encoder-urls itself (paths, URLs, data: URIs)
    image_data: str | Annotated[list[str], Field(min_length=1, max_length=MAX_IMAGES)] | None = None
    sampling_params: SamplingIn = Field(default_factory=SamplingIn)
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt_and_a_whole_peer(self) -> GenerateIn:
        if (self.text is None) == (self.messages is None):
            raise ValueError("give exactly one of text and messages")
        peer = (self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)
        if any(v is not None for v in peer) and any(v is None for v in peer):
            raise ValueError("bootstrap_host, bootstrap_port and bootstrap_room go together")
        if self.image_data is not None and self.has_peer:
            raise ValueError("image_data (this worker asks its encoders) and bootstrap_room (an encoder was already "
                             "asked) exclude each other")
        if any(not 0 < len(source) <= MAX_IMAGE_SOURCE_CHARS for source in self.images):
            raise ValueError(f"image_data: each image is a non-empty string of at most {MAX_IMAGE_SOURCE_CHARS} "
                             f"characters")
        return self

    @property
    def images(self) -> list[str]:
        return [self.image_data] if isinstance(self.image_data, str) else list(self.image_data or [])

    @property
    def has_peer(self) -> bool:
        return self.bootstrap_room is not None


def parse(model: type[StrictBody], raw: bytes):
    """``model`` from a JSON body, or BodyError naming the first few problems."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        problems = []
        for error in exc.errors()[:4]:
            where = ".".join(str(p) for p in error["loc"]) or "body"
            problems.append(f"{where}: {error['msg']}")
        raise BodyError("; ".join(problems)) from None
