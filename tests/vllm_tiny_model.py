"""Make a tiny random-weight Llama and a locally trained tokenizer that vLLM can serve on CPU.

Run with the vLLM venv's python (it needs torch, transformers, tokenizers):

    python tests/vllm_tiny_model.py OUT_DIR

No hub, no downloads: the tokenizer is a byte-level BPE trained here on generated
text, the weights are random. The output is gibberish, which is fine: timing, prefix
caching, KV events and the OpenAI protocol are real. head_dim is 32 because vLLM's
CPU attention kernel accepts only a few head sizes (32, 64, 80, ...).
Making it takes a few seconds; it is about 34 MB on disk.
Stdlib + those three packages only: this file never imports the project.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|pad|>"]
# A Llama-3-like template: earlier turns render identically whatever follows them.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are not "
    "fleet token cache prefix model engine site queue route batch stream latency goodput "
    "tensor kernel block decode prefill request answer signal vector memory compute river "
    "stone garden window silver orange quiet rapid gentle bright north south harbor meadow "
    "system user assistant document section chapter number table value report summary"
).split()


def corpus(n_lines: int = 4000, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 30))]
        lines.append(" ".join(words) + rng.choice([".", ",", "?", "!", ":", " 42.", " 2026."]))
    return lines


def make_tokenizer(out: Path, vocab_size: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    bos_id = tok.token_to_id(BOS)
    # Completions add BOS (add_special_tokens=True); chat templates write it themselves.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def make_model(out: Path, vocab_size: int, bos_id: int, eos_id: int, hidden: int, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 32,
                         num_key_value_heads=hidden // 32, head_dim=32, max_position_embeddings=4096,
                         bos_token_id=bos_id, eos_token_id=eos_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    # ~17M parameters: a decode step of ~7 ms on one core. A smaller model steps so fast
    # (~2 ms) that vLLM's API server, sharing the second core, falls behind its engine:
    # streams then arrive in one burst at the end and disconnects are noticed too late.
    p.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 32)")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv[1:])
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    make_model(out, len(tok), tok.bos_token_id, tok.eos_token_id, args.hidden, args.layers)
    (out / "tokenfleet-tiny.json").write_text(json.dumps({"vocab_size": len(tok)}))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
