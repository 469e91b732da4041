"""Tools about compiled programs, apart from the model code: compile-only accelerator targets and
their chip facts (``hardware``), per-step flops and HBM bytes of a compiled HLO module
(``hlo_cost``), analytic model FLOPs (``flops``) and a compilation counter (``compiles``).
``plan``, the benchmarks and the tests read them; no model code imports them.
"""
