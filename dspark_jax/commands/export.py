"""`dspark-jax export DRAFT DST --engine ...`: a drafter checkpoint a serving engine loads unchanged."""

from __future__ import annotations

import argparse
import json

HELP = "write a drafter the way vLLM / SGLang / sglang-jax / DeepSpec load it (or say why not)"
DESCRIPTION = """\
Export a drafter (dspark-jax or Hugging Face format) for one serving engine:

  deepspec    the PyTorch reference (Qwen3DSparkModel / Gemma4DSparkModel.from_pretrained)
  vllm        --speculative-config '{"method": "dspark", "model": DST}'   (Qwen3, Gemma4)
  sglang      --speculative-algorithm DSPARK --speculative-draft-model-path DST   (Qwen3 only)
  sglang-jax  --speculative-algorithm DSPARK --speculative-draft-model-path DST   (Qwen3 only)
  speculators speculators' DSparkDraftModel.from_pretrained(DST) (its config, aux ids = ours + 1)
  specforge   SpecForge's DSparkDraftModel.from_pretrained(DST) (dflash_config; no embed_tokens /
              lm_head: `convert --from specforge DST --target TARGET` brings it back)

The engine's load rules (read from its loader code; see dspark_jax/convert/engines.py) are
checked first: a drafter it cannot load is refused with the rule that fails, and nothing is
written. The export carries the config fields that engine reads (architectures,
target_layer_ids and dflash_config.target_layer_ids, n_predict, mask_token_id), weight files
readable by every user (0644), and beside them SGLang's STS calibration (dspark_sts.json, when
the drafter carries STS temperatures from `calibrate --write-draft`) and SPS table
(dspark_sps.json, from --sps FILE written by `profile-sps`). Written atomically; an existing
DST is refused unless --force.

DeepSeek-V4's own DSpark module (vllm, sglang): DST is the V4 checkpoint (--target, or DRAFT
when it is one) with its mtp.* tensors and dspark_* keys replaced by DRAFT's module, stored as
the target stores its own layers (in an FP8 checkpoint: FP8 e4m3 with ue8m0 block scales, the
experts in its expert dtype, e.g. MXFP4); the target's tensor files are hard-linked or copied
byte for byte.
"""


def register(subparsers) -> None:
    from dspark_jax.convert.engines import TARGETS

    p = subparsers.add_parser("export", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("draft", metavar="DRAFT", help="drafter checkpoint directory (either format)")
    p.add_argument("dst", metavar="DST", help="output directory (must not exist unless --force)")
    p.add_argument("--engine", required=True, choices=TARGETS,
                   help="serving engine (or trainer) to export for")
    p.add_argument("--sps", default=None, metavar="FILE",
                   help="profile-sps JSON (batch_sizes, sps): written as the SGLang SPS table")
    p.add_argument("--target", default=None, metavar="DIR",
                   help="DeepSeek-V4 only: the V4 checkpoint DRAFT's DSpark module (mtp.*) is written "
                        "into (default: DRAFT itself when it is a whole V4 checkpoint); its tensors "
                        "are linked or copied, never rewritten")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark_jax.convert import export
    from dspark_jax.fileio import check_output

    check_output(args.dst, force=args.force, kind="dir", flag="DST",
                 inputs={"DRAFT": args.draft, "--sps": args.sps, "--target": args.target})
    summary = export.export_draft(args.draft, args.dst, args.engine, force=args.force, sps=args.sps,
                                   target=args.target)
    print(f"wrote {args.engine} drafter ({summary['architecture']}, {summary['tensors']} tensors, "
          f"{summary['bytes']} bytes{', ' + ', '.join(summary['sidecars']) if summary['sidecars'] else ''}) "
          f"to {summary['dst']}")
    for w in summary["warnings"]:
        print(f"note: {w}")
    print(json.dumps(summary))
    return 0
