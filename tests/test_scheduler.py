"""Prefix scheduler (paper Algorithm 1 / section 5.2 / Appendix A) and SPS tables."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decode import scheduler as S, tables
from dspark_jax.errors import ConfigError, InputError

_schedule = jax.jit(S.schedule, static_argnums=(2, 3))


_apply = jax.jit(lambda s, c, a, p: p(s, c, a), static_argnums=3)


def _call_policy(policy, state, conf, active):
    return _apply(state, conf, active, policy)


def brute_force(conf, active, table):
    """Global max of Theta over all l in {0..G}^R (inactive rows fixed at 0)."""
    b, g = conf.shape
    best, best_l = -np.inf, None
    ranges = [range(g + 1) if active[r] else [0] for r in range(b)]
    for ls in itertools.product(*ranges):
        theta = S.expected_throughput(conf, active, np.array(ls), table)
        if theta > best + 1e-12:
            best, best_l = theta, np.array(ls)
    return best, best_l


def path_thetas(conf, active, table):
    a = np.cumprod(conf, axis=1)
    cand = sorted([(-a[r, j], r, j) for r in range(conf.shape[0]) for j in range(conf.shape[1])
                   if active[r] and a[r, j] > 0])
    r_ = int(np.sum(active))
    out, tau = [r_ * float(table(r_))], float(r_)
    for n, (neg, _, _) in enumerate(cand, 1):
        tau += -neg
        out.append(tau * float(table(r_ + n)))
    return np.array(out)


def is_unimodal(th):
    d = np.diff(th)
    k = np.argmax(d <= 0) if np.any(d <= 0) else len(d)
    return np.all(d[:k] > 0) and np.all(d[k:] < 0)


# Smoothly decaying capacity curves (SPS(B) for B = 1..64): flat-then-1/B and exponential.
SMOOTH_TABLES = [
    tables.SPSTable(tuple(range(1, 65)), tuple(100.0 / max(1.0, b / 3.0) for b in range(1, 65))),
    tables.SPSTable(tuple(range(1, 65)), tuple(100.0 * np.exp(-0.25 * b) for b in range(1, 65))),
    tables.SPSTable(tuple(range(1, 65)), tuple(50.0 / (1 + 0.1 * b * b) for b in range(1, 65))),
]


@pytest.mark.parametrize("shape", [(1, 4), (2, 3), (3, 2)])
def test_matches_brute_force_when_unimodal(shape):
    rng = np.random.default_rng(shape[0] * 10 + shape[1])
    checked = 0
    for table in SMOOTH_TABLES:
        for _ in range(25):
            conf = rng.uniform(0.05, 1.0, size=shape).astype(np.float32)
            conf = np.where(rng.random(shape) < 0.3, rng.uniform(0.9, 1.0, shape), conf).astype(np.float32)
            active = rng.random(shape[0]) < 0.85
            active[0] = True
            if not is_unimodal(path_thetas(conf, active, table)):
                continue
            checked += 1
            lengths = np.asarray(_schedule(jnp.asarray(conf), jnp.asarray(active), table, "early_stop"))
            best, best_l = brute_force(conf, active, table)
            got = S.expected_throughput(conf, active, lengths, table)
            assert got == pytest.approx(best, rel=1e-5), (conf, active, lengths, best_l)
            np.testing.assert_array_equal(lengths, best_l)
            assert np.all(lengths[~active] == 0)
    assert checked >= 30  # most random cases are unimodal on these curves


def test_inactive_rows_consume_no_budget():
    rng = np.random.default_rng(0)
    table = tables.SPSTable(tuple(range(1, 41)), tuple(100.0 / max(1.0, b / 8.0) for b in range(1, 41)))
    conf = rng.uniform(0.3, 1.0, size=(6, 5)).astype(np.float32)
    active = np.array([True, False, True, True, False, True])
    full = np.asarray(_schedule(jnp.asarray(conf), jnp.asarray(active), table, "early_stop"))
    sub = np.asarray(_schedule(jnp.asarray(conf[active]), jnp.ones(4, bool), table, "early_stop"))
    np.testing.assert_array_equal(full[active], sub)
    assert np.all(full[~active] == 0)
    assert full.sum() > 0


# ---------------------------------------------------------------- non-anticipation


def _admissions(fn, conf):
    """1[l_r >= k] for every (r, k): [R, G] bool."""
    lengths = np.asarray(fn(conf))
    return np.arange(1, conf.shape[1] + 1)[None, :] <= lengths[:, None]


JAGGED = tables.SPSTable((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
                    (10.0, 9.9, 9.8, 6.0, 5.9, 5.8, 5.7, 5.6, 5.55, 3.0, 2.9, 2.8))


@pytest.mark.parametrize("policy_name", ["scheduler", "scheduler-async"])
def test_admission_never_depends_on_later_confidences(policy_name):
    """Whether x_rk is verified must not change when c_r,k+1.. (functions of x_rk) change."""
    policy = S.make_policy(policy_name, JAGGED)
    rng = np.random.default_rng(1)
    r, g = 3, 4
    state = policy.init_state(r, g)
    for _ in range(3):  # give the async variant a history
        _, state = _call_policy(policy, state, jnp.asarray(rng.uniform(0.2, 1, (r, g)), jnp.float32),
                                jnp.ones(r, bool))
    fn = lambda c: _call_policy(policy, state, jnp.asarray(c, jnp.float32), jnp.ones(r, bool))[0]
    for _ in range(40):
        conf = rng.uniform(0.2, 1.0, (r, g))
        base = _admissions(fn, conf)
        for row in range(r):
            for k in range(1, g):
                pert = conf.copy()
                pert[row, k:] = rng.uniform(0.0, 1.0, g - k)
                assert np.array_equal(_admissions(fn, pert)[row, :k], base[row, :k])


def test_early_stop_is_what_keeps_it_causal():
    """Appendix A numbers: without the break the choice for x_1 depends on c_2 (i.e. on x_1)."""
    table = tables.SPSTable((1, 2, 3), (1.0, 0.5, 0.45))
    active = jnp.ones(1, bool)
    for c2, retro in [(0.9, 2), (0.0, 0)]:
        conf = jnp.asarray([[0.8, c2]], jnp.float32)
        assert int(_schedule(conf, active, table, "unconstrained")[0]) == retro
        assert int(_schedule(conf, active, table, "early_stop")[0]) == 0
    # brute force agrees with the retrospective search here: Theta is not unimodal (1.0, 0.9, 1.134)
    best, best_l = brute_force(np.array([[0.8, 0.9]]), np.array([True]), table)
    assert best == pytest.approx(1.134) and best_l[0] == 2


# ---------------------------------------------------------------- exact output distributions


def first_token_distribution(policy, state, p_t, p_d, c1, c2_table):
    """Exact law of each row's first emitted token after one round of speculative sampling.

    Rows r have target/draft laws p_t[r], p_d[r] ([V]) at draft position 1, confidence c1[r]
    for position 1 and c2_table[r][x1] for position 2 (the Markov head reads x1). All joint
    draft outcomes (x_1 of every row) are enumerated; the verification of x_1 is standard speculative sampling.
    """
    r, v = p_t.shape
    out = np.zeros((r, v))
    for xs in itertools.product(range(v), repeat=r):
        prob = np.prod([p_d[i, xs[i]] for i in range(r)])
        conf = np.stack([[c1[i], c2_table[i][xs[i]]] for i in range(r)]).astype(np.float32)
        lengths, _ = _call_policy(policy, state, jnp.asarray(conf), jnp.ones(r, bool))
        for i in range(r):
            if int(lengths[i]) >= 1:
                x = xs[i]
                acc = min(1.0, p_t[i, x] / p_d[i, x])
                resid = np.maximum(p_t[i] - p_d[i], 0)
                resid = resid / resid.sum() if resid.sum() > 0 else p_t[i]
                dist = (1 - acc) * resid
                dist[x] += acc
            else:
                dist = p_t[i]
            out[i] += prob * dist
    return out


APPENDIX_SPS = tables.SPSTable((1, 2, 3), (1.0, 0.5, 0.45))


def test_appendix_a_counterexample():
    p_t, p_d = np.array([[0.7, 0.3]]), np.array([[0.5, 0.5]])
    c2 = [[0.9, 0.0]]  # x1 = A gives a confident continuation, x1 = B none
    retro = S.AsyncPrefixScheduler(APPENDIX_SPS, delay=0)
    got = first_token_distribution(retro, retro.init_state(1, 2), p_t, p_d, [0.8], c2)
    np.testing.assert_allclose(got[0], [0.85, 0.15], atol=1e-6)
    shipped = S.make_policy("scheduler", APPENDIX_SPS)
    got = first_token_distribution(shipped, shipped.init_state(1, 2), p_t, p_d, [0.8], c2)
    np.testing.assert_allclose(got[0], [0.7, 0.3], atol=1e-6)
    # the async variant, with any history (here: the very confidences that favour l=2)
    asy = S.make_policy("scheduler-async", APPENDIX_SPS)
    state = asy.init_state(1, 2)
    for _ in range(2):
        _, state = _call_policy(asy, state, jnp.asarray([[0.8, 0.9]], jnp.float32), jnp.ones(1, bool))
    lengths, _ = _call_policy(asy, state, jnp.asarray([[0.8, 0.05]], jnp.float32), jnp.ones(1, bool))
    assert int(lengths[0]) == 2  # capacity 2 from history, whatever the current c2
    got = first_token_distribution(asy, state, p_t, p_d, [0.8], c2)
    np.testing.assert_allclose(got[0], [0.7, 0.3], atol=1e-6)


@pytest.mark.parametrize("policy_name", ["scheduler", "scheduler-async"])
def test_first_token_law_is_target_law_multi_request(policy_name):
    rng = np.random.default_rng(7)
    policy = S.make_policy(policy_name, JAGGED)
    r, v = 2, 3
    state = policy.init_state(r, 2)
    for _ in range(2):
        _, state = _call_policy(policy, state, jnp.asarray(rng.uniform(0.3, 1, (r, 2)), jnp.float32),
                                jnp.ones(r, bool))
    for _ in range(4):
        p_t = rng.dirichlet(np.ones(v), size=r)
        p_d = rng.dirichlet(np.ones(v), size=r)
        c1 = rng.uniform(0.5, 1.0, r)
        c2 = rng.uniform(0.0, 1.0, (r, v))
        got = first_token_distribution(policy, state, p_t, p_d, c1, c2)
        np.testing.assert_allclose(got, p_t, atol=1e-6)


# ---------------------------------------------------------------- async capacity


def test_async_uses_old_capacity_and_current_ranking():
    table = SMOOTH_TABLES[0]
    pol = S.AsyncPrefixScheduler(table, delay=2)
    state = pol.init_state(2, 3)
    old = jnp.asarray([[0.99, 0.99, 0.99], [0.99, 0.99, 0.1]], jnp.float32)
    lengths0, state = _call_policy(pol, state, old, jnp.ones(2, bool))  # warm-up round: Algorithm 1
    np.testing.assert_array_equal(lengths0, _schedule(old, jnp.ones(2, bool), table, "early_stop"))
    _, state = _call_policy(pol, state, jnp.asarray(np.full((2, 3), 0.5), jnp.float32), jnp.ones(2, bool))
    k = int(S.count_unconstrained(*S.greedy_path(old, jnp.ones(2, bool), jnp.asarray(table.dense(9)))[1:]))
    cur = jnp.asarray([[0.2, 0.9, 0.9], [0.95, 0.95, 0.95]], jnp.float32)
    lengths, _ = _call_policy(pol, state, cur, jnp.ones(2, bool))
    assert int(lengths.sum()) == min(k, 6)
    a = np.cumprod(np.asarray(cur), 1)
    admitted = np.arange(3)[None] < np.asarray(lengths)[:, None]
    assert admitted.sum() == k and a[admitted].min() >= a[~admitted].max()  # top-k by current survival


# ---------------------------------------------------------------- SPS table + factory


def test_sps_table_interp_json_and_errors(tmp_path):
    t = tables.SPSTable((1, 4, 8), (10.0, 7.0, 4.0), meta={"device": "cpu"})
    np.testing.assert_allclose(t([1, 2, 4, 6, 8, 16]), [10, 9, 7, 5.5, 4, 2])
    path = tmp_path / "sps.json"
    t.save(path)
    with pytest.raises(InputError, match="exists"):
        t.save(path)
    t2 = tables.SPSTable.load(path)
    assert t2 == t and hash(t2) == hash(t) and t2.meta["device"] == "cpu"
    assert json.loads(path.read_text())["batch_sizes"] == [1, 4, 8]
    with pytest.raises(ConfigError, match="increasing"):
        tables.SPSTable((2, 1), (1.0, 1.0))
    with pytest.raises(ConfigError, match="> 0"):
        tables.SPSTable((1,), (0.0,))
    bad = tmp_path / "bad.json"
    bad.write_text('{"batch_sizes": [1]}')
    with pytest.raises(InputError, match="sps"):
        tables.SPSTable.load(bad)
    with pytest.raises(InputError, match="does not exist"):
        tables.SPSTable.load(tmp_path / "nope.json")


def test_make_policy(tmp_path):
    t = tables.SPSTable((1, 2), (2.0, 1.5))
    path = tmp_path / "s.json"
    t.save(path)
    assert isinstance(S.make_policy("scheduler", str(path)), S.PrefixScheduler)
    p = S.make_policy("scheduler-async:3", t)
    assert p.delay == 3 and hash(p) == hash(S.AsyncPrefixScheduler(t, 3))
    with pytest.raises(ConfigError, match="--sps"):
        S.make_policy("scheduler", None)
    with pytest.raises(ConfigError, match="unknown"):
        S.make_policy("schedule", t)
    with pytest.raises(ConfigError, match="delay"):
        S.make_policy("scheduler-async:0", t)


def test_profile_sps_command(tmp_path, tiny_dir):
    from dspark_jax.cli import main

    out = tmp_path / "sps.json"
    assert main(["profile-sps", "--target", str(tiny_dir / "target"), "--out", str(out),
                 "--batch-sizes", "1,3", "--cache-length", "8", "--iters", "1",
                 "--min-seconds", "0", "--warmup", "1"]) == 0
    table = tables.SPSTable.load(out)
    assert table.batch_sizes == (1, 3) and all(s > 0 for s in table.sps)
    assert table.meta["cache_length"] == 8 and table.meta["model"]["num_hidden_layers"] == 6
    assert main(["profile-sps", "--target", str(tiny_dir / "target"), "--out", str(out)]) == 2
    # default fit: convex latency, raw measurements kept; --fit none stores them as they are
    assert table.meta["fit"] == "convex" and table.interp == "latency" and len(table.meta["raw_sps"]) == 2
    assert table.fitted("convex") == table
    raw_out = tmp_path / "raw.json"
    assert main(["profile-sps", "--target", str(tiny_dir / "target"), "--out", str(raw_out),
                 "--batch-sizes", "2", "--cache-length", "8", "--iters", "1", "--repeats", "2",
                 "--min-seconds", "0", "--warmup", "1", "--fit", "none"]) == 0
    raw = tables.SPSTable.load(raw_out)
    assert raw.meta["fit"] == "none" and raw.interp == "sps" and list(raw.sps) == raw.meta["raw_sps"]
    assert raw.batch_sizes == (2,) and raw.meta["repeats"] == 2


def test_isotonic_fit():
    from dspark_jax.decode.tables import isotonic_decreasing
    np.testing.assert_allclose(isotonic_decreasing([5, 4, 6, 3, 3.5, 1]), [5, 5, 5, 3.25, 3.25, 1])
    y = np.random.default_rng(0).normal(size=30)
    fit = isotonic_decreasing(y)
    assert np.all(np.diff(fit) <= 1e-12) and fit.sum() == pytest.approx(y.sum())


# ---------------------------------------------------------------- fitted SPS curves


def _noisy_table(seed, n_max=40):
    """A roofline latency (flat, then linear) with multiplicative noise and a few false cliffs."""
    rng = np.random.default_rng(seed)
    sizes = np.array(sorted(set(np.r_[np.arange(1, 13), rng.integers(13, n_max + 1, 8)])))
    flat, slope = rng.uniform(0.5, 2.0), rng.uniform(0.02, 0.3)
    lat = np.maximum(flat, slope * sizes) * rng.lognormal(0.0, 0.25, sizes.size)
    lat[rng.choice(sizes.size, 3, replace=False)] *= 3.0  # contention spikes
    return sizes, 1.0 / lat


def _is_convex_nondecreasing(lat, tol=1e-9):
    d = np.diff(lat)
    return np.all(d >= -tol * lat[1:]) and np.all(np.diff(d) >= -tol * lat[2:])


@pytest.mark.parametrize("method", ["linear", "convex"])
def test_fit_gives_convex_nondecreasing_latency(method):
    for seed in range(6):
        sizes, sps = _noisy_table(seed)
        table = tables.fit_sps(sizes, sps, method, meta={"device": "x"})
        assert table.interp == "latency" and table.meta["fit"] == method and table.meta["device"] == "x"
        np.testing.assert_allclose(table.meta["raw_sps"], sps)
        b = np.arange(1, 3 * sizes[-1])  # inside the measured range and extrapolated past it
        assert _is_convex_nondecreasing(table.latency(b)), (seed, table.latency(b))
        # the fit follows the data: median relative error small despite the spikes
        rel = np.abs(table.latency(sizes) * sps - 1.0)
        assert np.median(rel) < 0.35


def test_fit_recovers_linear_latency_and_other_methods():
    sizes = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    true = 0.8 + 0.05 * sizes
    noisy = true * np.random.default_rng(1).lognormal(0, 0.03, sizes.size)  # noise within +-4%
    for method in ("linear", "convex"):
        t = tables.fit_sps(sizes, 1.0 / noisy, method)
        np.testing.assert_allclose(t.latency(sizes), true, rtol=0.06)
    t = tables.fit_sps(sizes, 1.0 / true, "linear")
    np.testing.assert_allclose(t.latency(np.arange(1, 33)), 0.8 + 0.05 * np.arange(1, 33), rtol=1e-6)
    # past the largest size: never more optimistic than a constant token rate (2.4 s / 32 tokens)
    np.testing.assert_allclose(t.latency([40, 64]), [2.4 + 8 * 0.075, 4.8], rtol=1e-6)
    jag = (10.0, 9.9, 11.0, 6.0, 5.9)
    none = tables.fit_sps((1, 2, 3, 4, 5), jag, "none")
    assert none.sps == jag and none.interp == "sps"
    mono = tables.fit_sps((1, 2, 3, 4, 5), jag, "monotone")
    assert mono.sps[0] == mono.sps[1] == mono.sps[2] == pytest.approx(10.3) and mono.interp == "sps"
    with pytest.raises(ConfigError, match="fit"):
        tables.fit_sps((1, 2), (1.0, 0.5), "cubic")


def test_fitted_table_json_roundtrip_and_refit_on_load(tmp_path):
    sizes, sps = _noisy_table(11)
    raw = tables.fit_sps(sizes, sps, "none", meta={"device": "cpu"})
    path = tmp_path / "raw.json"
    raw.save(path)
    assert tables.SPSTable.load(path) == raw
    conv = tables.SPSTable.load(path, fit="convex")
    assert conv == tables.fit_sps(sizes, sps, "convex") and conv != raw
    assert conv.meta["device"] == "cpu" and conv.meta["fit"] == "convex"
    conv.save(tmp_path / "conv.json")
    again = tables.SPSTable.load(tmp_path / "conv.json")
    assert again == conv and hash(again) == hash(conv) and again.interp == "latency"
    # refitting a fitted table starts from its raw measurements, not from the fit
    assert again.fitted("none") == raw and again.fitted("convex") == conv
    with pytest.raises(ConfigError, match="fit"):
        tables.SPSTable.load(path, fit="spline")
    with pytest.raises(ConfigError, match="interp"):
        tables.SPSTable((1,), (1.0,), interp="cubic")


@jax.jit
def _early_stop_traced(conf, active, dense):
    """``schedule(.., "early_stop")`` with the SPS lookup traced (one compile per shape, not per table)."""
    rank, valid, theta = S.greedy_path(conf, active, dense)
    return jnp.where(active, S.lengths_from_rank(rank, S.count_early_stop(valid, theta)), 0)


@pytest.mark.parametrize("method", ["linear", "convex"])
def test_algorithm1_equals_brute_force_on_fitted_curves(method):
    """On a fitted (convex non-decreasing latency) curve Theta is unimodal along the admission
    path for ANY confidences, so the early stop finds the global optimum: no filtering here."""
    rng = np.random.default_rng(5)
    for seed, shape in [(0, (1, 4)), (1, (2, 3)), (2, (3, 2)), (3, (3, 3)), (4, (2, 3))]:
        sizes, sps = _noisy_table(seed, n_max=16)
        table = tables.fit_sps(sizes, sps * 100, method)
        dense = jnp.asarray(table.dense(shape[0] * (shape[1] + 1) + 1))
        if seed == 0:  # the traced helper is the same computation as the public entry point
            conf = jnp.asarray(rng.uniform(0.3, 1.0, shape), jnp.float32)
            np.testing.assert_array_equal(_early_stop_traced(conf, jnp.ones(shape[0], bool), dense),
                                          _schedule(conf, jnp.ones(shape[0], bool), table, "early_stop"))
        for _ in range(12):
            conf = rng.uniform(0.02, 1.0, shape)
            conf = np.where(rng.random(shape) < 0.4, rng.uniform(0.9, 1.0, shape), conf).astype(np.float32)
            active = rng.random(shape[0]) < 0.85
            active[0] = True
            assert is_unimodal(path_thetas(conf, active, table))
            lengths = np.asarray(_early_stop_traced(jnp.asarray(conf), jnp.asarray(active), dense))
            best, _ = brute_force(conf, active, table)
            assert S.expected_throughput(conf, active, lengths, table) == pytest.approx(best, rel=1e-5)
            assert np.all(lengths[~active] == 0)


def test_raw_noisy_curve_can_trap_the_early_stop():
    """Why fitting matters: on a raw curve with a false cliff Algorithm 1 stops at the cliff."""
    table = tables.SPSTable((1, 2, 3, 4, 5), (100.0, 40.0, 95.0, 93.0, 91.0))  # spike at B = 2
    conf = jnp.asarray([[0.99, 0.99, 0.99, 0.99]], jnp.float32)
    active = jnp.ones(1, bool)
    assert int(_schedule(conf, active, table, "early_stop")[0]) == 0
    best, best_l = brute_force(np.asarray(conf), np.array([True]), table)
    assert best_l[0] == 4
    fitted = table.fitted("convex")
    assert int(_schedule(conf, active, fitted, "early_stop")[0]) == 4
