"""Which class a request belongs to, and why.

First match wins:

| # | source          | rule                                                                  |
|---|-----------------|-----------------------------------------------------------------------|
| 1 | explicit        | the class the client named (`x-tokenfleet-class` header or            |
|   |                 | `metadata.tokenfleet_class`; the gateway puts it in the profile)       |
| 2 | task_type       | `x-tokenfleet-task-type` through the task map (fleet file, then the   |
|   |                 | built-in names below; a task type that *is* a class name maps to it)   |
| 3 | length          | prompt >= long_context_min_tokens → long_context                      |
| 4 | output_budget   | max_tokens >= long_output_tokens (when set) → long_context            |
| 5 | tenant_default  | the tenant's default class                                            |

Rules 3 and 4 only *promote an interactive default*: an interactive SLO cannot be met
by a 100k-token prefill, while a batch tenant's long prompt is still batch work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetcore.slo import BATCH, INTERACTIVE, LONG_CONTEXT
from fleetcore.types import RequestProfile

if TYPE_CHECKING:
    from slomax.config import SLOMaxConfig

# Common task-type names; the fleet file's `admission.task_classes` extends or overrides these.
BUILTIN_TASK_CLASSES: Mapping[str, str] = {
    "chat": INTERACTIVE, "agent": INTERACTIVE, "code": INTERACTIVE, "completion": INTERACTIVE,
    "document": LONG_CONTEXT, "rag": LONG_CONTEXT, "summarize": LONG_CONTEXT, "long_context": LONG_CONTEXT,
    "batch": BATCH, "offline": BATCH, "eval": BATCH,
}


class UnknownClass(ValueError):
    """The client named a class the fleet does not define."""


@dataclass(frozen=True, slots=True)
class Classification:
    request_class: str
    source: str  # explicit | task_type | length | output_budget | tenant_default


def classify(*, prompt_tokens: int, max_tokens: int | None, explicit: str | None, task_type: str | None,
             tenant_default: str, classes: Mapping[str, object], long_context_min_tokens: int,
             long_output_tokens: int | None = None,
             task_classes: Mapping[str, str] | None = None) -> Classification:
    """Apply the table above. Raises UnknownClass for an explicit class that is not defined."""
    if explicit is not None:
        if explicit not in classes:
            raise UnknownClass(f"unknown request class {explicit!r}; known: {', '.join(sorted(classes))}")
        return Classification(explicit, "explicit")
    if task_type:
        key = task_type.strip().lower()
        cls = (task_classes or {}).get(key) or BUILTIN_TASK_CLASSES.get(key)
        if cls is None and key in classes:
            cls = key
        if cls is not None and cls in classes:
            return Classification(cls, "task_type")
    return _by_default(prompt_tokens, max_tokens, tenant_default, classes, long_context_min_tokens,
                       long_output_tokens)


def _by_default(prompt_tokens: int, max_tokens: int | None, tenant_default: str, classes: Mapping[str, object],
                long_context_min_tokens: int, long_output_tokens: int | None) -> Classification:
    """Rules 3-5: no class named, no task type that maps to one."""
    default = tenant_default if tenant_default in classes else INTERACTIVE
    if default == INTERACTIVE and LONG_CONTEXT in classes:
        if prompt_tokens >= long_context_min_tokens:
            return Classification(LONG_CONTEXT, "length")
        if long_output_tokens is not None and max_tokens is not None and max_tokens >= long_output_tokens:
            return Classification(LONG_CONTEXT, "output_budget")
    return Classification(default, "tenant_default")


def classify_profile(profile: RequestProfile, config: SLOMaxConfig) -> Classification:
    """`classify` with everything taken from a request profile and the admission config.

    Raises UnknownClass when the profile names a class this fleet does not define."""
    if profile.request_class is None and not profile.task_type:  # the usual request: rules 3-5 at once
        return _by_default(profile.prompt_tokens, profile.max_tokens, config.default_class(profile.tenant),
                           config.classes, config.long_context_min_tokens, config.long_output_tokens)
    return classify(prompt_tokens=profile.prompt_tokens, max_tokens=profile.max_tokens,
                    explicit=profile.request_class, task_type=profile.task_type,
                    tenant_default=config.default_class(profile.tenant), classes=config.classes,
                    long_context_min_tokens=config.long_context_min_tokens,
                    long_output_tokens=config.long_output_tokens, task_classes=config.task_classes)
