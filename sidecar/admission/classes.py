"""A request's priority and tenant: who waits first when KV is short, and whose share it uses.

The priority (an integer, lower first, as vLLM orders its own ``priority`` field) is, in order:

1. the body's ``priority`` field, read as vLLM reads it (an integer; ``"3"`` and ``3.0`` are 3);
2. else the ``x-kv-sidecar-priority`` header (a decimal integer);
3. else the first of the operator's rules (``--priority-rules``) that matches the request's
   model (a LoRA adapter is a model name to vLLM), its tenant, or its API key's digest;
4. else 0.

The tenant is the ``x-kv-sidecar-tenant`` header, else ``key:`` and the first 16 hex digits of
the SHA-256 of the request's API key (``Authorization: Bearer ...`` or ``x-api-key``; the key
itself is never kept), else the empty tenant that every anonymous request shares.

A malformed value is a 400 (``invalid_priority``, ``invalid_tenant``): a silent default would
change who waits.

>>> rules = parse_priority_rules("model:batch-*=10,tenant:etl=20")
>>> classify({}, priority_header=None, tenant_header="etl", api_key=None, rules=rules)
(20, 'etl')
>>> classify({"model": "batch-7b", "priority": "-1"}, priority_header="5", tenant_header=None,
...          api_key="sk-abc", rules=rules)
(-1, 'key:1460db1b6902f8b1')
>>> classify({"model": "batch-7b"}, priority_header=None, tenant_header=None, api_key=None,
...          rules=rules)
(10, '')
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

from pydantic import TypeAdapter, ValidationError

from sidecar.config import PriorityRule, parse_priority_rules
from sidecar.errors import BadRequest

__all__ = [
    "PRIORITY_HEADER",
    "TENANT_HEADER",
    "api_key_of",
    "classify",
    "key_digest",
    "parse_priority_rules",
]

PRIORITY_HEADER = b"x-kv-sidecar-priority"
TENANT_HEADER = b"x-kv-sidecar-tenant"
#: a tenant as a header names it: a letter or digit, then up to 63 of these
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,63}")
_INT = TypeAdapter(int)
#: the priorities taken: vLLM's field is a Python int, the sidecar keeps it to 64 bits
_LIMIT = 2**63


def key_digest(api_key: str) -> str:
    """The tenant an API key stands for: ``key:`` and 16 hex digits of its SHA-256."""
    return "key:" + hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def api_key_of(authorization: str | None, x_api_key: str | None) -> str | None:
    """The API key a request carries (a bearer token, else Anthropic's ``x-api-key``)."""
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    if x_api_key and x_api_key.strip():
        return x_api_key.strip()
    return None


def _priority(value: Any, said: str) -> int:
    try:
        priority = _INT.validate_python(value)
    except ValidationError:
        priority = None
    if priority is None or isinstance(value, bool) or not -_LIMIT < priority < _LIMIT:
        raise BadRequest(
            f"{said} must be an integer (lower is served first), got {value!r}",
            param="priority",
            code="invalid_priority",
        )
    return priority


def _header_priority(text: str) -> int:
    stripped = text.strip()
    if not re.fullmatch(r"[+-]?[0-9]{1,19}", stripped):
        raise BadRequest(
            f"the {PRIORITY_HEADER.decode()} header must be a decimal integer, got {text!r}",
            code="invalid_priority",
        )
    return _priority(int(stripped), f"the {PRIORITY_HEADER.decode()} header")


def tenant_of(tenant_header: str | None, digest: str | None) -> str:
    """The request's tenant (module docstring; ``digest``: its API key's, :func:`key_digest`);
    a malformed header is a 400."""
    if tenant_header is not None:
        tenant = tenant_header.strip()
        if not _TENANT.fullmatch(tenant):
            raise BadRequest(
                f"the {TENANT_HEADER.decode()} header must be 1-64 characters of letters, "
                f"digits and ._:@/+=- (starting with a letter or digit), got {tenant_header!r}",
                code="invalid_tenant",
            )
        return tenant
    return digest if digest is not None else ""


def _ruled(
    rules: Sequence[PriorityRule], model: object, tenant: str, digest: str | None
) -> int | None:
    for rule in rules:
        if rule.kind == "model":
            if isinstance(model, str) and fnmatchcase(model, rule.pattern):
                return rule.priority
        elif rule.kind == "tenant":
            if fnmatchcase(tenant, rule.pattern):
                return rule.priority
        elif digest is not None and digest[4:].startswith(rule.pattern):
            return rule.priority  # "key": a prefix of the key's digest
    return None


def classify(
    body: Mapping[str, Any],
    *,
    priority_header: str | None,
    tenant_header: str | None,
    api_key: str | None,
    rules: Sequence[PriorityRule] = (),
) -> tuple[int, str]:
    """The request's priority and tenant (module docstring); a malformed value is a 400."""
    digest = key_digest(api_key) if api_key is not None else None  # once per request
    tenant = tenant_of(tenant_header, digest)
    if "priority" in body:
        return _priority(body["priority"], "priority"), tenant
    if priority_header is not None:
        return _header_priority(priority_header), tenant
    ruled = _ruled(rules, body.get("model"), tenant, digest)
    return (ruled if ruled is not None else 0), tenant
