"""The sidecar's settings: one pydantic-settings class for env vars and ``kv-sidecar serve`` flags.

Every field is a flag (``--max-queue-wait``) and an env var (``KV_SIDECAR_MAX_QUEUE_WAIT``);
flags win over env vars, env vars over defaults. Field docstrings are the ``--help`` text, with
one default and the env var (:func:`help_text`, :func:`cli_source`). An enum value is taken in
either spelling (``worst-case`` or ``worst_case``), and :func:`names_of` says which flag and env
var a field is, for error messages.

>>> Settings(_cli_parse_args=["--policy", "reject"]).policy
<Policy.reject: 'reject'>
>>> Settings(_cli_parse_args=cli_args(["--reservation", "worst_case"])).reservation
<ReservationMode.worst_case: 'worst-case'>
>>> names_of("model_config_path")
('--model-config', 'KV_SIDECAR_MODEL_CONFIG')
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Self

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict

ENV_PREFIX = "KV_SIDECAR_"


class _Choice(StrEnum):
    """An enum of settings that takes a value in either spelling, ``worst-case`` or
    ``worst_case``: the CLI's choices show one (the values) and its default the other (the
    member's name), and env vars and config files may carry either."""

    @classmethod
    def _missing_(cls, value: object) -> Self | None:
        if isinstance(value, str):
            spelled = value.replace("_", "-")
            for member in cls:
                if member.value.replace("_", "-") == spelled:
                    return member
        return None


class Policy(_Choice):
    """What happens to a request that does not fit now."""

    # lower case, as the CLI shows the names (kebab-cased): --policy {reject,queue,observe}
    reject = "reject"  # 429 at once
    queue = "queue"  # wait for room, up to --max-queue-wait
    observe = "observe"  # forward anyway and measure: a dry run
    spill = "spill"  # queue a short expected wait, 429 at once on a longer one (behind a gateway)


class PriorityRule(NamedTuple):
    """One of ``--priority-rules``: requests whose ``kind`` (model, tenant, or key: a prefix of
    the API key's digest) matches ``pattern`` (a glob for model and tenant) get ``priority``."""

    kind: Literal["model", "tenant", "key"]
    pattern: str
    priority: int


_RULE_KINDS = ("model", "tenant", "key")


def parse_priority_rules(text: str | None) -> tuple[PriorityRule, ...]:
    """``--priority-rules``: comma-separated ``KIND:PATTERN=PRIORITY``, the first match wins.

    >>> parse_priority_rules("model:batch-*=10, key:3fa9c1d2=-1")
    (PriorityRule(kind='model', pattern='batch-*', priority=10), \
PriorityRule(kind='key', pattern='3fa9c1d2', priority=-1))
    >>> parse_priority_rules("model=10")
    Traceback (most recent call last):
    ...
    ValueError: priority rule 'model=10' is not KIND:PATTERN=PRIORITY (KIND: model, tenant, key)
    """
    rules = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        head, eq, number = item.rpartition("=")
        kind, colon, pattern = head.partition(":")
        kind, pattern = kind.strip().lower(), pattern.strip()
        if not (eq and colon and pattern and kind in _RULE_KINDS):
            raise ValueError(
                f"priority rule {item!r} is not KIND:PATTERN=PRIORITY (KIND: model, tenant, key)"
            )
        try:
            priority = int(number.strip())
        except ValueError:
            said = f"priority rule {item!r}: {number.strip()!r} is not an integer"
            raise ValueError(said) from None
        if kind == "key" and not (
            len(pattern) >= 8 and all(c in "0123456789abcdef" for c in pattern.lower())
        ):
            raise ValueError(
                f"priority rule {item!r}: a key is 8-16 hex digits of the API key's SHA-256 "
                "(printf %s KEY | sha256sum), never the key itself"
            )
        rules.append(PriorityRule(kind, pattern.lower() if kind == "key" else pattern, priority))  # type: ignore[arg-type]
    return tuple(rules)


