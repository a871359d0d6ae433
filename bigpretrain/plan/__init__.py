"""Planning for accelerators: the accelerator table, ahead-of-time plans of a step (memory,
FLOPs, collectives) from the target's own compiler, and the XLA settings for GPUs.

accelerators.py  peak FLOPs, HBM and compile-only devices per chip (gpu_specs/ for GPUs)
aot_plan.py      the plan of a config's train step (`python -m bigpretrain.tools.plan`)
flops.py         FLOPs counted on a step's jaxpr (what MFU counts)
hlo_text.py      reading compiled HLO text (shapes, instructions, computations)
hlo_collectives.py  the collectives of compiled HLO text
hlo_traffic.py   the bytes a compiled program's kernels move, and the step time they bound
gpu_flags.py     XLA / CUDA flags applied when JAX runs on GPUs
"""
