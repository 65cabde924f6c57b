"""Reproduction, outside fxoverlap: a Qwen3-Next / Qwen3.5-MoE linear-attention layer (gated
DeltaNet, transformers' torch fallback ``torch_chunk_gated_delta_rule``) fails its backward under
``torch.compile(backend="aot_eager")`` on CPU, alone, with no fxoverlap code involved.

    python -m fxoverlap.bench linear-attention              # both families
    python -m fxoverlap.bench linear-attention qwen3_next

Prints, per family, eager's result and what aot_eager raises (the error fxoverlap's capture
reports for these models, which it traces through AOTAutograd the same way).
"""

from __future__ import annotations

import argparse

import torch


def layer(family: str) -> torch.nn.Module:
    import transformers  # here: importing this module (--help, the suite's import checks) needs no transformers

    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                  layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  shared_expert_intermediate_size=16)
    torch.manual_seed(0)
    if family == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**fields))
    else:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**fields))
    return model.model.layers[0].linear_attn  # the gated DeltaNet of the first (linear-attention) layer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("families", nargs="*", choices=("qwen3_next", "qwen3_5_moe"), default=["qwen3_next", "qwen3_5_moe"])
    for family in p.parse_args().families:
        attn = layer(family)
        x = torch.randn(2, 8, 32, requires_grad=True)
        attn(x).sum().backward()
        print(f"{family}: eager forward + backward ok ({type(attn).__name__})")
        torch._dynamo.reset()
        compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)
        try:
            compiled(x).sum().backward()
            print(f"{family}: aot_eager ok")
        except Exception as e:  # noqa: BLE001
            first = str(e).strip().splitlines()[0]
            print(f"{family}: aot_eager fails: {type(e).__name__}: {first}")


if __name__ == "__main__":
    main()
