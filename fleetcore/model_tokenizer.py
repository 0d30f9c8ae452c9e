"""A real model's tokenizer for the gateway: the token ids a vLLM/SGLang engine will see.

Exact cache mode needs the gateway's request block hashes to equal the keys the
engine's KV events put in the index (see `engine_adapters.kv_translate`), so the
gateway must tokenize a prompt exactly as the engine does:

- completions: the prompt text with the tokenizer's special tokens (BOS) added;
- chat: the model's chat template rendered with `add_generation_prompt=True`
  in a Jinja environment configured like transformers' `apply_chat_template`,
  then tokenized *without* adding special tokens (the template writes them).
  Content-part lists are joined with newlines, as vLLM does for templates that
  take string content.

It reads a Hugging Face model directory with `tokenizers` and `jinja2` only
(`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` or
`chat_template.json`), never transformers or torch, and never the network.
When no tokenizer can be loaded the gateway falls back to `fleetcore.tokens`
and the approximate cache index.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from fleetcore.fleet_config import FleetConfig
from fleetcore.tokens import PromptTooLong

log = logging.getLogger("tokenfleet.tokenizer")


class PromptTokenizer(Protocol):
    def text_ids(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of a completion prompt, special tokens included. With `limit`, raises
        `fleetcore.tokens.PromptTooLong` instead of tokenizing a text that provably has more
        tokens than that (from its length alone)."""

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], limit: int | None = None) -> list[int]:
        """Token ids of a chat conversation as the engine renders it for a new assistant turn
        (`limit` as for `text_ids`)."""

    def min_tokens(self, chars: int) -> int:
        """A lower bound on the tokens of any text of `chars` characters (0: no bound known)."""


class TokenizerUnavailable(RuntimeError):
    """No usable tokenizer at the given place (missing files or packages)."""


def _token_text(v: Any) -> str | None:
    """Special tokens appear as plain strings or as AddedToken dicts."""
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tmpl = config.get("chat_template") or _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(tmpl, list):  # named templates: the "default" one is what engines use
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, Mapping)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl if isinstance(tmpl, str) else None


def _content_text(content: Any) -> Any:
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content
                         if isinstance(p, Mapping) and p.get("type") == "text")
    return content


class HFTokenizer:
    """`tokenizer.json` + chat template of a Hugging Face model directory."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerUnavailable("the `tokenizers` package is not installed") from None
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerUnavailable(f"{tok_file} does not exist")
        self.directory = directory
        self._tok = Tokenizer.from_file(str(tok_file))
        config = _read_json(directory / "tokenizer_config.json")
        specials = _read_json(directory / "special_tokens_map.json")
        self.special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                     "mask_token"):
            text = _token_text(config.get(name)) or _token_text(specials.get(name))
            if text is not None:
                self.special_tokens[name] = text
        source = _chat_template(directory, config)
        self._template = _compile(source) if source else None
        self.max_chars_per_token = max_chars_per_token(json.loads(self._tok.to_str()))

    def min_tokens(self, chars: int) -> int:
        return 0 if self.max_chars_per_token is None else -(-chars // self.max_chars_per_token)

    def _check(self, text: str, limit: int | None) -> None:
        if limit is not None and (at_least := self.min_tokens(len(text))) > limit:
            raise PromptTooLong(at_least, exact=False)

    def _encode(self, text: str, special: bool, limit: int | None) -> list[int]:
        self._check(text, limit)
        # encode_batch releases the GIL while it works (encode does not: a long prompt
        # on a pool thread would still stall the event loop for seconds)
        enc = self._tok.encode_batch([text], add_special_tokens=special)[0]
        if limit is not None and len(enc) > limit:
            raise PromptTooLong(len(enc), exact=True)  # without building a list of every id
        return enc.ids

    def text_ids(self, text: str, limit: int | None = None) -> list[int]:
        return self._encode(text, True, limit)

    def plain_ids(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens: generated text a continuation appends."""
        return self._encode(text, False, None)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], limit: int | None = None) -> list[int]:
        if self._template is None:
            raise TokenizerUnavailable(f"{self.directory} has no chat template")
        conv = [{**m, "content": _content_text(m.get("content"))} for m in messages]
        text = self._template.render(messages=conv, add_generation_prompt=True, tools=None,
                                     documents=None, **self.special_tokens)
        # the bound holds for the rendered text (a template may drop or repeat content)
        return self._encode(text, False, limit)


