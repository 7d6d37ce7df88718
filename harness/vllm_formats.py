"""vLLM 0.32's wire formats and request rules, as the fake vLLM answers them: pure functions.

The shapes are copied from what a real vLLM 0.32 (CPU build) answered, in
``tests/fixtures/vllm-0.32.0-cpu/``; the rules (the default and the cap of ``max_tokens``) from
vLLM's source, named at each function. One definition for both servers of the fake
(:mod:`harness.fake_vllm` for the tests, :mod:`harness.fake_vllm_fast` for the benchmarks).

>>> answer = completion_answer(False, "cmpl-1", "tiny", " w0 w1", 1, {"completion_tokens": 2})
>>> answer["object"], answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]
('text_completion', ' w0 w1', None)
>>> count_prompt({"prompt": "the quick brown fox"})  # 4 words and the BOS
5
>>> max_tokens_for(1024, prompt_tokens=1000, max_tokens=None, default=None, cap=None)
24
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm-0.32.0-cpu"
METRICS_TEXT = (FIXTURES / "metrics-fresh.txt").read_text()

#: A model config vLLM could serve: 2 layers, 2 KV heads, head_dim 64, bf16 (1 KiB per token).
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 256,
    "max_position_embeddings": 1024,
    "torch_dtype": "bfloat16",
}
CREATED = 1795939723  # vLLM stamps "created"; fixed here so that answers are reproducible
FINGERPRINT = "vllm-0.32.0-3470f119"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: vLLM 0.32's ``CompletionRequest.max_tokens`` default, also for an explicit null.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def write_model_dir(path: Path, *, max_new_tokens: int | None = None) -> Path:
    """A model directory holding only ``config.json`` (no tokenizer files), and with
    ``max_new_tokens`` a ``generation_config.json`` that sets it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    if max_new_tokens is not None:
        generation = {"bos_token_id": 0, "eos_token_id": 1, "max_new_tokens": max_new_tokens}
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


def generation_default(model_root: Path | None) -> int | None:
    """``max_new_tokens`` of the model's ``generation_config.json``: what vLLM's default
    ``--generation-config auto`` takes as the default ``max_tokens``."""
    if model_root is None:
        return None
    try:
        value = json.loads((model_root / "generation_config.json").read_text()).get(
            "max_new_tokens"
        )
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _words(text: str) -> int:
    return len(text.split())


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def count_prompt(body: dict[str, Any]) -> int:
    """The fake tokenizer: words + 1 BOS for a prompt; 3 per message plus its words, + 2 for
    the generation prompt, for messages. Token-id prompts count as given."""
    if "messages" in body:
        return 2 + sum(3 + _words(_message_text(m.get("content"))) for m in body["messages"])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        return sum(count_prompt({**body, "prompt": p}) for p in prompt)
    bos = 1 if body.get("add_special_tokens", True) else 0
    return _words(str(prompt)) + bos


def dumps(obj: Any) -> bytes:
    """JSON as vLLM answers it: pydantic's compact JSON, non-ASCII left as is."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def vllm_error(message: str, status: int = 400, type_: str = "BadRequestError") -> bytes:
    return dumps({"error": {"message": message, "type": type_, "param": None, "code": status}})


def max_tokens_for(
    max_model_len: int,
    *,
    prompt_tokens: int,
    max_tokens: int | None,
    default: int | None,
    cap: int | None,
) -> int:
    """vLLM's ``get_max_tokens`` (entrypoints/serve/utils/api_utils.py): the least of the rest
    of the context, the request's max_tokens (else the generation config's ``default``) and the
    override ``cap``."""
    fallback = max_tokens if max_tokens is not None else default
    limits = (max_model_len - prompt_tokens, fallback, cap)
    return min(v for v in limits if v is not None)


def token_text(step: int) -> str:
    """The text the fake generates at decode step ``step``."""
    return f" w{step}"


def models_list(served_name: str, model_root: Path | None, max_model_len: int) -> dict[str, Any]:
    """``GET /v1/models``: one model, ``root`` when a model directory is known."""
    entry: dict[str, Any] = {
        "id": served_name,
        "object": "model",
        "created": CREATED,
        "owned_by": "vllm",
    }
    if model_root is not None:
        entry["root"] = str(model_root)
    entry |= {
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": "modelperm-b0903443d43eb746",
                "object": "model_permission",
                "created": CREATED,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return {"object": "list", "data": [entry]}


def tokenize_answer(count: int, max_model_len: int) -> dict[str, Any]:
    """``POST /tokenize``'s answer for a prompt of ``count`` tokens."""
    return {
        "count": count,
        "max_model_len": max_model_len,
        "tokens": list(range(count)),
        "token_strs": None,
    }


