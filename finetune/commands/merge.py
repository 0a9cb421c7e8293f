"""`finetune merge`: an adapter and its base model -> one plain model directory."""

from __future__ import annotations

import argparse
import os
import sys

from finetune.config import ConfigError


def main(argv: list[str]) -> int:
    """`finetune merge ADAPTER_DIR [--base_model PATH_OR_ID] [--output DIR [--overwrite]] [--dtype D]`: base model +
    adapter -> one plain model directory."""
    parser = argparse.ArgumentParser(prog="finetune merge", description=main.__doc__)
    parser.add_argument("adapter", help="an adapter directory written by finetune (e.g. outputs/run/final)")
    parser.add_argument(
        "--base_model",
        metavar="PATH_OR_ID",
        help="the base model to merge into: a local model directory or a Hub id (default: base_model_name_or_path in "
        "ADAPTER/adapter_config.json, which is left as it is); for an adapter trained on another machine, or a base "
        "model that has moved. It must be the model the adapter was trained on: one whose modules or shapes do not "
        "fit the adapter is refused",
    )
    parser.add_argument(
        "--output",
        help="where to write the merged model: a new or empty directory (default: ADAPTER/merged, where a previous "
        "merge is replaced)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a previous merge at --output (a directory finetune merge wrote: it holds finetune_merge.json); "
        "any other files there are never replaced",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="what the merged weights are written in (default: the run's save_dtype, as final/ was written; auto: "
        "the base model's own dtype)",
    )
    args = parser.parse_args(argv)
    try:
        if not os.path.isfile(os.path.join(args.adapter, "adapter_config.json")):
            raise ConfigError(
                [
                    (
                        "adapter",
                        f"{args.adapter!r} has no adapter_config.json; give the final/ directory of an adapter run",
                    )
                ]
            )
        from finetune.export import merge_adapter

        out = args.output or os.path.join(args.adapter, "merged")
        out = merge_adapter(args.adapter, out, dtype=args.dtype, overwrite=args.overwrite, base_model=args.base_model)
    except ConfigError as e:
        print(e.render("what finetune merge was given"), file=sys.stderr)
        return 2
    print(f"merged model saved to {os.path.abspath(out)} (load it with from_pretrained)")
    return 0
