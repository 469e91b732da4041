"""`dspark-jax convert SRC DST`: PyTorch/HF checkpoint directories <-> the dspark-jax format."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "convert a drafter or target (Qwen3, Gemma4, DeepSeek-V4) between PyTorch (HF) and dspark-jax formats"
DESCRIPTION = """\
Convert a checkpoint directory, in either direction:

  torch -> jax   a Hugging Face directory (config.json + model.safetensors, or a sharded
                 model.safetensors.index.json) to the dspark-jax format (dspark_jax.json +
                 an orbax params/ tree);
  jax -> torch   back to a Hugging Face directory that the PyTorch reference
                 (Qwen3DSparkModel / Gemma4DSparkModel.from_pretrained) or transformers
                 (Qwen3ForCausalLM, Gemma4ForCausalLM, Gemma4UnifiedForCausalLM) loads.

The model family and kind (from config.json 'architectures': drafters 'Qwen3DSparkModel',
'Gemma4DSparkModel'; targets 'Qwen3ForCausalLM', 'Gemma4ForCausalLM', 'Gemma4UnifiedForCausalLM')
and the source format are detected. A multimodal Gemma4 checkpoint
('Gemma4[Unified]ForConditionalGeneration') is read as its text model (weights under
model.language_model., vision/audio towers ignored) and written back as the text CausalLM. Every tensor is checked against the config before conversion; values are copied
bit-exactly unless --dtype casts them. The output is written to a temporary directory next to
DST and renamed at the end, so a failure leaves nothing behind; an existing DST is refused
unless --force. Tokenizer and generation_config.json files are copied along.

Every conversion goes one stored tensor at a time (one layer's, one expert's): host memory holds
a few tensors, not the model, so a checkpoint larger than RAM converts (pickled *.bin weights
are read whole). DeepSeek-V4
('DeepseekV4ForCausalLM', upstream or transformers layout): FP8 (e4m3, 128x128 ue8m0 block
scales) and MXFP4 experts are dequantized, 'mtp.*' tensors are kept byte for byte in
aside.safetensors, and '--to torch --quantize fp8' writes the released format back (FP8 weights,
routed experts in --expert-dtype).
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("convert", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="source checkpoint directory (either format)")
    p.add_argument("dst", metavar="DST", help="destination directory (must not exist unless --force)")
    p.add_argument("--to", choices=("torch", "jax"), default=None,
                   help="output format (default: the other one than SRC's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="cast every tensor to this dtype (default: keep the stored dtype)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept PyTorch pickle weights (*.bin/*.pt), read with torch.load(weights_only=True)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert tensors holding NaN/inf unchanged, with a warning (default: refused)")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="torch output only: split model.safetensors into shards of at most SIZE "
                        "(e.g. 2GB, 500MB) with a model.safetensors.index.json")
    p.add_argument("--quantize", choices=("fp8",), default=None,
                   help="torch output of DeepSeek-V4 only: store the weights the released checkpoints store "
                        "quantized as FP8 (e4m3, ue8m0 128x128 block scales) and the routed experts in "
                        "--expert-dtype (default: unquantized)")
    p.add_argument("--expert-dtype", choices=("fp4", "fp8"), default=None,
                   help="with --quantize: routed experts as MXFP4 (fp4: two e2m1 per byte, one ue8m0 scale "
                        "per 32) or FP8 (default: the source config's expert_dtype, else fp4 as released)")
    p.add_argument("--from", dest="from_format", choices=("specforge", "speculators"), default=None,
                   help="SRC is a SpecForge DSparkDraftModel or a speculators-format DSpark drafter "
                        "(imported through the reference layout; see dspark_jax/convert/foreign.py)")
    p.add_argument("--target", default=None, metavar="DIR",
                   help="with --from: the Qwen3 target (HF format) supplying embed_tokens/lm_head and "
                        "its layer count")
    p.add_argument("--num-target-layers", type=int, default=None,
                   help="with --from speculators and no --target: the target's layer count")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark_jax.convert import bounded, checkpoint, formats, safetensors_io
    from dspark_jax.errors import InputError
    from dspark_jax.fileio import check_output

    if not Path(args.src).is_dir():
        raise InputError(f"SRC {str(args.src)!r} is not a directory")
    # DST must not be SRC or hold it: --force replaces DST, which would delete the source
    check_output(args.dst, force=args.force, kind="dir", flag="DST",
                 inputs={"SRC": args.src, "--target": args.target})

    if args.max_shard_size is not None:
        safetensors_io.parse_size(args.max_shard_size)  # fail fast on a bad size
    if args.from_format:
        to = args.to or "jax"
        checkpoint.convert_foreign(args.src, args.dst, args.from_format, target=args.target,
                                   num_target_layers=args.num_target_layers, to=to, force=args.force,
                                   dtype=args.dtype)
        info = checkpoint.describe(args.dst)
        print(json.dumps({"event": "convert", "src": str(args.src), "src_format": args.from_format,
                          "dst": info["path"], "format": to, "kind": info["kind"],
                          "files": info["files"], "bytes": info["bytes"]}))
        return 0
    src_format = formats.detect_format(args.src)
    if args.expert_dtype and not args.quantize:
        raise InputError("--expert-dtype goes with --quantize fp8")
    to = bounded.convert_bounded(args.src, args.dst, to=args.to, force=args.force, allow_pickle=args.allow_pickle,
                                 dtype=args.dtype, max_shard_size=args.max_shard_size,
                                 allow_nonfinite=args.allow_nonfinite, quantize=args.quantize,
                                 expert_dtype=args.expert_dtype)
    info = checkpoint.describe(args.dst)
    print(f"wrote {info['kind']} checkpoint ({to} format, {info['files']} files, "
          f"{info['bytes']} bytes) to {info['path']}")
    print(json.dumps({"event": "convert", "src": str(args.src), "src_format": src_format,
                      "dst": info["path"], "format": to, "kind": info["kind"],
                      "dtype": args.dtype, "files": info["files"], "bytes": info["bytes"]}))
    return 0