def parse_tenant_shares(text: str | None) -> dict[str, float]:
    """``--tenant-shares``: comma-separated ``TENANT=SHARE`` (a positive number).

    >>> parse_tenant_shares("chat=3, etl=0.5")
    {'chat': 3.0, 'etl': 0.5}
    """
    shares: dict[str, float] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        tenant, eq, number = item.rpartition("=")
        try:
            share = float(number)
        except ValueError:
            share = float("nan")
        if not (eq and tenant.strip()) or not 0 < share < float("inf"):
            raise ValueError(f"tenant share {item!r} is not TENANT=SHARE with a positive SHARE")
        shares[tenant.strip()] = share
    return shares


class ReservationMode(_Choice):
    """How many output tokens a request is promised."""

    worst_case = "worst-case"  # max_tokens: no preemption possible
    expected = "expected"  # a learned length per request class
    adaptive = "adaptive"  # a length quantile chosen by what a preemption would cost


class StalePolicy(_Choice):
    """What the gate does when vLLM's metrics are stale."""

    open = "open"  # admit on the ledger alone
    closed = "closed"  # refuse with 503


class LogFormat(_Choice):
    """How log lines read."""

    text = "text"  # time level logger: message key=value ...
    json = "json"  # one JSON object per line


class StreamUsage(_Choice):
    """What the sidecar asks vLLM for on a stream whose client sent no stream_options."""

    auto = "auto"  # every-event in worst-case mode, else final
    every_event = "every-event"  # the usage on every event: progress exact, per-event cost
    final = "final"  # the usage-only event at the end: the answer's length exact
    off = "off"  # nothing: counted one event a token


