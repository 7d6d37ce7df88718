"""vLLM 0.32's max_tokens defaults, exactly: what a real vLLM generates for a request that names
no ``max_tokens``, and that the sidecar in front of it projects the same.

vLLM sizes every request with ``get_max_tokens`` (``entrypoints/serve/utils/api_utils.py``): the
least of the rest of the context, the request's own value (else the generation config's default
``max_tokens``, from ``max_new_tokens``) and ``override_max_tokens``. Per endpoint:

- ``/v1/completions``: ``CompletionRequest.max_tokens: int | None = 16``, and the
  ``normalize_null_max_tokens`` validator makes an explicit ``null`` the same 16;
- chat: ``max_completion_tokens`` if not None, else ``max_tokens``; neither: the default;
- Responses: ``max_output_tokens``; None: the default (its answer's ``max_output_tokens`` says
  what vLLM used);
- ``override_max_tokens`` (``--override-generation-config '{"max_new_tokens": N}'``) caps every
  request, even one that names its own ``max_tokens``.

The first tests are pure (how the sidecar reads a model directory's generation config, and the
flags); the real-vLLM ones run a sidecar process in front of the session's vLLM (they also hold
against an external one, ``KV_SIDECAR_TEST_VLLM_URL``), and, for the generation config and the
cap, in front of one extra vLLM started here with a small pool (skipped for an external vLLM).
Every generation asks ``ignore_eos``, so that vLLM generates exactly its max_tokens; what the
sidecar projected is read from its ``kv_sidecar_request_max_tokens`` histogram (its sum grows by
each request's effective max_tokens).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.vllm_cpu import VllmServer, ensure_model, ensure_vllm
from harness.workload import SidecarProcess, metric_value
from sidecar.config import Settings
from sidecar.engine.discovery import generation_config_max_tokens
from tests.conftest import VllmInfo
from tests.support.wait import wait_for

EXTERNAL = os.environ.get("KV_SIDECAR_TEST_VLLM_URL")

# --- pure: the generation config as vLLM's "auto" mode reads it --------------------------------

#: A plain decoder's config.json (what the sidecar and vLLM read besides the generation config).
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
}

#: name -> (generation_config.json text or None for no file, extra config.json keys, default)
#: The defaults are what vLLM 0.32's own ``try_get_generation_config`` + ``get_diff_sampling_param``
#: give (``test_generation_config_reading_matches_vllms_own`` asks it).
VARIANTS: dict[str, tuple[str | None, dict[str, Any], int | None]] = {
    "file": ('{"bos_token_id": 0, "eos_token_id": 1, "max_new_tokens": 7}', {}, 7),
    "file-from-model-config": ('{"_from_model_config": true, "max_new_tokens": 8}', {}, 8),
    "file-without-it": ('{"bos_token_id": 0}', {"max_new_tokens": 13}, None),
    "file-max-length-only": ('{"max_length": 50}', {}, None),
    "file-null": ('{"max_new_tokens": null}', {}, None),
    "file-float": ('{"max_new_tokens": 5.0}', {}, 5),
    "no-file": (None, {}, None),
    "no-file-config-has-it": (None, {"max_new_tokens": 9}, 9),
    "bad-file-config-has-it": ("{not json", {"max_new_tokens": 11}, 11),
}


def write_variant(directory: Path, name: str) -> Path:
    generation, extra, _ = VARIANTS[name]
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    if generation is not None:
        (directory / "generation_config.json").write_text(generation)
    return directory


@pytest.mark.parametrize("name", VARIANTS)
def test_generation_config_default(tmp_path: Path, name: str) -> None:
    directory = write_variant(tmp_path / name, name)
    value, source = generation_config_max_tokens(directory)
    assert value == VARIANTS[name][2]
    assert (source is None) == (value is None)
    # --model-config may name the config.json itself: its directory is read
    assert generation_config_max_tokens(directory / "config.json")[0] == value


def cli(*args: str) -> Settings:
    """``kv-sidecar serve ARGS`` as settings (env vars apply too)."""
    return Settings(_cli_parse_args=list(args))  # type: ignore[call-arg]


def test_the_flags() -> None:
    settings = cli("--default-max-tokens", "256", "--max-tokens-cap", "64")
    assert (settings.default_max_tokens, settings.max_tokens_cap) == (256, 64)
    assert cli("--default-max-tokens", "0").default_max_tokens == 0
    assert (cli().default_max_tokens, cli().max_tokens_cap) == (None, None)
    with pytest.raises(ValueError, match="greater than 0"):
        cli("--max-tokens-cap", "0")


def test_the_flags_as_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_SIDECAR_DEFAULT_MAX_TOKENS", "100")
    monkeypatch.setenv("KV_SIDECAR_MAX_TOKENS_CAP", "50")
    settings = cli()
    assert (settings.default_max_tokens, settings.max_tokens_cap) == (100, 50)
    assert cli("--max-tokens-cap", "30").max_tokens_cap == 30  # flags win


_PROBE = """
import json, sys
from vllm.transformers_utils.config import try_get_generation_config
# vllm/config/model.py ModelConfig.get_diff_sampling_param, for --generation-config auto
out = {}
for d in sys.argv[1:]:
    config = try_get_generation_config(d, trust_remote_code=False)
    diff = {} if config is None else config.to_diff_dict()
    value = diff.get("max_new_tokens")
    out[d] = None if value is None else value
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_generation_config_reading_matches_vllms_own(tmp_path: Path) -> None:
    """The sidecar's reading of each variant is what vLLM's own code makes of it."""
    python = ensure_vllm()
    dirs = {name: str(write_variant(tmp_path / name, name)) for name in VARIANTS}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(
        [str(python), "-c", _PROBE, *dirs.values()],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm_says = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, directory in dirs.items():
        value = vllm_says[directory]
        expected = None if value is None else int(value)
        assert generation_config_max_tokens(Path(directory))[0] == expected, name
        assert VARIANTS[name][2] == expected, name


# --- real vLLM: the session's server (no generation config default) ---------------------------


def projected_sum(sidecar: SidecarProcess) -> float:
    return metric_value(sidecar.metrics(), "kv_sidecar_request_max_tokens_sum") or 0.0


def post(sidecar: SidecarProcess, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """POST through the sidecar; vLLM's answer, and the max_tokens the sidecar projected for it."""
    before = projected_sum(sidecar)
    resp = httpx.post(sidecar.url + path, json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return dict(resp.json()), projected_sum(sidecar) - before


def long_messages(url: str, model: str, max_model_len: int, room: int = 40) -> list[dict[str, str]]:
    """A chat whose prompt leaves between 8 and ``room + 24`` tokens of context (vLLM's
    ``/tokenize`` counts it), so that "the rest of the context" is short on any server."""
    target = max_model_len - room
    words = target
    for _ in range(12):
        messages = [{"role": "user", "content": " ".join(["hello"] * words)}]
        resp = httpx.post(
            url + "/tokenize", json={"model": model, "messages": messages}, timeout=60
        )
        resp.raise_for_status()
        count = int(resp.json()["count"])
        if 8 <= max_model_len - count <= room + 24:
            return messages
        words = max(1, words + (target - count) * words // max(count, 1))
    raise AssertionError(f"no chat prompt of about {target} tokens for {model}")


@pytest.fixture(scope="module")
def front(vllm: VllmInfo) -> Iterator[SidecarProcess]:
    with SidecarProcess(vllm.url, "--policy", "queue") as sidecar:
        yield sidecar


@pytest.mark.vllm
@pytest.mark.parametrize("max_tokens", ["absent", None], ids=["absent", "null"])
def test_completion_without_max_tokens_generates_16(
    vllm: VllmInfo, front: SidecarProcess, max_tokens: str | None
) -> None:
    body: dict[str, Any] = {"model": vllm.served_name, "prompt": "hello there", "ignore_eos": True}
    if max_tokens != "absent":
        body["max_tokens"] = max_tokens
    answer, projected = post(front, "/v1/completions", body)
    assert answer["usage"]["completion_tokens"] == 16
    assert projected == 16  # not the rest of the context


@pytest.mark.vllm
def test_completion_echo_without_generation_is_served(
    vllm: VllmInfo, front: SidecarProcess
) -> None:
    """``echo`` with ``max_tokens: 0`` (prompt scoring): vLLM serves it with max_tokens=1."""
    body = {"model": vllm.served_name, "prompt": "hello there", "echo": True, "max_tokens": 0}
    answer, projected = post(front, "/v1/completions", body)
    assert answer["usage"]["completion_tokens"] <= 1
    assert answer["choices"][0]["text"].startswith("hello there")
    assert projected == 1


@pytest.mark.vllm
@pytest.mark.parametrize(
    "fields",
    [{}, {"max_tokens": None, "max_completion_tokens": None}],
    ids=["absent", "null"],
)
def test_chat_without_max_tokens_gets_the_rest_of_the_context(
    vllm: VllmInfo, front: SidecarProcess, fields: dict[str, Any]
) -> None:
    messages = long_messages(vllm.url, vllm.served_name, vllm.max_model_len)
    body = {"model": vllm.served_name, "messages": messages, "ignore_eos": True, **fields}
    answer, projected = post(front, "/v1/chat/completions", body)
    usage = answer["usage"]
    assert usage["completion_tokens"] == projected
    if EXTERNAL is None:  # the harness's model has no generation config default
        assert usage["completion_tokens"] == vllm.max_model_len - usage["prompt_tokens"]


@pytest.mark.vllm
def test_chat_prefers_max_completion_tokens(vllm: VllmInfo, front: SidecarProcess) -> None:
    body = {
        "model": vllm.served_name,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "max_completion_tokens": 9,
        "ignore_eos": True,
    }
    answer, projected = post(front, "/v1/chat/completions", body)
    assert answer["usage"]["completion_tokens"] == projected == 9


@pytest.mark.vllm
def test_responses_without_max_output_tokens_gets_the_rest_of_the_context(
    vllm: VllmInfo, front: SidecarProcess
) -> None:
    messages = long_messages(vllm.url, vllm.served_name, vllm.max_model_len)
    body = {"model": vllm.served_name, "input": messages[0]["content"], "ignore_eos": True}
    answer, projected = post(front, "/v1/responses", body)
    assert answer["max_output_tokens"] == projected  # what vLLM's sampling params held
    if EXTERNAL is None:
        assert projected == vllm.max_model_len - answer["usage"]["input_tokens"]


def _output_tokens(path: str, answer: bytes, stream: bool) -> int:
    """The answer's length as vLLM counted it: ``usage.output_tokens`` of the body, or of the
    stream's last event that carries a usage (``response.completed``, ``message_delta``)."""
    if not stream:
        return int(json.loads(answer)["usage"]["output_tokens"])
    counts = []
    for line in answer.splitlines():
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            usage = event.get("usage") or (event.get("response") or {}).get("usage")
            if usage and usage.get("output_tokens") is not None:
                counts.append(int(usage["output_tokens"]))
    assert counts, f"no usage in the {path} stream: {answer[-500:]!r}"
    return counts[-1]


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_the_answers_length_is_counted_on_responses_and_messages(
    vllm: VllmInfo, front: SidecarProcess, path: str, stream: bool
) -> None:
    """The Responses and Anthropic Messages endpoints name the answer's length
    ``usage.output_tokens``; the sidecar counted it (``kv_sidecar_completion_tokens_total``, and
    the length its learner takes) only where it is ``completion_tokens`` until now."""
    body: dict[str, Any] = {"model": vllm.served_name, "stream": stream, "temperature": 0}
    if path == "/v1/responses":
        body |= {"input": "Count the birds in the garden.", "max_output_tokens": 12}
    else:
        body |= {"messages": [{"role": "user", "content": "Count the birds."}], "max_tokens": 12}
    before = metric_value(front.metrics(), "kv_sidecar_completion_tokens_total") or 0.0
    resp = httpx.post(front.url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    tokens = _output_tokens(path, resp.content, stream)
    assert 1 <= tokens <= 12
    wait_for(lambda: front.state()["in_flight"] == 0, "the answer released", 30)
    after = metric_value(front.metrics(), "kv_sidecar_completion_tokens_total")
    assert after == before + tokens


# --- real vLLM: one extra server with a generation config default, then one with a cap ---------

#: generation_config.json's max_new_tokens for the "default" server; the "cap" server's override.
FILE_DEFAULT = 24
OVERRIDE_CAP = 20
#: The extra server's pool: small (the session's vLLM runs beside it on two cores).
EXTRA_BLOCKS = 16


@pytest.fixture(scope="module", params=["default", "cap"])
def generation_vllm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, VllmServer]]:
    """One extra vLLM at a time (pytest ends one param's server before it starts the next):
    ``default`` serves a copy of the model whose generation_config.json sets max_new_tokens;
    ``cap`` serves the model with ``--override-generation-config '{"max_new_tokens": N}'``."""
    if EXTERNAL:
        pytest.skip(
            "starts its own vLLM with a generation config (KV_SIDECAR_TEST_VLLM_URL is set: "
            "this run targets an external vLLM)"
        )
    kind = str(request.param)
    source = ensure_model()
    if kind == "default":
        model_dir = tmp_path_factory.mktemp("gen") / "tiny"
        shutil.copytree(source, model_dir)
        path = model_dir / "generation_config.json"
        generation = json.loads(path.read_text())
        assert "max_new_tokens" not in generation  # the harness's model has none
        path.write_text(json.dumps({**generation, "max_new_tokens": FILE_DEFAULT}))
        server = VllmServer(num_gpu_blocks=EXTRA_BLOCKS, model_dir=model_dir)
    else:
        override = json.dumps({"max_new_tokens": OVERRIDE_CAP})
        server = VllmServer(
            num_gpu_blocks=EXTRA_BLOCKS, extra_args=["--override-generation-config", override]
        )
    server.start()
    try:
        yield kind, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def generation_front(
    generation_vllm: tuple[str, VllmServer],
) -> Iterator[tuple[str, VllmServer, SidecarProcess]]:
    kind, server = generation_vllm
    # the "default" sidecar reads the model directory (vLLM's /v1/models root); the cap is
    # vLLM's command line, which only the operator can pass on
    args = ["--max-tokens-cap", str(OVERRIDE_CAP)] if kind == "cap" else []
    with SidecarProcess(server.url, *args) as sidecar:
        yield kind, server, sidecar


@pytest.mark.vllm
def test_generation_config_default_and_cap(
    generation_front: tuple[str, VllmServer, SidecarProcess],
) -> None:
    kind, server, sidecar = generation_front
    model = server.served_name
    chat = [{"role": "user", "content": "hello there"}]
    cases: list[tuple[str, dict[str, Any], int]]  # path, body, what vLLM generates
    if kind == "default":
        cases = [
            ("/v1/chat/completions", {"messages": chat}, FILE_DEFAULT),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": None}, FILE_DEFAULT),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": 50}, 50),  # no cap
            ("/v1/chat/completions", {"messages": chat, "max_completion_tokens": 3}, 3),
            ("/v1/completions", {"prompt": "hello there"}, 16),  # the file does not apply
            ("/v1/completions", {"prompt": "hello there", "max_tokens": 40}, 40),
        ]
        assert f"get {FILE_DEFAULT} (max_new_tokens in" in sidecar.log()
    else:
        cases = [
            ("/v1/chat/completions", {"messages": chat}, OVERRIDE_CAP),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": 50}, OVERRIDE_CAP),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": 5}, 5),
            ("/v1/completions", {"prompt": "hello there"}, 16),
            ("/v1/completions", {"prompt": "hello there", "max_tokens": 100}, OVERRIDE_CAP),
        ]
        assert f"every request capped at {OVERRIDE_CAP}" in sidecar.log()
    for path, fields, expected in cases:
        body = {"model": model, "ignore_eos": True, **fields}
        answer, projected = post(sidecar, path, body)
        assert (answer["usage"]["completion_tokens"], projected) == (expected, expected), (
            path,
            fields,
        )
    # Responses: vLLM's answer says which max_output_tokens it used
    answer, projected = post(
        sidecar, "/v1/responses", {"model": model, "input": "hello there", "ignore_eos": True}
    )
    expected = FILE_DEFAULT if kind == "default" else OVERRIDE_CAP
    assert answer["max_output_tokens"] == projected == expected
