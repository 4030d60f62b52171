"""The pooling and tokenizer endpoints, as vLLM documents them ("OpenAI-compatible server": Re-rank
API, Score API, Tokenizer API): `/rerank`, `/v1/rerank` and `/v2/rerank`; `/score` and `/v1/score`;
`/tokenize` and `/detokenize`. Each is served unless `--serve` (`adapters.SIM_SERVE_FLAG`) leaves
its capability out; a path not served answers 404, as a runtime without the route does.

Deterministic: a token is a whitespace-separated word; a word of the simulator's vocabulary
(`tokens.WORDS`) is its index there, any other word an id above it from its hash (detokenized as
`<unk>`). A document's relevance (and a pair's score) is the share of the query's words it holds.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Final

from nexa.contracts.gateway import Capability
from nexa.simruntime.asgi import BadRequest
from nexa.simruntime.tokens import WORDS

#: The paths served, by capability.
PATHS: Final = {
    "/rerank": Capability.RERANK,
    "/v1/rerank": Capability.RERANK,
    "/v2/rerank": Capability.RERANK,
    "/score": Capability.SCORE,
    "/v1/score": Capability.SCORE,
    "/tokenize": Capability.TOKENIZE,
    "/detokenize": Capability.DETOKENIZE,
}
#: What /tokenize reports as the model's context length.
MAX_MODEL_LEN: Final = 4096
_INDEX: Final = {word: i for i, word in enumerate(WORDS)}
_UNKNOWN_IDS: Final = 30000


def token_ids(text: str) -> list[int]:
    """The simulated tokenizer: one id per word."""
    out = []
    for word in text.split():
        known = _INDEX.get(word)
        if known is None:
            known = len(WORDS) + int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % _UNKNOWN_IDS
        out.append(known)
    return out


def relevance(query: str, document: str) -> float:
    """The share of the query's distinct words the document holds (0 … 1)."""
    asked = set(query.lower().split())
    if not asked:
        return 0.0
    return round(len(asked & set(document.lower().split())) / len(asked), 6)


def answer(capability: Capability, default_model: str, raw: bytes, *, serial: int) -> tuple[bytes, int]:
    """The answer to one request (vLLM's shape) and the tokens it read; BadRequest naming the field."""
    try:
        payload = json.loads(raw)
    except ValueError:
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise BadRequest("the body must be a JSON object")
    model = str(payload.get("model") or default_model)
    if capability is Capability.RERANK:
        return _rerank(model, payload, serial)
    if capability is Capability.SCORE:
        return _score(model, payload, serial)
    if capability is Capability.TOKENIZE:
        text = _tokenize_text(payload)
        ids = token_ids(text)
        body = {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
        return json.dumps(body).encode(), len(ids)
    tokens = payload.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("tokens must be a list of token ids", param="tokens")
    words = [WORDS[t] if 0 <= t < len(WORDS) else "<unk>" for t in tokens]
    return json.dumps({"prompt": " ".join(words)}).encode(), len(tokens)


def _document_text(document: object) -> str:
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return str(document["text"])
    raise BadRequest("documents must be strings or objects with a text", param="documents")


def _rerank(model: str, payload: dict[str, Any], serial: int) -> tuple[bytes, int]:
    query, documents = payload.get("query"), payload.get("documents")
    if not isinstance(query, str):
        raise BadRequest("query must be a string", param="query")
    if not isinstance(documents, list) or not documents:
        raise BadRequest("documents must be a non-empty list", param="documents")
    texts = [_document_text(d) for d in documents]
    top_n = payload.get("top_n") or len(texts)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise BadRequest("top_n must be a whole number", param="top_n")
    ranked = sorted(range(len(texts)), key=lambda i: (-relevance(query, texts[i]), i))[:top_n]
    results = [
        {"index": i, "document": {"text": texts[i]}, "relevance_score": relevance(query, texts[i])} for i in ranked
    ]
    used = sum(len(query.split()) + len(t.split()) for t in texts)
    usage = {"prompt_tokens": used, "total_tokens": used}
    body = {"id": f"rerank-sim{serial}", "model": model, "usage": usage, "results": results}
    return json.dumps(body).encode(), used


def _texts(payload: dict[str, Any], name: str) -> list[str]:
    value = payload.get(name)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [str(v) for v in value]
    raise BadRequest(f"{name} must be a string or a non-empty list of strings", param=name)


def _score(model: str, payload: dict[str, Any], serial: int) -> tuple[bytes, int]:
    firsts, seconds = _texts(payload, "text_1"), _texts(payload, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise BadRequest("text_1 must be one text or as many as text_2", param="text_1")
    data = [
        {"index": i, "object": "score", "score": relevance(a, b)}
        for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
    ]
    used = sum(len(a.split()) + len(b.split()) for a, b in zip(firsts, seconds, strict=True))
    usage = {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0}
    body = {"id": f"score-sim{serial}", "object": "list", "created": int(time.time()), "model": model}
    return json.dumps({**body, "data": data, "usage": usage}).encode(), used


def _tokenize_text(payload: dict[str, Any]) -> str:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        parts = [m.get("content") for m in messages if isinstance(m, dict)]
        return " ".join(p for p in parts if isinstance(p, str))
    raise BadRequest("prompt must be a string (or messages, a list)", param="prompt")
