"""Random checkpoints of SmolLM2's shape in other families, for ``kvgate bench load --model``
(issue 43, item 8): the same sizes, SmolLM2's tokenizer and vocabulary, one family's layers.

    python tools/bench/random_checkpoint.py FAMILY OUT_DIR [--data-dir DIR]

FAMILY: llama, qwen3, gemma3 (five layers of every six windowed to 512 positions), lfm2 (every
third layer attention, the others LFM2's short convolutions: about LFM2's share) or qwen3_5
(every fourth layer gated attention, the others Gated DeltaNet with 9 key and 9 value heads of
64: Qwen3.5's share, its key width the hidden size as in Qwen3.5's). SmolLM2's shape: 576 wide,
30 layers, 9 heads, 3 KV heads of 64, an MLP of 1,536; saved in float32 with every weight a
bfloat16 number (``--float32-weights``: random float32 numbers), as a published checkpoint's,
trained and shipped in bfloat16, are when served in float32.

Why the end tokens' output rows are zero: random weights can emit an end token at any step, and
a server that stops there answers fewer tokens than asked, which no two servers then compare.
With those rows zero, an end token's logit is exactly 0 while the others are random around it:
greedy decoding (the bench's) picks one of ~49k other tokens, so every server runs the asked
number of tokens without an option of its own to ignore the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from gateway.engine.models.loading import BUNDLED, converted_checkpoint

SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
         "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
         "max_position_embeddings": 8192, "tie_word_embeddings": False}
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "gemma3_text": {"sliding_window": 512, "sliding_window_pattern": 6},
    "lfm2": {"layer_types": ["full_attention" if i % 3 == 2 else "conv" for i in range(30)],
             "block_auto_adjust_ff_dim": False},
    "qwen3_5_text": {"layer_types": ["full_attention" if i % 4 == 3 else "linear_attention"
                                     for i in range(30)],
                     "linear_num_key_heads": 9, "linear_num_value_heads": 9,
                     "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                     "linear_conv_kernel_dim": 4},
}
NO_HEAD_DIM = {"lfm2"}
"""Families whose config has no ``head_dim`` (it is ``hidden_size // num_attention_heads``)."""


def build(family: str, out: Path, data_dir: Path, *, bfloat16_numbers: bool = True) -> Path:
    bundled = converted_checkpoint(BUNDLED, data_dir / "models")
    assert bundled is not None
    tokenizer = AutoTokenizer.from_pretrained(bundled)
    model_type = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text"}.get(family, family)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id,
                                  **{name: value for name, value in SHAPE.items()
                                     if name != "head_dim" or model_type not in NO_HEAD_DIM},
                                  **FAMILIES[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ends = {tokenizer.eos_token_id, *(config.eos_token_id if isinstance(config.eos_token_id, list)
                                      else [config.eos_token_id])} - {None}
    with torch.no_grad():
        for token in ends:
            model.lm_head.weight[token] = 0.0
        if bfloat16_numbers:
            for parameter in model.parameters():
                parameter.copy_(parameter.to(torch.bfloat16).to(torch.float32))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=["llama", "qwen3", "gemma3", "lfm2", "qwen3_5"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--data-dir", type=Path, default=Path("data"),
                        help="where the bundled model's converted copy is (or goes)")
    parser.add_argument("--float32-weights", action="store_true",
                        help="random float32 numbers instead of bfloat16 ones")
    args = parser.parse_args(argv)
    print(build(args.family, args.out, args.data_dir,
                bfloat16_numbers=not args.float32_weights))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
