"""Build a tiny random-weight Llama and its tokenizer into a directory (no model hub needed).

Run with the vLLM venv's interpreter (it has torch, transformers and tokenizers):

    python tests/e2e/tiny_model.py OUT_DIR

The model matches the one the bundled trace was recorded with: 4 layers, hidden 512, 8 attention
heads, 2 KV heads (head_dim 64), vocab 8192, bf16, saved as safetensors. The tokenizer is a
byte-level BPE trained on this interpreter's own standard-library sources (local text, always
there), padded with filler tokens to exactly VOCAB entries so that every token id below VOCAB is
valid for vLLM's prompt-id check. Deterministic: fixed seeds and a sorted file list.
"""
from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

VOCAB = 8192
LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 4, 512, 8, 2, 1024
MAX_LEN = 4096


def _corpus(limit_bytes: int = 4_000_000):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    used = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        used += len(text)
        yield text
        if used >= limit_bytes:
            return


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    missing = VOCAB - tok.get_vocab_size()
    if missing > 0:  # a small corpus may stop short of VOCAB merges
        tok.add_tokens([f"<filler_{i}>" for i in range(missing)])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=MAX_LEN)
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=MAX_LEN, bos_token_id=1, eos_token_id=2, pad_token_id=None,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvhit_tiny_model.json").write_text(json.dumps(
        {"vocab": VOCAB, "layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS,
         "head_dim": HIDDEN // HEADS, "max_len": MAX_LEN, "dtype": "bfloat16"}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py OUT_DIR")
    build(Path(sys.argv[1]))
