"""The gateway's use of a model's own tokenizer: loading, chat templates, the request hook,
which directory a fleet file points at, and the fallback when there is none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetcore.fleet_config import parse_fleet
from fleetcore.model_tokenizer import (HFTokenizer, TokenizerUnavailable, load_tokenizer, model_tokenizers,
                                        tokenizer_source)
from fleetcore.prefix import block_hashes
from fleetcore.tokens import encode
from gateway.auth import Caller
from gateway.requests import parse_request

WORDS = ["<s>", "</s>", "<unk>", "hello", "world", "the", "fleet", "user", "assistant", "system",
         "[", "]", ":", "|", "tool", "x", "y"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}\n"
            "  [{{ m['role'] }}]: {{ m['content'] }} |\n"
            "{% endfor %}\n"
            "{% if add_generation_prompt %}[assistant]:{% endif %}")


def make_dir(d: Path, template_in: str = "config", template: str = TEMPLATE) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    config: dict = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}
    if template_in == "config":
        config["chat_template"] = template
    elif template_in == "named":
        config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    elif template_in == "jinja":
        (d / "chat_template.jinja").write_text(template)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


@pytest.mark.parametrize("where", ["config", "named", "jinja"])
def test_chat_template_rendered_like_transformers(tmp_path, where):
    tok = HFTokenizer(make_dir(tmp_path, where))
    messages = [{"role": "user", "content": "hello world"}]
    # trim_blocks/lstrip_blocks: the newline after each block tag vanishes
    text = tok._template.render(messages=messages, add_generation_prompt=True, **tok.special_tokens)
    assert text == "<s>  [user]: hello world |\n[assistant]:"
    # the template writes BOS itself, so encoding adds no second one
    assert tok.chat_ids(messages) == ids("<s>", "[", "user", "]", ":", "hello", "world", "|",
                                         "[", "assistant", "]", ":")


def test_text_prompts_get_special_tokens(tmp_path):
    tok = HFTokenizer(make_dir(tmp_path))
    assert tok.text_ids("hello the fleet") == ids("<s>", "hello", "the", "fleet")


def test_content_parts_join_with_newlines_and_generation_tags_render(tmp_path):
    template = ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
                "{{ m['content'] | tojson }}{% endfor %}")
    tok = HFTokenizer(make_dir(tmp_path, "jinja", template))
    assert tok._template.render(messages=[{"role": "user", "content": "x\ny"}]) == 'x\ny"x\\ny"'
    parts = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {}}, {"type": "text", "text": "y"}]
    assert tok.chat_ids([{"role": "user", "content": parts}]) == tok.chat_ids([{"role": "user", "content": "x\ny"}])


def test_missing_files_fall_back(tmp_path, caplog):
    with pytest.raises(TokenizerUnavailable):
        HFTokenizer(tmp_path)
    assert load_tokenizer(tmp_path / "nowhere") is None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    assert load_tokenizer(tmp_path / "broken") is None
    assert "cannot load the tokenizer" in caplog.text


def fleet(tmp_path: Path, model_extra: dict | None = None, options: dict | None = None):
    return parse_fleet({
        "sites": [{"name": "s", "region": "r", "jurisdiction": "j"}],
        "models": [{"name": "m", "engine": {"spec": "llama-3.1-8b", "block_size": 2}, **(model_extra or {})},
                   {"name": "other", "engine": {"spec": "llama-3.1-8b"}}],
        "deployments": [{"site": "s", "model": "m", "adapter": "vllm",
                         "options": options or {"model": str(tmp_path / "weights")}},
                        {"site": "s", "model": "other", "instances": 1}],
    })


def test_tokenizer_source_prefers_the_model_entry_then_the_engines_model_dir(tmp_path):
    make_dir(tmp_path / "weights")
    make_dir(tmp_path / "tok")
    assert tokenizer_source(fleet(tmp_path), "m") == tmp_path / "weights"
    assert tokenizer_source(fleet(tmp_path, {"tokenizer": str(tmp_path / "tok")}), "m") == tmp_path / "tok"
    assert tokenizer_source(fleet(tmp_path, options={"model": "org/hub-name"}), "m") is None
    assert tokenizer_source(fleet(tmp_path), "other") is None  # simulated: estimated tokens
    assert set(model_tokenizers(fleet(tmp_path))) == {"m"}


def test_requests_use_the_models_tokenizer_and_fall_back_without(tmp_path):
    make_dir(tmp_path / "weights", template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = fleet(tmp_path)
    toks = model_tokenizers(config)
    caller = Caller(tenant="t")

    def parse(kind, body, tokenizers=toks):
        return parse_request(kind, json.dumps(body).encode(), config=config, caller=caller, headers={},
                             request_id="r", now=0.0, tokenizers=tokenizers).profile

    p = parse("completion", {"model": "m", "prompt": "hello world the fleet"})
    want = ids("<s>", "hello", "world", "the", "fleet")
    assert p.prompt_tokens == 5 and p.block_hashes == tuple(block_hashes(want, 2))
    p = parse("chat", {"model": "m", "messages": [{"role": "user", "content": "hello world the"}]})
    assert p.block_hashes == tuple(block_hashes(ids("<s>", "hello", "world", "the"), 2))
    p = parse("completion", {"model": "m", "prompt": [3, 4, 5, 6]})  # token ids pass as they are
    assert p.block_hashes == tuple(block_hashes([3, 4, 5, 6], 2))
    p = parse("completion", {"model": "other", "prompt": "hello world"})  # no tokenizer: estimate
    assert p.prompt_tokens == len(encode("hello world"))
    p = parse("completion", {"model": "m", "prompt": "hello world"}, tokenizers=None)
    assert p.prompt_tokens == len(encode("hello world"))


def test_a_template_error_falls_back_to_the_estimate(tmp_path):
    make_dir(tmp_path / "weights", template="{{ raise_exception('roles must alternate') }}")
    config = fleet(tmp_path)
    p = parse_request("chat", json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                      config=config, caller=Caller(tenant="t"), headers={}, request_id="r", now=0.0,
                      tokenizers=model_tokenizers(config)).profile
    assert p.prompt_tokens > 0
