"""A tiny Llama in Hugging Face's format, made here from a config, for vLLM without any model hub: two
layers, random weights, and a byte-level BPE tokenizer trained on the texts it is given (so that the
prompts it will see tokenize into few tokens). What it says is noise; every token costs a real forward
pass through vLLM.

    python -m fusionrag.loadtests.hf_llm OUT_DIR [TEXT_FILE ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from fusionrag.integrations.vllm.prompt import RAG_TEMPLATE

SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def build_tiny_llm(out: Path, texts: Iterable[str] = (), vocab_size: int = 600, max_positions: int = 2048) -> Path:
    """Write the model (a context of `max_positions` tokens) and its tokenizer (trained on RAG_TEMPLATE and
    `texts`) into `out`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [RAG_TEMPLATE, *texts] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(0)
    # head_dim 32: a size vLLM's CPU attention supports.
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=True, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusionrag.loadtests.hf_llm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory to write the model into")
    p.add_argument("texts", nargs="*", type=Path, help="text files the tokenizer learns from, besides RAG_TEMPLATE")
    args = p.parse_args(argv)
    build_tiny_llm(args.out, [f.read_text() for f in args.texts])
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
