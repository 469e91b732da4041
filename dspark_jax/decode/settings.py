"""Decode settings shared by generate, eval, the demo and the benchmarks, and their one resolver.

``DecodeOptions`` is what a user chooses (flags or a pipeline's arguments);
``resolve`` turns it into what the decoder needs for a target/drafter pair: the
verification policy, the stop-token ids (the target's eos by default) and the
STS temperatures (the drafter's saved ones by default).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

from dspark_jax.errors import InputError, require_positive_int, warn


BATCHING = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """User-facing decode settings. ``None`` means "the checkpoint's default"."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    verify: str = "full"
    confidence_threshold: float | None = None
    confidence_temperatures: tuple[float, ...] | None = None
    sps_table: str | None = None
    batch_size: int = 1
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    raw_prompt: bool = False
    thinking: bool = False
    batching: str = "continuous"
    mesh: str | None = None

    def __post_init__(self):
        require_positive_int(self.max_new_tokens, "max_new_tokens")
        if self.batching not in BATCHING:
            raise InputError(f"batching must be one of {BATCHING}, got {self.batching!r}")
        require_positive_int(self.batch_size, "batch_size")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise InputError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        c = self.confidence_threshold
        if c is not None and not (isinstance(c, (int, float)) and 0 <= c <= 1):
            raise InputError(f"--confidence-threshold must be in [0, 1] (a draft token is verified "
                             f"while its confidence is >= C), got {c!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t >= 0 and math.isfinite(t)):
            raise InputError(f"temperature must be a finite number >= 0, got {t!r}")

    def replace(self, **changes) -> "DecodeOptions":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ResolvedDecode:
    """policy (None without a drafter); stop_ids; confidence_temperatures (None: none);
    sts_from_drafter: the temperatures were read from the drafter's extras."""

    policy: Any
    stop_ids: list[int]
    confidence_temperatures: list[float] | None
    sts_from_drafter: bool = False

    def decode_kwargs(self, options: DecodeOptions, speculative: bool = True) -> dict:
        """Keyword arguments of ``speculative_generate`` (or ``autoregressive_generate``)."""
        kw = dict(max_new_tokens=options.max_new_tokens, temperature=options.temperature,
                  batch_size=options.batch_size, seed=options.seed, stop_token_ids=self.stop_ids)
        if speculative:
            kw.update(policy=self.policy, confidence_temperatures=self.confidence_temperatures)
        return kw


def resolve(options: DecodeOptions, target_dir, draft_dir=None, tokenizer=None) -> ResolvedDecode:
    """Policy, stop ids and STS temperatures of ``options`` for a target (and drafter) directory."""
    from dspark_jax.convert.checkpoint import default_stop_ids
    from dspark_jax.convert.formats import sts_temperatures
    from dspark_jax.decode.policies import parse_policy

    stops = (default_stop_ids(Path(target_dir), tokenizer) if options.stop_token_ids is None
             else [int(t) for t in options.stop_token_ids])
    if draft_dir is None:
        return ResolvedDecode(None, stops, None)
    policy = parse_policy(options.verify, confidence_threshold=options.confidence_threshold,
                          sps_table=options.sps_table)
    temps = sts_temperatures(draft_dir, options.confidence_temperatures)
    for message in advisories(options, policy):
        warn(message)
    return ResolvedDecode(policy, stops, temps,
                          sts_from_drafter=temps is not None and options.confidence_temperatures is None)


NEVER_PAYS_CONFIDENCE = 0.95  # warn when the scheduler needs a first-token confidence above this


def advisories(options: DecodeOptions, policy, block_size: int | None = None) -> list[str]:
    """Warnings for settings that do not do what they seem to: a flag the policy ignores and an
    SPS table under which speculation never pays (``resolve`` prints these); with the drafter's
    ``block_size``: ``fixed:K`` beyond the block (clamped)."""
    out = []
    name = options.verify.partition(":")[0]
    if options.confidence_threshold is not None and name != "threshold":
        out.append(f"--confidence-threshold {options.confidence_threshold} is ignored by --verify "
                   f"{options.verify} (it applies to --verify threshold only)")
    if block_size is not None:  # the checks that need the drafter's block size only
        k = getattr(policy, "k", None)
        if isinstance(k, int) and k > block_size:
            return [f"--verify {options.verify}: the drafter proposes {block_size} tokens per round, "
                    f"so fixed:{k} verifies {block_size} (clamped)"]
        return []
    from dspark_jax.decode.tables import SPSTable

    sps = getattr(policy, "sps", None)
    if isinstance(sps, SPSTable) and name.startswith("scheduler"):  # a token table
        # Algorithm 1 admits the first draft token of a row only if (R + c) * SPS(R + 1) beats
        # R * SPS(R): it needs a survival c above R * (SPS(R) / SPS(R + 1) - 1)
        r = options.batch_size
        need = r * (float(sps(r)) / float(sps(r + 1)) - 1.0)
        if need >= NEVER_PAYS_CONFIDENCE:
            verdict = ("never pays" if need >= 1 else
                       f"pays only above a confidence of {need:.3f}, so almost no draft token is verified")
            out.append(f"--verify {options.verify}: under the SPS table {options.sps_table} speculation "
                       f"{verdict} (SPS({r}) = {float(sps(r)):.1f}, SPS({r + 1}) = {float(sps(r + 1)):.1f}: "
                       "verification cost grows with every token); use --verify full or threshold, or "
                       "re-measure the table with `dspark-jax profile-sps` on the device you decode on")
    return out


def options_from(values: dict, names: Sequence[str] | None = None) -> DecodeOptions:
    """DecodeOptions from a dict of field values (missing or None -> the field's default,
    except for the fields whose None means "the checkpoint's default")."""
    fields = {f.name: f for f in dataclasses.fields(DecodeOptions)}
    nullable = {"confidence_threshold", "confidence_temperatures", "sps_table", "stop_token_ids",
                "mesh"}
    kw = {}
    for name in names or fields:
        if name not in values or (values[name] is None and name not in nullable):
            continue
        v = values[name]
        if name in ("confidence_temperatures", "stop_token_ids") and v is not None:
            v = tuple(v)
        kw[name] = v
    return DecodeOptions(**kw)
