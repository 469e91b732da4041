"""The compiled programs, per mesh, and the two decoding modes that bundle them.

``build_decode(mesh, rules)`` jits every step program once per (mesh, rules): static configs
(``state.DecodeStatic``: target / draft config, policy, greedy, budget, widths, spans) are
static arguments, so one program set serves every config and family; the state is donated and,
with a mesh, constrained leaf by leaf to its declared layout (``sharded.state_sharding_tree``),
so it keeps one sharding from call to call and nothing recompiles as rows come and go.

A ``Programs`` record holds one mode's five programs, all with the same signature in both modes
(``step``):

- ``prefill(tp, dp, prompts [B,P], lens [B], valid [B], key, temp, stop, *, static, max_len,
  max_new=None)`` -> state
- ``step(tp, dp, state, temp, stop, conf_temps, *, static)``: one round / token
- ``run(...)``: steps until every row ends (a device ``lax.while_loop``)
- ``chunk(tp, dp, state, temp, stop, conf_temps, max_steps, until_finish, *, static)``
- ``prefill_into(tp, dp, state, slot, prompt [1,P], len [1], max_new [1], key, temp, stop,
  *, static, max_len)``: the continuous engine's per-slot refill.

A ``Mode`` (``speculative`` / ``autoregressive``) is what a driver holds: its programs, the
drafter's arguments (None without one), the policy's initial state and the result builder, so
the static driver and the continuous engine run either mode without branching on it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dspark_jax import families, runtime
from dspark_jax import params as params_lib
from dspark_jax import sharding as sharding_lib
from dspark_jax.decode import requests, sharded, step
from dspark_jax.decode.shapes import MAX_STOP_IDS
from dspark_jax.decode.state import DecodeStatic
from dspark_jax.draft import kinds


@dataclasses.dataclass(frozen=True)
class Programs:
    """One mode's jitted programs (see the module docstring for the signatures)."""

    prefill: Any
    step: Any
    run: Any
    chunk: Any
    prefill_into: Any

    def jitted(self) -> tuple:
        return (self.prefill, self.step, self.run, self.chunk, self.prefill_into)


@dataclasses.dataclass(frozen=True)
class DecodeProgram:
    """The program set of one (mesh, rules): ``spec`` and ``ar`` programs plus placement.

    ``mesh`` None: one device, plain jit. Otherwise params go through ``place_params`` (their
    declared logical axes) and state leaves through their declarations (``state_sharding``).
    """

    mesh: Any
    rules: Any
    spec: Programs
    ar: Programs

    def state_sharding(self, like):
        """The full sharding tree of the state ``like`` (a state or its shapes, any target
        family; ``sharded.state_sharding_tree``); None without a mesh."""
        if self.mesh is None:
            return None
        return sharded.state_sharding_tree(like, self.mesh, self.rules)

    def place_params(self, params, config):
        """``params`` on the mesh by their declared axes, then ``platform_layers``."""
        return self.platform_layers(sharded.place_params(params, config, self.mesh, self.rules), config)

    def platform_layers(self, params, config):
        """A target or drafter whose layer loop takes per-layer weights (``TargetRuntime.per_layer``,
        ``DraftRuntime.per_layer``) gets its layers as the mesh's platform reads them best
        (``params.for_platform``: per-layer buffers on GPUs); other params unchanged (arrays or
        abstract)."""
        family = families.for_config(config)
        if params is None or family.runtime is None or not family.runtime.per_layer:
            return params
        return params_lib.for_platform(params, runtime.Context(self.mesh).platform, family.runtime.stacks)

    def place(self, x):
        """A host input (prompts, lens, ...) on the mesh, batch-sharded when its dim 0 divides."""
        if self.mesh is None:
            return x
        x = jnp.asarray(x)
        if x.ndim and x.shape[0] % sharded.batch_multiple(self.mesh, self.rules) == 0:
            return sharding_lib.to_global(x, sharding_lib.batch_sharding(self.mesh, x.ndim, self.rules))
        return sharding_lib.to_global(x, sharding_lib.replicated(self.mesh))

    def replicate(self, x):
        """A host value replicated over the mesh (unchanged without one)."""
        return x if self.mesh is None else sharding_lib.to_global(x, sharding_lib.replicated(self.mesh))

    def jitted(self) -> tuple:
        return self.spec.jitted() + self.ar.jitted()


_PROGRAMS: dict = {}