class AccessLog(_Choice):
    """Which requests get an access log line."""

    off = "off"  # none
    generation = "generation"  # generation requests only (one summary line each)
    all = "all"  # generation requests and pass-through ones


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        cli_prog_name="kv-sidecar serve",
        cli_kebab_case="all",  # enum names too: --reservation {worst-case,expected}
        cli_implicit_flags=True,
        use_attribute_docstrings=True,
        extra="ignore",
        frozen=True,
    )

    upstream: str = "http://127.0.0.1:8000"
    """Base URL of the vLLM OpenAI server (usually localhost in the same pod)."""
    host: str = "0.0.0.0"
    """Address the proxy, metrics and agent ports bind to."""
    port: int = Field(default=8080, ge=0, le=65535)
    """Proxy port: clients talk to this instead of vLLM."""
    metrics_port: int = Field(default=9091, ge=0, le=65535)
    """Port of the sidecar's own /metrics, /healthz and /readyz."""
    agent_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the HAProxy agent-check server: it answers each check with a weight from the KV
    headroom the trajectories project, and ``drain`` while the sidecar shuts down
    (deploy/gateway/haproxy.cfg). Unset: no agent."""
    admin: bool = False
    """Serve the admin API on the metrics port: GET, PATCH and PUT /admin/settings read and
    change the runtime settings (--headroom, --max-queue-depth, --max-queue-wait, --spill-wait,
    --policy) while the sidecar serves (README: Changing settings at runtime). Off: 403."""
    docs: bool = False
    """Serve the API pages: Swagger UI at /docs and the OpenAPI document at /openapi.json on the
    metrics port, and vLLM's own /docs and /redoc through the proxy port. Swagger UI loads its
    scripts from a CDN, so the page is blank in a cluster without internet access. Off: 404 for
    these pages on both ports (vLLM's /openapi.json still passes through)."""
    admin_token: SecretStr | None = None
    """With --admin, the bearer token every admin request must carry (Authorization: Bearer
    TOKEN); set it by env var rather than flag, which other processes can read. Unset: none."""

    model_config_path: Path | None = Field(
        default=None,
        # pydantic reserves `model_config`; the alias keeps the contract's flag and env var.
        validation_alias=AliasChoices("model_config", "KV_SIDECAR_MODEL_CONFIG"),
    )
    """Model directory or config.json for exact KV geometry (default: discover from vLLM)."""
    tokenizer: Path | None = None
    """Local tokenizer directory (default: the model directory, else vLLM's /tokenize)."""
    served_model_name: str | None = None
    """Model name clients send (default: the first model vLLM lists)."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Context length (default: vLLM's /v1/models)."""
    default_max_tokens: int | None = Field(default=None, ge=0)
    """vLLM's default max_tokens for chat and Responses requests that name none: its generation
    config's max_new_tokens (default: read from the model directory's generation_config.json
    when readable, else none: the rest of the context; 0: none, whatever the file says, as with
    vLLM's --generation-config vllm)."""
    max_tokens_cap: int | None = Field(default=None, gt=0)
    """vLLM's cap on every request's max_tokens, even one that names its own: the max_new_tokens
    of --override-generation-config, or of the generation config vLLM reads from a
    --generation-config directory (default: no cap)."""

    policy: Policy = Policy.queue
    """A request that does not fit now: refuse with 429 (reject), wait (queue), or forward it
    anyway and only measure (observe: a dry run that changes no traffic)."""
    max_queue_wait: float = Field(default=300.0, ge=0)
    """Seconds a request may wait in the queue before it gets 429 queue_timeout; 300 is half the
    600 s that the openai client and the shipped gateways wait for an answer, so that a refusal
    comes before they give up and an admitted request still has time to run."""
    spill_wait: float = Field(default=2.0, ge=0)
    """--policy spill: a request whose expected wait here (from the trajectories) is longer than
    this many seconds is refused at once with 429 (or --spill-status) spilled and Retry-After,
    so that a gateway that retries another replica finds one with room; a shorter wait is
    queued (up to
    --max-queue-wait). A request queued so is judged again each time the queue is tried: once
    its expected wait is over half again this, it is handed back with the same refusal, unless
    it is the next to be admitted (README: How admission decides)."""
    spill_status: int = 429
    """--policy spill: the HTTP status of a spilled refusal, 429 or 503, with the same
    OpenAI-shaped body (code spilled) and Retry-After either way. 503 for a gateway that
    retries a 503 on another replica but cannot retry a 429 (HAProxy 2.6's retry-on,
    deploy/gateway/haproxy.cfg); the sidecar refuses before vLLM sees the request, so a retry
    repeats no work."""
    max_queue_depth: int = Field(default=256, ge=0)
    """Requests the queue holds; beyond it new ones get 429 queue_full, or, when the newcomer's
    priority is better than a queued request's, that request gets 429 displaced in its place."""
    priority_rules: str | None = None
    """Priorities for requests that carry none (no priority body field, no
    x-kv-sidecar-priority header): comma-separated KIND:PATTERN=PRIORITY, the first match wins;
    KIND is model (a glob over the model name, LoRA adapters included), tenant (a glob) or key
    (a prefix of the hex SHA-256 of the API key: printf %s KEY | sha256sum). Lower is served
    first. Unset: priority 0."""
    priority_reserve: float = Field(default=0.1, ge=0, lt=1)
    """Share of the KV budget kept for requests of priority 0 (vLLM's default) and better: a
    request of a positive priority (a batch class) may not take the last of it while others run,
    so that an interactive request finds room at once beside a batch burst instead of waiting
    for a batch answer to end (the sidecar never stops a running request). Room those requests
    hold themselves counts against it; into a pool with nothing else in flight any request may
    go. It changes nothing while no request has a positive priority. 0: no reserve."""
    priority_pace: float = Field(default=0.0, ge=0)
    """Seconds of prefill a request of a positive priority (a batch class) may find ahead of it
    in vLLM's own first-come queue: such a request is forwarded only while the prompts already
    sent (every priority, each at what a prompt's prefill was measured to hold the engine for)
    would be prefilled within this, and while no streamed request of priority 0 or better sent
    to the same engine awaits its first token, so that a burst of them enters vLLM about as fast
    as vLLM prefills it and a request of priority 0 finds at most this much prefill ahead of it.
    Under --policy queue and spill (the paced request waits in the sidecar's queue); nothing is
    paced while no request has a positive priority. 0 (the default): not paced. On the
    simulated 8B engine, beside a batch burst, 0.02 s held the interactive class's TTFT p99 to
    0.089 s against 0.039 s alone, at 0.98x the batch's goodput unclassed (BENCHMARKS.md, The
    pace held to the interactive class's first tokens); an earlier pace raised it on the real
    vLLM CPU build (Priority classes): off until it is measured on a GPU."""
    tenant_shares: str | None = None
    """Inside a priority, tenants (the x-kv-sidecar-tenant header, else the API key's digest)
    share the KV cache by weight: comma-separated TENANT=SHARE. Unset: every tenant 1."""
    tenant_max_share: float = Field(default=1.0, gt=0, le=1)
    """Share of the KV budget one tenant's reservations may hold; past it its requests wait (or
    get 429 tenant_share under --policy reject) while others go ahead."""
    tenant_max_queue: int | None = Field(default=None, ge=0)
    """Requests one tenant may have queued; beyond it its new ones get 429 tenant_queue_full.
    Unset: only --max-queue-depth."""
    forward_priority: bool = False
    """Write the priority the sidecar gave a request (from its header or --priority-rules) into
    the body sent to vLLM, so that the scheduler of a vLLM started with --scheduling-policy
    priority orders (and preempts) as the sidecar's queue does. vLLM's API docs say another
    vLLM refuses a priority other than 0; vLLM 0.32's code does not check it (its FCFS queue
    ignores the field). A priority the body carries is always forwarded as sent."""
    stream_usage: StreamUsage = StreamUsage.auto
    """For a streamed completion or chat of one sequence whose client sent no stream_options,
    ask vLLM for its usage count and take it back out of what the client receives: every-event
    (continuous_usage_stats: progress exact even where vLLM merges a lagging stream's tokens into
    one event or batches them by stream_interval; it costs vLLM's API server and the relay CPU
    on every event), final (the usage-only event at the end: each answer's length exact, at one
    event a stream), or off. auto: every-event in worst-case mode, whose promise rests on exact
    progress, else final. Under every-event, a client that asked for include_usage alone is
    asked for every event's count too. Set off in front of a vLLM started with
    --enable-force-include-usage, whose clients expect the usage on every stream."""
    max_concurrent_counts: int | None = Field(default=None, gt=0)
    """Long prompts (over 2,000 characters) tokenized at once, each on a worker thread (default:
    the CPUs the sidecar may use, less one left to the event loop; from 1 to 4)."""
    max_count_wait: float = Field(default=10.0, ge=0)
    """Seconds a long prompt may wait for a counting slot; one expected to wait longer is refused
    at once with 429 counting_busy and a Retry-After (docs/counting-load.md)."""
    headroom: float = Field(default=0.05, ge=0, lt=1)
    """Share of KV blocks never promised to requests."""
    reservation: ReservationMode = ReservationMode.adaptive
    """adaptive: each request reserved to the quantile of its class's answer lengths at which
    the recompute a preemption would cost on this engine is at most what running it in the
    batch saves, and at least --risk-steps decode steps
    (lengths from vLLM's own history at the first scrape, 256 output tokens where nothing is
    known and a recompute is cheap); worst-case: every request may run to max_tokens (no
    preemption, ever); expected: a learned length per request class (endpoint and max_tokens
    bucket, or the x-kv-sidecar-class header) at --expected-quantile."""
    risk_steps: float = Field(default=1.0, gt=0)
    """adaptive mode: decode steps of recompute a request may risk at least, as the chance that
    its answer runs past its reservation times what its recompute would cost; more where
    running it in the batch saves more (README: How admission decides)."""
    ttft_target: float | None = Field(default=None, gt=0)
    """Seconds a request may expect to wait here for its first token (its queue wait, from the
    trajectories and the learned decode step, plus its prefill by the learned cost per prompt
    token): one that does not fit now and is expected to wait longer is refused at once with 429
    ttft_target and a Retry-After instead of queueing past its objective. Queued while the step
    time is not known yet. Unset: no target."""
    tpot_target: float | None = Field(default=None, gt=0)
    """Seconds a decode step may take: a request whose sequences would make vLLM's step slower
    than this (by the step time learned against the batch) waits, or is refused with 429
    latency_target under --policy reject. Unset: no target."""
    expected_quantile: float = Field(default=0.95, gt=0, lt=1)
    """Quantile of a request class's answer lengths reserved in expected mode."""
    expected_prior: float = Field(default=1.0, gt=0, le=1)
    """Share of max_tokens reserved in expected mode while a class has too few answers."""
    lengths_file: Path | None = None
    """JSON file the learned answer lengths are kept in across restarts (put it on a volume that
    outlives the container, e.g. an emptyDir): read at discovery when it is for the served
    model, written every 30 s and at shutdown. Unset: a restart forgets them."""
    scrape_interval: float = Field(default=0.5, gt=0)
    """Seconds between scrapes of vLLM's /metrics."""
    metrics_stale_after: float = Field(default=5.0, gt=0)
    """Seconds after which vLLM's metrics count as stale."""
    stale_policy: StalePolicy = StalePolicy.open
    """On stale vLLM metrics, admit on the ledger alone (open) or refuse with 503 (closed)."""

    upstream_connect_timeout: float = Field(default=30.0, gt=0)
    """Seconds to connect to vLLM (or wait for a pooled connection)."""
    upstream_read_timeout: float = Field(default=600.0, gt=0)
    """Seconds to wait for each chunk of vLLM's answer."""
    upstream_max_connections: int = Field(default=1024, gt=0)
    """Pooled connections to vLLM."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    """Largest generation request body accepted (413 above it)."""
    max_header_bytes: int = Field(default=60 * 1024, gt=0)
    """Largest total size of a request's headers (431 above it; Envoy's default)."""
    max_headers: int = Field(default=100, gt=0)
    """Most headers on one request (431 above it; Envoy's default)."""
    upstream_api_key: SecretStr | None = None
    """vLLM's --api-key, for the sidecar's own calls (discovery, /tokenize); never lent out.
    Unset: none."""
    drain_timeout: float = Field(default=30.0, ge=0)
    """Seconds in-flight requests get to finish after SIGTERM."""
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """Relay worker processes serving the proxy port: auto (the container's cgroup CPU quota
    rounded up, capped by its CPU affinity; one process where no quota is set), 1 (one process),
    or N. With more than one, this process keeps admission, the scraper and the metrics port,
    and the workers ask it before they forward a generation request (docs/relay-workers.md)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level."""
    log_format: LogFormat = LogFormat.text
    """text (time, level, logger, message, then key=value fields) or json (one object per
    line), for the sidecar's and uvicorn's lines alike."""
    access_log: AccessLog = AccessLog.generation
    """One line per request, at level info: for generation requests only (their decision,
    prompt tokens, projected blocks, queue wait, status and duration), for all requests
    (pass-through ones too), or off."""

    @field_validator("priority_rules")
    @classmethod
    def _rules(cls, value: str | None) -> str | None:
        parse_priority_rules(value)
        return value

    @field_validator("tenant_shares")
    @classmethod
    def _shares(cls, value: str | None) -> str | None:
        parse_tenant_shares(value)
        return value

    @field_validator("spill_status")
    @classmethod
    def _spill_status(cls, value: int) -> int:
        if value not in (429, 503):
            raise ValueError("spill_status must be 429 or 503")
        return value

    @field_validator("upstream")
    @classmethod
    def _upstream_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("upstream must be an http:// or https:// URL")
        # Joined with paths that start with '/': keep the base without a trailing slash.
        return value.rstrip("/")


def names_of(field: str) -> tuple[str, str]:
    """The flag and the env var of a settings field (or of its alias), as a user types them.

    >>> names_of("max_queue_wait")
    ('--max-queue-wait', 'KV_SIDECAR_MAX_QUEUE_WAIT')
    """
    name = field.removeprefix(ENV_PREFIX).lower()
    for field_name, info in Settings.model_fields.items():
        alias = info.validation_alias
        choices = (
            [c for c in alias.choices if isinstance(c, str)]
            if isinstance(alias, AliasChoices)
            else []
        )
        if name == field_name or name in (c.lower() for c in choices):
            name = choices[0] if choices else field_name
            break
    return "--" + name.replace("_", "-"), ENV_PREFIX + name.upper()


def cli_args(argv: Sequence[str]) -> list[str]:
    """``argv`` with every enum value in the spelling the CLI parser takes: the choices are the
    values (``worst-case``), a member's name (``worst_case``) is what Python code and older
    documents spell, and pydantic-settings refuses the name with a bare exception.

    >>> cli_args(["--reservation", "worst_case", "--policy=queue", "--port", "8_080"])
    ['--reservation', 'worst-case', '--policy=queue', '--port', '8_080']
    """
    choices: dict[str, type[Enum]] = {}
    for field_name, info in Settings.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, Enum):
            choices[names_of(field_name)[0]] = info.annotation
    out = list(argv)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if eq and flag in choices:
            out[i] = f"{flag}={_spelled(choices[flag], value)}"
        elif i > 0 and out[i - 1] in choices:
            out[i] = _spelled(choices[out[i - 1]], arg)
    return out


