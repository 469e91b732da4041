"""Speculative decoding: jitted batched rounds, lossless verification, pluggable policies.

The package, top to bottom: ``api`` (the front door: ``speculative_generate``,
``autoregressive_generate``, ``decode_requests``) -> ``static`` (fixed batches) / ``engine``
(continuous batching) -> ``programs`` (the jitted programs per mesh; the speculative and
autoregressive ``Mode``) -> ``step`` (the round and the AR step, through the target family's
runtime protocol, ``dspark_jax.runtime``) -> ``state`` / ``shapes`` / ``requests`` / ``sharded``
(the state pytree, the compiled shapes, validation and results, mesh placement); ``verify``
(rejection sampling), ``policies`` / ``scheduler`` (verification lengths), ``metrics``
(``summarize``), ``profile`` / ``settings`` (SPS tables, CLI options).

The names below are re-exported lazily (PEP 562), so importing a light submodule such as
``dspark_jax.decode.settings`` (the CLI's flag defaults) does not import jax.
"""

_EXPORTS = {
    "dspark_jax.decode.api": ("autoregressive_generate", "decode_requests", "speculative_generate"),
    "dspark_jax.decode.metrics": ("summarize",),
    "dspark_jax.decode.policies": (
        "FixedPolicy", "FullPolicy", "ThresholdPolicy", "VerifyPolicy", "parse_policy",
        "register_policy"),
    "dspark_jax.decode.programs": ("DecodeProgram", "build_decode"),
    "dspark_jax.decode.requests": ("Result", "StreamResult"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
