"""Dispatcher backends and kernels behind fxoverlap's custom ops.

``a2a``: expert-parallel token all-to-all over ``torch.distributed`` (NCCL on GPU,
gloo on CPU). ``grouped_gemm``: expert GEMMs (``torch._grouped_mm`` or a loop).
``deepep``: the op names of DeepEP's dispatch and combine, which the tag pass
recognises (``deep_ep`` itself is never imported).
"""