# --- a lower bound on tokens from characters ---
#
# Each token of an encoding stands for a piece of the (normalized, pre-tokenized) text, and
# its vocabulary string is at least as long in UTF-8 bytes as the characters it covers: byte-
# level BPE writes one character per input byte, SentencePiece writes "▁" (3 bytes) for a
# space, byte-fallback tokens are "<0xNN>", an unknown character's <unk> stands for one
# character. So tokens >= chars / (longest vocabulary entry in bytes x the most a normalizer
# can shrink text). That holds only where nothing drops text: a pre-tokenizer that removes
# whitespace, a normalizer that strips or lowercases, fused <unk> runs, a BPE without byte
# fallback or <unk> (unknown characters vanish), a WordPiece/WordLevel <unk> for a whole word,
# or truncation. For those there is no bound (None) and the prompt is tokenized in full,
# in the gateway's bounded tokenizer pool.

# Normalizers that never shorten text by more than this factor (NFC composes at most
# three code points, Hangul L+V+T, into one).
_SHRINK = {"NFC": 3, "Prepend": 1}
_SAFE_PRE = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _normalizer_shrink(spec: Mapping[str, Any] | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        ok = isinstance(pattern, Mapping) and "String" in pattern and len(content) >= len(pattern["String"])
        return 1 if ok else None
    return _SHRINK.get(kind)  # type: ignore[arg-type]


def _pre_tokenizer_keeps_text(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_pre_tokenizer_keeps_text(p) for p in spec.get("pretokenizers", []))
    return spec.get("type") in _SAFE_PRE and spec.get("behavior") != "Removed"


def _has_byte_level(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def max_chars_per_token(spec: Mapping[str, Any]) -> int | None:
    """The most input characters one token can stand for under the `tokenizer.json` `spec`,
    or None when the tokenizer may drop text and no such bound exists (see above)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation"):
        return None
    if not (_has_byte_level(spec.get("pre_tokenizer")) or model.get("byte_fallback")
            or (model.get("unk_token") and not model.get("fuse_unk"))):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
        return None
    pieces = list(model.get("vocab") or {}) + [t.get("content", "") for t in spec.get("added_tokens") or []]
    longest = max((len(p.encode("utf-8", "surrogatepass")) for p in pieces), default=0)
    return max(1, longest) * shrink


def _compile(source: str) -> Any:
    """A Jinja environment like transformers' (trim/lstrip blocks, tojson, raise_exception)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TokenizerUnavailable("the `jinja2` package is not installed") from None

    class Generation(jinja2.ext.Extension):
        # `{% generation %}` marks assistant text for training masks; rendering ignores it.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def expand_path(value: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(value)))


@functools.lru_cache(maxsize=32)
def _load_cached(directory: str) -> HFTokenizer | None:
    try:
        return HFTokenizer(directory)
    except TokenizerUnavailable as e:
        log.warning("no tokenizer at %s (%s): the gateway estimates token ids and cache state", directory, e)
    except Exception as e:  # a corrupt file must not stop the gateway: fall back, loudly
        log.warning("cannot load the tokenizer at %s: %s: %s", directory, type(e).__name__, e)
    return None


def load_tokenizer(directory: str | Path) -> HFTokenizer | None:
    """The tokenizer in `directory`, loaded once per process; None when unusable (logged)."""
    return _load_cached(str(expand_path(str(directory)).resolve()))


def tokenizer_source(config: FleetConfig, model: str) -> Path | None:
    """Where the gateway finds `model`'s tokenizer: the model's `tokenizer`, else the local
    model directory (`options.tokenizer` or `options.model`) of one of its real-engine
    deployments. None: no tokenizer, the gateway estimates."""
    m = config.model(model)
    if m.tokenizer:
        return expand_path(m.tokenizer)
    for d in config.deployments:
        if d.model != model or d.adapter not in ("vllm", "sglang"):
            continue
        for key in ("tokenizer", "model"):
            value = d.options.get(key)
            if isinstance(value, str) and (expand_path(value) / "tokenizer.json").is_file():
                return expand_path(value)
    return None


def model_tokenizers(config: FleetConfig) -> dict[str, PromptTokenizer]:
    """Model name -> its tokenizer, for the models that have a loadable one."""
    out: dict[str, PromptTokenizer] = {}
    for m in config.models:
        src = tokenizer_source(config, m.name)
        tok = load_tokenizer(src) if src is not None else None
        if tok is not None:
            out[m.name] = tok
    return out
