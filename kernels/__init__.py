"""Dispatcher backends and kernels behind fxoverlap's custom ops.

``a2a``: expert-parallel token all-to-all over ``torch.distributed`` (NCCL on GPU,
gloo on CPU). ``grouped_gemm``: expert GEMMs (``torch._grouped_mm`` or a loop).
``static_ep``: sync-free, static-shape
dispatch/combine over a fixed per-link capacity, moved by a transport: ``padded`` (equal-split
all-to-all) or ``symm_mem`` (CUDA symmetric memory; imported only when used).
``deepep``: the op names torchtitan registers for DeepEP's and HybridEP's dispatch and
combine (``deepep::``, ``hybridep::``), which the tag pass recognises (neither ``deep_ep``
nor torchtitan is imported).
"""