def completion_answer(
    chat: bool, rid: str, model: str, text: str, n: int, usage: dict[str, int]
) -> dict[str, Any]:
    """A non-streamed answer: ``n`` choices of ``text``, each cut at its length."""
    choices: list[dict[str, Any]]
    if chat:
        choices = [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
            }
            for i in range(n)
        ]
        answer: dict[str, Any] = {"id": rid, "object": "chat.completion"}
    else:
        choices = [
            {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
            for i in range(n)
        ]
        answer = {"id": rid, "object": "text_completion"}
    answer |= {
        "created": CREATED,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": {**usage, "prompt_tokens_details": None},
        "kv_transfer_params": None,
    }
    return answer


def stream_head(chat: bool, rid: str, model: str) -> dict[str, Any]:
    """The fields every event of a streamed answer starts with."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": CREATED, "model": model}


def stream_opening(
    head: dict[str, Any], index: int, usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The event vLLM opens each choice of a chat stream with: the role, before any token
    (``usage``: the continuous usage stats, 0 tokens generated, where asked)."""
    delta = {"role": "assistant", "content": ""}
    opening = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    event: dict[str, Any] = {**head, "choices": [opening]}
    if usage is not None:
        event["usage"] = usage
    return event | {"prompt_token_ids": None, "prompt_text": None}


def stream_token(
    head: dict[str, Any],
    chat: bool,
    index: int,
    text: str,
    *,
    last: bool,
    usage: dict[str, Any] | None = None,
    fingerprint: bool = False,
) -> dict[str, Any]:
    """The event of one decode step of choice ``index``; the ``last`` one says why it ended.
    ``usage``: the continuous usage stats (``stream_options.continuous_usage_stats``);
    ``fingerprint``: the last event of a stream that did not ask for the usage carries the
    server's fingerprint (vLLM 0.32; asked, it rides on the usage-only event instead)."""
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    choice |= {"logprobs": None, "finish_reason": "length" if last else None}
    if last or not chat:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    event: dict[str, Any] = {**head, "choices": [choice]}
    if usage is not None:
        event["usage"] = usage
    if fingerprint:
        event["system_fingerprint"] = FINGERPRINT
    return event


def token_usage(chat: bool, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """An event's continuous usage stats, in vLLM's order (a chat's names no details: null)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if chat:
        usage["completion_tokens_details"] = None
    return usage


def stream_usage(head: dict[str, Any], usage: dict[str, int]) -> dict[str, Any]:
    """The event after the last token when the request asked ``stream_options.include_usage``."""
    return {**head, "choices": [], "usage": usage, "system_fingerprint": FINGERPRINT}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# --- the render endpoints (vLLM 0.32, entrypoints/scale_out/render/) ---------------------------

#: The render endpoint of each generation endpoint.
RENDER_PATHS = {
    "/v1/completions/render": "completions",
    "/v1/chat/completions/render": "chat",
    "/v1/responses/render": "responses",
    "/v1/messages/render": "messages",
}
#: What each of them answers without ``--enable-scale-out`` (scale_out/factories.py:
#: ``create_error_response(message, "PermissionDeniedError", HTTPStatus.FORBIDDEN)``).
RENDER_DISABLED_ERROR = vllm_error(
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
    403,
    "PermissionDeniedError",
)
#: ``SamplingParams.max_tokens``' default, which its msgspec JSON (``omit_defaults``) leaves out.
SAMPLING_DEFAULT_MAX_TOKENS = 16


def render_messages(endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for a chat, Responses or Anthropic messages body (the
    fake's shapes: a top-level ``system`` or ``instructions`` first, Responses input items as
    messages, a string input as one user message)."""
    if endpoint == "chat":
        messages = body["messages"]
        if not isinstance(messages, list):
            raise TypeError("messages must be a list")
        return messages
    head = body.get("system") if endpoint == "messages" else body.get("instructions")
    system = [{"role": "system", "content": head}] if head is not None else []
    if endpoint == "messages":
        return [*system, *body["messages"]]
    items = body["input"]
    if isinstance(items, str):
        return [*system, {"role": "user", "content": items}]
    return [*system, *(i for i in items if isinstance(i, dict) and "content" in i)]


def render_keep(endpoint: str, body: dict[str, Any], max_model_len: int) -> int | None:
    """How many prompt tokens vLLM keeps (``TokenizeParams``): ``truncate_prompt_tokens`` for
    completions and chat, ``-1`` for Responses unless ``truncation`` is ``"disabled"``; ``-1``
    keeps ``max_model_len - 1`` when output was asked for, else ``max_model_len``."""
    if endpoint == "responses":
        keep = -1 if body.get("truncation", "disabled") != "disabled" else None
        asked = body.get("max_output_tokens") or 0
    elif endpoint == "messages":
        return None
    else:
        keep = body.get("truncate_prompt_tokens")
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        if endpoint == "completions" and body.get("max_tokens") is None:
            asked = COMPLETIONS_DEFAULT_MAX_TOKENS
    if keep is None or keep >= 0:
        return keep
    return max_model_len if asked == 0 else max_model_len - 1


def render_answer(
    request_id: str,
    ids: list[int],
    *,
    body: dict[str, Any],
    max_tokens: int,
) -> dict[str, Any]:
    """One ``GenerateRequest`` as vLLM's render endpoint answers it (fields and order as a real
    vLLM 0.32 CPU build answered; ``sampling_params`` at the defaults of an untouched request)."""
    params: dict[str, Any] = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "stop": [],
        "stop_token_ids": [],
        **({} if max_tokens == SAMPLING_DEFAULT_MAX_TOKENS else {"max_tokens": max_tokens}),
        "output_kind": 2,
        "skip_clone": True,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    stream = bool(body.get("stream"))
    return {
        "request_id": request_id,
        "token_ids": ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": params,
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": body.get("stream_options") if stream else None,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority") or 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def render(
    path: str,
    raw: bytes,
    *,
    served_name: str,
    max_model_len: int,
    prompt_counter: Callable[[dict[str, Any]], int],
    max_tokens_for: Callable[[int, int | None], int],
) -> tuple[int, bytes]:
    """``POST`` of ``raw`` to a render endpoint, as vLLM 0.32's render API answers it with
    ``--enable-scale-out`` (``scale_out/render/serving.py``): what the engine would get, one
    ``GenerateRequest`` per engine prompt (a list for completions) with the kept prompt's ids
    (``prompt_counter``'s counts; token-id prompts as given) and the ``max_tokens`` that
    ``max_tokens_for(prompt_tokens, asked)`` resolves; vLLM's refusals in its order."""
    endpoint = RENDER_PATHS[path]
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise TypeError("the body is not an object")
        model = body.get("model")
        if model is not None and model != served_name:
            message = f"The model `{model}` does not exist."
            return 404, vllm_error(message, 404, "NotFoundError")
        if body.get("use_beam_search"):
            return 400, vllm_error("Beam search is not supported by the render endpoint")
        if endpoint == "responses" and body.get("previous_response_id") is not None:
            message = "previous_response_id is not supported by the stateless render endpoint."
            return 400, vllm_error(message, type_="invalid_request_error")
        if endpoint == "completions" and body.get("suffix") is not None:
            message = "suffix is only supported for models with FIM completion rendering"
            return 400, vllm_error(message)
        prompts: list[list[int]] = []
        if endpoint == "completions":
            prompt = body["prompt"]
            many = isinstance(prompt, list) and not (prompt and isinstance(prompt[0], int))
            for p in prompt if many else [prompt]:
                count = prompt_counter({**body, "prompt": p})
                prompts.append(list(p) if isinstance(p, list) else list(range(count)))
        else:
            count = prompt_counter({"messages": render_messages(endpoint, body)})
            prompts.append(list(range(count)))
        asked = _asked_max_tokens(endpoint, body)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        return 400, vllm_error(f"bad request: {exc}")
    keep = render_keep(endpoint, body, max_model_len)
    rid = hashlib.sha256(raw).hexdigest()[:16]
    answers = []
    for i, ids in enumerate(prompts):
        if keep is not None and keep < len(ids):
            ids = ids[len(ids) - keep :] if keep else []
        if not ids:
            return 400, vllm_error("No token_ids rendered")
        if len(ids) > max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. "
                f"However, your prompt contains at least {max_model_len + 1} input "
                "tokens, which exceeds this limit even without any output tokens."
            )
            return 400, vllm_error(message)
        request_id = f"{rid}-{i}" if len(prompts) > 1 else rid
        max_tokens = max_tokens_for(len(ids), asked)
        answers.append(render_answer(request_id, ids, body=body, max_tokens=max_tokens))
    return 200, dumps(answers if endpoint == "completions" else answers[0])


def _asked_max_tokens(endpoint: str, body: dict[str, Any]) -> int | None:
    """The request's own max_tokens, as each endpoint's request object reads it."""
    if endpoint == "chat":
        asked = body.get("max_completion_tokens")
        return asked if asked is not None else body.get("max_tokens")
    if endpoint == "responses":
        return body.get("max_output_tokens")
    asked = body.get("max_tokens")
    return COMPLETIONS_DEFAULT_MAX_TOKENS if asked is None and endpoint == "completions" else asked