def _spelled(enum: type[Enum], value: str) -> str:
    try:
        return str(enum(value).value)
    except ValueError:
        return value  # not one of them: validation says so, naming the flag


#: the metavar of a flag's value by its type, where its choices do not stand for it
_METAVARS: dict[object, str] = {
    int: "N",
    float: "NUMBER",
    str: "TEXT",
    Path: "PATH",
    SecretStr: "SECRET",
}
_FIELD_METAVARS = {"upstream": "URL", "host": "ADDRESS", "served_model_name": "NAME"}


def help_text(field: str) -> str:
    """``--help``'s text of a settings field: its docstring, one default, and its env var.

    A field whose default is None says in its docstring what happens unset (``(default: ...)``
    or ``Unset: ...``); any other gets ``(default: VALUE)`` in the spelling a flag takes.

    >>> help_text("headroom")
    'Share of KV blocks never promised to requests. (default: 0.05) [env: KV_SIDECAR_HEADROOM]'
    """
    info = Settings.model_fields[field]
    text = " ".join((info.description or "").replace("``", "").split())
    default = info.default
    if default is not None:
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif isinstance(default, Enum):
            shown = str(default.value)
        elif isinstance(default, float):
            shown = f"{default:g}"
        else:
            shown = str(default)
        text += f" (default: {shown})"
    return f"{text} [env: {names_of(field)[1]}]"


