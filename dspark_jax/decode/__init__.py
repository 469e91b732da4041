"""Speculative decoding: jitted batched rounds, lossless verification, pluggable policies.

The package, top to bottom: ``api`` (the front door: ``speculative_generate``,
``autoregressive_generate``, ``decode_requests``) -> ``static`` (fixed batches) / ``engine``
(continuous batching) -> ``programs`` (the jitted programs per mesh; the speculative and
autoregressive ``Mode``) -> ``step`` (the round and the AR step, through the target family's
runtime protocol, ``dspark_jax.runtime``) -> ``state`` / ``shapes`` / ``requests`` / ``sharded``
(the state pytree, the compiled shapes, validation and results, mesh placement); ``verify``
(rejection sampling), ``policies`` / ``scheduler`` (verification lengths), ``metrics``
(``summarize``), ``profile`` / ``settings`` (SPS tables, CLI options).
"""

from dspark_jax.decode.api import (  # noqa: F401
    autoregressive_generate, decode_requests, speculative_generate,
)
from dspark_jax.decode.metrics import summarize  # noqa: F401
from dspark_jax.decode.policies import (  # noqa: F401
    FixedPolicy, FullPolicy, ThresholdPolicy, VerifyPolicy, parse_policy, register_policy,
)
from dspark_jax.decode.programs import DecodeProgram, build_decode  # noqa: F401
from dspark_jax.decode.requests import Result, StreamResult  # noqa: F401
