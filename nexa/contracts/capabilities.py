"""What a request asks of a model (`Capability`): its runtime path, and which are text, native or
media. Its own module so that what needs only these (the runtime adapters, and so the node agent)
does not load the gateway's records (`contracts.gateway`, which re-exports them). Pure data."""

from __future__ import annotations

import enum
from typing import Final


class Capability(enum.StrEnum):
    """What a request asks of a model; each maps to one runtime path (the OpenAI-compatible ones,
    and the pooling and tokenizer paths vLLM and llama.cpp's server share)."""

    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    RERANK = "rerank"
    SCORE = "score"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    #: Anthropic's Messages API, OpenAI's Responses API and Anthropic's token count, passed through
    #: to a runtime that serves them natively (`Adapter.native_apis`); otherwise translated to chat.
    MESSAGES = "messages"
    RESPONSES = "responses"
    MESSAGE_TOKENS = "message_tokens"
    #: Media (`control.datapath.media`): speech to text, its translation to English, text to
    #: speech, and image generation; metered in their own units (`MEDIA_UNITS`), not tokens.
    TRANSCRIPTION = "transcription"
    TRANSLATION = "translation"
    SPEECH = "speech"
    IMAGE = "image"

    @property
    def path(self) -> str:
        return _PATHS[self]

    @property
    def streams(self) -> bool:
        """Its answer may be a stream (`stream: true`): chat, completions and the native APIs."""
        return self in (Capability.CHAT, Capability.COMPLETION, Capability.MESSAGES, Capability.RESPONSES)

    @property
    def native(self) -> bool:
        """Another API than OpenAI's chat, passed through as it is (its own answers and events)."""
        return self in (Capability.MESSAGES, Capability.RESPONSES, Capability.MESSAGE_TOKENS)

    @property
    def gated(self) -> bool:
        """Only replicas whose runtime's adapter records serving it get it (`adapters.serves`);
        chat, completions and embeddings go to every replica of the model, as they always did."""
        return self not in TEXT_CAPABILITIES

    @property
    def media(self) -> bool:
        """A media capability: served only on its OpenAI route, metered in `MEDIA_UNITS`."""
        return self in MEDIA_UNITS


_PATHS: Final = {
    Capability.CHAT: "/v1/chat/completions",
    Capability.COMPLETION: "/v1/completions",
    Capability.EMBEDDING: "/v1/embeddings",
    # vLLM (vllm/entrypoints/pooling/*/api_router.py, vllm/entrypoints/serve/tokenize) and
    # llama.cpp's server (tools/server/server.cpp) both serve these paths.
    Capability.RERANK: "/v1/rerank",
    Capability.SCORE: "/v1/score",
    Capability.TOKENIZE: "/tokenize",
    Capability.DETOKENIZE: "/detokenize",
    Capability.MESSAGES: "/v1/messages",
    Capability.RESPONSES: "/v1/responses",
    Capability.MESSAGE_TOKENS: "/v1/messages/count_tokens",
    Capability.TRANSCRIPTION: "/v1/audio/transcriptions",
    Capability.TRANSLATION: "/v1/audio/translations",
    Capability.SPEECH: "/v1/audio/speech",
    Capability.IMAGE: "/v1/images/generations",
}
#: Chat, completions and embeddings: what every LLM server's adapter serves (not `gated`).
TEXT_CAPABILITIES: Final = frozenset({Capability.CHAT, Capability.COMPLETION, Capability.EMBEDDING})
#: What a media request is metered (and its tenant's daily quota counted) in, by capability.
MEDIA_UNITS: Final = {
    Capability.TRANSCRIPTION: "audio_seconds",
    Capability.TRANSLATION: "audio_seconds",
    Capability.SPEECH: "speech_characters",
    Capability.IMAGE: "images",
}
