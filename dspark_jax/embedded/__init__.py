"""The embedded default target: a tiny byte-level Qwen3 LM shipped with the package."""
