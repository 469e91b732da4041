"""Speculative decoding: jitted batched rounds, lossless verification, pluggable policies."""

from dspark_jax.decode.loop import (  # noqa: F401
    DecodeProgram, Result, autoregressive_generate, build_decode, speculative_generate, summarize,
)
from dspark_jax.decode.policies import (  # noqa: F401
    FixedPolicy, FullPolicy, ThresholdPolicy, VerifyPolicy, parse_policy, register_policy,
)
