"""Worker of tests/test_decode_multiprocess.py, one per process under launch/local.py.

    python launch/local.py -n 2 -m 2 -- python tests/decode_multiprocess_worker.py OUT_DIR

First ``dspark-jax generate --mesh data=2,tensor=2`` of OUT_DIR/prompts.jsonl into
OUT_DIR/generate.jsonl (the command joins ``jax.distributed`` from the launcher's environment, gloo
CPU collectives; process 0 writes). Then, in the same distributed run, the reference fixture's
prompts are decoded greedily on meshes spanning both processes (static and continuous batching,
speculative and autoregressive); what this process got goes to OUT_DIR/process_<i>.json:
{run name: {"output_ids": [...], "acceptance_lengths": [...]}}.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from dspark_jax import cli, sharding
from dspark_jax.convert.checkpoint import load_draft, load_target
from dspark_jax.decode import autoregressive_generate, engine, sharded, speculative_generate

TINY = Path(__file__).resolve().parent / "fixtures" / "dspark_qwen3_tiny"


def meshes():
    """(name, mesh) of the layouts over 2 processes x 2 devices (the fixture's 2 KV heads allow
    tensor <= 2): data across processes, and tensor across processes."""
    devices = jax.devices()  # process-major: [p0d0, p0d1, p1d0, p1d1]
    assert jax.process_count() == 2 and len(devices) == 4, (jax.process_count(), devices)
    a = sharded.make_decode_mesh("data=2,tensor=2")
    assert [d.process_index for d in a.devices[:, 0, 0]] == [0, 1]       # data spans processes
    b = Mesh(np.asarray(devices, dtype=object).reshape(2, 1, 2).transpose(2, 1, 0), sharding.MESH_AXES)
    assert [d.process_index for d in b.devices[0, 0, :]] == [0, 1]       # tensor spans processes
    return [("data2_tensor2", a), ("tensor2_across_processes", b)]


def main(out: str) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    ref = json.loads((TINY / "decode_greedy.json").read_text())
    prompts, r, n = ref["prompts"], ref["max_new_tokens"], len(ref["prompts"])
    rc = cli.main(["generate", "--target", str(TINY / "target"), "--draft", str(TINY / "draft"),
                   "--prompts", f"{out}/prompts.jsonl", "--out", f"{out}/generate.jsonl",
                   "--mesh", "data=2,tensor=2", "--batch-size", "4", "--max-new-tokens", str(r),
                   "--stop-token-ids"])
    assert rc == 0 and jax.process_count() == 2, (rc, jax.process_count())
    tc, tp = load_target(TINY / "target")
    dc, dp = load_draft(TINY / "draft")
    got = {}

    def keep(name, results):
        got[name] = {"output_ids": [x.output_ids for x in results],
                     "acceptance_lengths": [x.acceptance_lengths for x in results]}

    # (the generate command above is speculative continuous batching on data=2,tensor=2)
    for (name, mesh), loop in zip(meshes(), ("device", "host")):
        keep(f"{name}/spec/static-{loop}-loop", speculative_generate(
            tc, tp, dc, dp, prompts, max_new_tokens=r, batch_size=n, mesh=mesh, loop=loop))
    name, mesh = meshes()[1]
    keep(f"{name}/spec/continuous", engine.serve(tc, tp, dc, dp, prompts, max_new_tokens=r,
                                                 slots=4, mesh=mesh, order=list(range(n))[::-1]))
    name, mesh = meshes()[0]
    keep(f"{name}/ar/static", autoregressive_generate(tc, tp, prompts, max_new_tokens=r, batch_size=n,
                                                      mesh=mesh))
    keep(f"{name}/ar/continuous", engine.serve(tc, tp, None, None, prompts, max_new_tokens=r, slots=2,
                                               mesh=mesh))
    path = Path(out) / f"process_{jax.process_index()}.json"
    path.write_text(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1])
