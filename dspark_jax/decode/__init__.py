"""Speculative decoding: jitted batched rounds, lossless verification, pluggable policies.

The names below are re-exported lazily (PEP 562), so importing a light submodule such as
``dspark_jax.decode.settings`` (the CLI's flag defaults) does not import jax.
"""

_EXPORTS = {
    "dspark_jax.decode.loop": (
        "DecodeProgram", "Result", "autoregressive_generate", "build_decode", "speculative_generate",
        "summarize"),
    "dspark_jax.decode.policies": (
        "FixedPolicy", "FullPolicy", "ThresholdPolicy", "VerifyPolicy", "parse_policy",
        "register_policy"),
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
