"""``flatshard export CKPT OUT.safetensors``: a sharded checkpoint -> one safetensors file.

Runs in one process without a process group; reads the checkpoint's shards in bounded batches
and streams them into the file (see ``flatshard.checkpoint.exporting``).
"""

from __future__ import annotations

import argparse
import sys

from flatshard.checkpoint.exporting import DEFAULT_BATCH_BYTES, export_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flatshard export",
        description="Write a flatshard checkpoint's parameters and buffers (full shapes, "
        "original names) into one safetensors file, loadable by the plain model's "
        "load_state_dict.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory written by fs.save")
    parser.add_argument("out", help="output .safetensors file (written atomically)")
    parser.add_argument(
        "--hf",
        action="store_true",
        help="write OUT as a Hugging Face from_pretrained directory (needs --config)",
    )
    parser.add_argument("--config", help="with --hf: the model's config.json or its directory")
    parser.add_argument("--max-shard-size", default="5GB", help="with --hf (default: 5GB)")
    parser.add_argument(
        "--batch-mb",
        type=int,
        default=DEFAULT_BATCH_BYTES >> 20,
        help="read at most this many MiB of parameters at a time (default: %(default)s)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.batch_mb <= 0:
        print(f"flatshard export: --batch-mb={args.batch_mb} must be positive", file=sys.stderr)
        return 2
    if args.hf and not args.config:
        print("flatshard export --hf: pass --config (the model's config.json)", file=sys.stderr)
        return 2
    try:
        if args.hf:
            from flatshard.checkpoint.pretrained import export_pretrained

            out = export_pretrained(
                args.checkpoint, args.out, config=args.config,
                max_shard_size=args.max_shard_size, batch_bytes=args.batch_mb << 20,
            )  # fmt: skip
        else:
            out = export_checkpoint(args.checkpoint, args.out, batch_bytes=args.batch_mb << 20)
    except (ValueError, OSError) as err:
        print(f"flatshard export: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