def build_decode(mesh=None, rules=None) -> DecodeProgram:
    """The decode program set for ``mesh`` (None: one device), built once per (mesh, rules)
    (``sharded.decode_rules(target_cfg)``: the decode rules plus the target family's)."""
    rules = sharded.DECODE_RULES if rules is None else rules
    key = (mesh, tuple(sorted((k, str(v)) for k, v in rules.items())))
    if key in _PROGRAMS:
        return _PROGRAMS[key]
    ctx = runtime.Context.make(mesh, rules)  # what every family forward sees

    def jit(fn, statics, donate=()):
        fn = functools.wraps(fn)(functools.partial(fn, ctx=ctx))
        if mesh is not None:
            # The output state is constrained leaf by leaf from its own declarations (the cache
            # layout differs per target family), so one program set serves every family.
            @functools.wraps(fn)
            def fn(*a, _fn=fn, **k):
                out = _fn(*a, **k)
                return jax.lax.with_sharding_constraint(out, sharded.state_sharding_tree(out, mesh, rules))
        return jax.jit(fn, static_argnames=statics, donate_argnames=donate)

    def programs(prefill, one_step, run):
        s, sm, st = ("static",), ("static", "max_len"), ("state",)
        return Programs(prefill=jit(prefill, sm), step=jit(one_step, s, st), run=jit(run, s, st),
                        chunk=jit(step.chunk_of(one_step), s, st),
                        prefill_into=jit(step.prefill_into_of(prefill), sm, st))

    prog = DecodeProgram(mesh=mesh, rules=rules,
                         spec=programs(step.spec_prefill, step.speculative_round, step.spec_run),
                         ar=programs(step.ar_prefill, step.ar_step, step.ar_run))
    _PROGRAMS[key] = prog
    return prog


def compile_cache_sizes() -> int:
    """Total number of compiled variants held by every built program's jitted functions."""
    return sum(f._cache_size() for p in _PROGRAMS.values() for f in p.jitted())


def abstract_decode_state(tparams, dparams, static: DecodeStatic, batch: int, max_len: int,
                          prompt_len: int = 64):
    """ShapeDtypeStruct tree of a DecodeState of ``batch`` rows and cache capacity ``max_len``
    (params may be abstract): what the planner compiles ``build_decode(mesh).spec.step`` against."""
    return jax.eval_shape(
        lambda tp, dp: step.spec_prefill(
            tp, dp, jnp.zeros((batch, prompt_len), jnp.int32),
            jnp.full((batch,), prompt_len, jnp.int32), jnp.ones((batch,), bool),
            jax.random.PRNGKey(0), jnp.float32(1.0), jnp.full((MAX_STOP_IDS,), -1, jnp.int32),
            static, max_len),
        tparams, dparams)


# --------------------------------------------------------------------------- modes


@dataclasses.dataclass(frozen=True)
class Mode:
    """Speculative or autoregressive decoding as a driver runs it.

    programs: the mode's ``Programs``; dparams / conf_temps: the drafter's arguments (None
    autoregressive); static: the programs' static config (``prefill_static``: the same without
    the policy, so the prefill compiles once for every policy); policy: its ``init_state`` is
    the state's policy state; block: G (1 autoregressive); result: ``(host_view, row, prompt
    length, budget, stops, cls) -> Result``."""

    programs: Programs
    dparams: Any
    conf_temps: Any
    static: DecodeStatic
    policy: Any
    block: int
    result: Callable

    @property
    def prefill_static(self) -> DecodeStatic:
        return dataclasses.replace(self.static, policy=None)

    def init_policy_state(self, state, rows: int):
        """``state`` of ``rows`` rows with the policy's initial state (unchanged autoregressive)."""
        return state if self.policy is None else state.replace(
            policy_state=self.policy.init_state(rows, self.block))


def speculative(prog: DecodeProgram, static: DecodeStatic, dparams, conf_temps) -> Mode:
    """The speculative mode of ``prog`` for ``static`` (a drafter config and policy)."""
    with_conf = kinds.proposer(static.draft).confidence and static.draft.enable_confidence_head
    return Mode(prog.spec, dparams, conf_temps, static, static.policy, static.draft.block_size,
                functools.partial(_result, requests.speculative_result, with_conf))


def autoregressive(prog: DecodeProgram, static: DecodeStatic) -> Mode:
    """The autoregressive mode of ``prog`` (no drafter, no policy)."""
    return Mode(prog.ar, None, None, static, None, 1,
                functools.partial(_result, requests.autoregressive_result, False))


def _result(build, with_conf, host, row, start, budget, stops, cls=requests.Result):
    return build(host, row, start, budget, stops, with_conf, cls=cls)
