"""The static driver: prompts in fixed batches, each decoded to completion by one mode.

Per batch (padded to ``batch_size`` rows of length P): the mode's prefill, then its ``run``
(device ``lax.while_loop``, ``loop="device"``, measured faster, see benchmarks/decode.py) or a
host loop over its ``step`` (``loop="host"``); then each row's ``Result``.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decode.programs import DecodeProgram, Mode
from dspark_jax.decode.requests import Result


def _batches(prompts, batch_size: int, p_len: int, budgets: Sequence[int]):
    """Yield (indices, prompts [B, P], lens [B], valid [B], budgets [B]), last batch padded."""
    for start in range(0, len(prompts), batch_size):
        idx = list(range(start, min(start + batch_size, len(prompts))))
        arr = np.zeros((batch_size, p_len), np.int32)
        lens = np.ones((batch_size,), np.int32)
        valid = np.zeros((batch_size,), bool)
        mx = np.ones((batch_size,), np.int32)
        for r, i in enumerate(idx):
            arr[r, :len(prompts[i])] = prompts[i]
            lens[r] = len(prompts[i])
            valid[r] = True
            mx[r] = budgets[i]
        yield idx, jnp.asarray(arr), jnp.asarray(lens), jnp.asarray(valid), jnp.asarray(mx)


def drive(prompts, batch_size: int, p_len: int, seed: int, decode_batch, row_result,
           progress, budgets: Sequence[int]) -> list[Result]:
    """The batch loop of the static driver.

    Per batch (padded to ``batch_size`` rows of length ``p_len``): ``decode_batch(prompts
    [B, P], lens [B], valid [B], budgets [B], key)`` returns host arrays; ``row_result(host, row,
    prompt_length, batch_index, seconds)`` makes each request's Result; ``progress(n)``
    (optional) is told how many requests finished. Results are in prompt order.
    """
    key = jax.random.PRNGKey(seed)
    results: list[Result | None] = [None] * len(prompts)
    if progress is not None:
        progress(0)  # validated: the work starts
    for bi, (idx, arr, lens, valid, mx) in enumerate(_batches(prompts, batch_size, p_len, budgets)):
        key, k_batch = jax.random.split(key)
        t0 = time.perf_counter()
        host = decode_batch(arr, lens, valid, mx, k_batch)
        seconds = time.perf_counter() - t0
        for r, i in enumerate(idx):
            results[i] = row_result(host, r, len(prompts[i]), bi, seconds, budgets[i])
        if progress is not None:
            progress(len(idx))
    return results  # type: ignore[return-value]


def generate(mode: Mode, prog: DecodeProgram, tparams, prompts, budgets: Sequence[int], stops,
             stop_arr, temp, *, batch_size: int, p_len: int, max_len: int, seed: int, loop: str,
             progress) -> list[Result]:
    """Decode validated ``prompts`` in batches of ``batch_size`` with ``mode``'s programs
    (params already placed by ``prog``): one Result per prompt, in prompt order."""
    programs, dp, conf_temps = mode.programs, mode.dparams, mode.conf_temps

    def decode_batch(arr, lens, valid, mx, k_batch):
        arr, lens, valid, mx = prog.place(arr), prog.place(lens), prog.place(valid), prog.place(mx)
        state = programs.prefill(tparams, dp, arr, lens, valid, k_batch, temp, stop_arr,
                                 static=mode.prefill_static, max_len=max_len, max_new=mx)
        state = mode.init_policy_state(state, batch_size)
        if loop == "device":
            state = programs.run(tparams, dp, state, temp, stop_arr, conf_temps, static=mode.static)
        else:
            for _ in range(mode.static.max_new_tokens):
                if not bool(jnp.any(state.active)):
                    break
                state = programs.step(tparams, dp, state, temp, stop_arr, conf_temps,
                                      static=mode.static)
        return state.host_view()

    def row_result(host, r, start, bi, seconds, budget):
        res = mode.result(host, r, start, budget, stops)
        res.batch_index, res.batch_seconds = bi, seconds
        return res

    return drive(prompts, batch_size, p_len, seed, decode_batch, row_result, progress, budgets)
