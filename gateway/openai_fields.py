"""Which OpenAI request fields the gateway serves, and a 400 for those it cannot.

The gateway forwards unknown fields untouched (engines take extras such as `ignore_eos`,
`top_k`, `min_tokens`), so the danger is an OpenAI field that *looks* accepted but would
be silently dropped somewhere: a client asking for audio output or stored completions
would get plain text and no error. Those are listed here and refused, naming the field.

Fields an engine may or may not implement (`echo`, `suffix`, `logit_bias`, tools...) are
left to the engine: vLLM serves them, and an engine that cannot answers its own 400,
which the relay passes through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import bad_request

MAX_N = 128  # OpenAI's limit

# The fields of a disaggregated (P/D) leg: which prefill engine a decode engine pulls its KV from
# (SGLang's bootstrap host / port / room, vLLM's `kv_transfer_params`: remote host, port, block
# ids). The gateway sets them on its own legs (`gateway.pd_flow`); from a client they would make
# an engine connect to a host of the client's choosing or read another request's KV, so a body
# that carries one is refused (fail closed), never forwarded.
PD_LEG_FIELDS = frozenset({"bootstrap_host", "bootstrap_port", "bootstrap_room", "kv_transfer_params"})
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI chat: top_logprobs 0..20
MAX_COMPLETION_LOGPROBS = 5  # OpenAI completions: logprobs 0..5


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_unsupported(body: Mapping[str, Any], kind: str) -> None:
    """400 naming the first field the gateway cannot honour (see the module docstring)."""
    if not PD_LEG_FIELDS.isdisjoint(body):
        name = min(PD_LEG_FIELDS.intersection(body))
        raise bad_request(f"`{name}` is set by the gateway on its prefill/decode legs, never by a client.",
                          name, code="unsupported_parameter")
    if body.get("store") is True:
        raise bad_request("The gateway is stateless: `store: true` (stored completions) is not supported.",
                          "store", code="unsupported_parameter")
    if kind == "chat":
        for name in ("audio", "prediction", "web_search_options"):
            if body.get(name) is not None:
                raise bad_request(f"`{name}` is not supported by this gateway.", name,
                                  code="unsupported_parameter")
        modalities = body.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise bad_request("Only `modalities: [\"text\"]` is supported.", "modalities",
                              code="unsupported_parameter")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != (body.get("n") or 1)):
        # vLLM V1 and SGLang dropped best_of; an engine ignoring it would bill n choices as one.
        raise bad_request("`best_of` other than `n` is not supported.", "best_of", code="unsupported_parameter")


def choice_count(body: Mapping[str, Any]) -> int:
    """`n`, validated: a positive integer up to MAX_N (default 1)."""
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad_request(f"`n` must be an integer between 1 and {MAX_N}; got {n!r}.", "n")
    return n


def check_logprobs(body: Mapping[str, Any], kind: str) -> None:
    """Chat: `logprobs` bool, `top_logprobs` 0..20 and only with logprobs; completions: `logprobs` 0..5."""
    lp = body.get("logprobs")
    if kind == "chat":
        if lp is not None and not isinstance(lp, bool):
            raise bad_request(f"`logprobs` must be a boolean; got {lp!r}.", "logprobs")
        top = body.get("top_logprobs")
        if top is None:
            return
        if not _is_int(top) or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise bad_request(f"`top_logprobs` must be an integer between 0 and {MAX_CHAT_TOP_LOGPROBS}; "
                              f"got {top!r}.", "top_logprobs")
        if lp is not True:
            raise bad_request("`top_logprobs` requires `logprobs: true`.", "top_logprobs")
        return
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_COMPLETION_LOGPROBS):
        raise bad_request(f"`logprobs` must be an integer between 0 and {MAX_COMPLETION_LOGPROBS}; got {lp!r}.",
                          "logprobs")
