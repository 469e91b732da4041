"""An acceptance profile for projected ``bench``: per-position conditional acceptance a user
supplies (``--acceptance FILE``) where no drafter of the served model runs here.

The file (JSON)::

    {"source": "where the numbers come from (printed beside every projected row)",
     "drafters": {"dspark5": {"conditional_acceptance": [c1, ..., cG], "confidence_head": true},
                  "mtp1": {"conditional_acceptance": [c1], "confidence_head": false}}}

``c_k`` = P(draft k accepted | drafts 1..k-1 accepted) (the paper's Fig. 2 metric); G = the
drafter's block size (checked against its round table). ``synthetic_logs`` turns a profile into
the ``RequestLog``s the replay reads: per round, accepted = the number of leading successes of
independent Bernoulli(c_k) draws (seeded: the same file gives the same rows), and the confidence
the policies see is the profile itself (logit c_k: a calibrated head's mean; a drafter without a
head shows all-ones confidences, as the engine does). Rows projected from a profile therefore
carry its ``source``, the seed and the request count as their acceptance source.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np

from dspark_jax.errors import InputError
from dspark_jax.pipelines import bench_project as P


@dataclasses.dataclass(frozen=True)
class Profile:
    """One drafter's profile: ``accept`` [G] conditional acceptance, whether it has a confidence
    head, and the file's ``source`` line."""

    accept: tuple[float, ...]
    confidence_head: bool
    source: str

    @property
    def block_size(self) -> int:
        return len(self.accept)

    @property
    def tau(self) -> float:
        """Expected tokens per round under full verification: 1 + sum_k prod_{i<=k} c_i."""
        return 1.0 + float(np.sum(np.cumprod(self.accept)))


def read_profiles(path) -> dict[str, Profile]:
    """Profiles by drafter name from ``--acceptance FILE``; InputError (one line) on a bad file."""
    from dspark_jax.pipelines.bench_inputs import read_json

    where = f"--acceptance {str(path)!r}"
    obj = read_json(path, "--acceptance")
    source, drafters = obj.get("source"), obj.get("drafters")
    if not isinstance(source, str) or not source.strip():
        raise InputError(f"{where}: needs a 'source' line naming where the acceptance comes from")
    if not isinstance(drafters, dict) or not drafters:
        raise InputError(f"{where}: needs 'drafters': {{NAME: {{'conditional_acceptance': [...]}}}}")
    out = {}
    for name, rec in drafters.items():
        acc = rec.get("conditional_acceptance") if isinstance(rec, dict) else None
        if (not isinstance(acc, list) or not acc
                or not all(isinstance(c, (int, float)) and 0.0 < c < 1.0 for c in acc)):
            raise InputError(f"{where}: drafters.{name}.conditional_acceptance must be a "
                             "non-empty list of numbers in (0, 1), one per draft position")
        out[name] = Profile(tuple(float(c) for c in acc), bool(rec.get("confidence_head", True)),
                            f"acceptance profile {Path(path).name}: {source.strip()}")
    return out


def synthetic_logs(profile: Profile, n_requests: int, length: int, seed: int = 0
                   ) -> list[P.RequestLog]:
    """``n_requests`` RequestLogs of ``length`` output tokens each, rounds drawn from
    ``profile`` under full verification (seeded)."""
    rng = np.random.default_rng(seed)
    g = profile.block_size
    c = np.asarray(profile.accept)
    z = (np.log(c / (1.0 - c)) if profile.confidence_head
         else np.full(g, P.NO_HEAD_LOGIT))
    logs = []
    for _ in range(n_requests):
        accepted, emitted = [], 1  # the prefill emits the first token
        while emitted < length:
            ok = rng.random(g) < c
            a = g if ok.all() else int(np.argmin(ok))
            accepted.append(a)
            emitted += a + 1
        acc = np.asarray(accepted, np.int64)
        starts = 1 + np.concatenate([[0], np.cumsum(acc + 1)[:-1]]).astype(np.int64)
        logs.append(P.RequestLog(starts, np.tile(z, (len(acc), 1)), acc, length))
    return logs


def describe(profile: Profile, n_requests: int, length: int, seed: int) -> str:
    """The acceptance-source label of rows replayed from ``profile``."""
    cs = ", ".join(f"{c:g}" for c in profile.accept)
    return (f"{profile.source} (conditional acceptance [{cs}], expected tau {profile.tau:.2f}; "
            f"{n_requests} synthetic requests x {length} tokens, seed {seed})")


def skipped_policies(profile: Profile, specs: Sequence[str]) -> list[str]:
    """The policies that read confidence, which a drafter without a confidence head cannot run
    (the engine refuses them): none for a drafter with one."""
    if profile.confidence_head:
        return []
    return [s for s in specs if s.partition(":")[0] not in ("full", "fixed")]