def _metavar(field: str, metavar: str | None) -> str | None:
    if metavar is None or (metavar.startswith("{") and "null" not in metavar):
        return metavar.replace("int", "N") if metavar else metavar  # choices: {N,auto}
    if field in _FIELD_METAVARS:
        return _FIELD_METAVARS[field]
    annotation = Settings.model_fields[field].annotation
    for kind in getattr(annotation, "__args__", None) or (annotation,):
        if kind in _METAVARS:
            return _METAVARS[kind]
    return metavar


def _add_argument(parser: Any, *names: str, **kwargs: Any) -> Any:
    """pydantic-settings' ``add_argument``, each flag under its one spelling (no
    ``--kv-sidecar-model-config`` from an alias), with :func:`help_text` and a plain metavar."""
    flags = {names_of(f)[0]: f for f in Settings.model_fields}
    field = next((flags[name] for name in names if name in flags), None)
    if field is None:
        return parser.add_argument(*names, **kwargs)
    names = tuple(n for n in names if n == names_of(field)[0] or n.startswith("--no-"))
    kwargs["help"] = help_text(field).replace("%", "%%")
    if "metavar" in kwargs:
        kwargs["metavar"] = _metavar(field, kwargs["metavar"])
    return parser.add_argument(*names, **kwargs)


def cli_source() -> CliSettingsSource[Settings]:
    """The ``kv-sidecar serve`` parser: the flags of :class:`Settings` with :func:`help_text`;
    argparse's refusals raised (one line), not printed with a usage."""
    return CliSettingsSource(Settings, cli_exit_on_error=False, add_argument_method=_add_argument)
