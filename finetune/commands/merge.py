"""`finetune merge`: an adapter and its base model -> one plain model directory."""

from __future__ import annotations

import argparse
import json
import os
import sys

from finetune.config import ConfigError


def main(argv: list[str]) -> int:
    """`finetune merge ADAPTER_DIR [--base_model PATH_OR_ID [--allow_other_base]] [--output DIR [--overwrite]]
    [--dtype D]`: base model + adapter -> one plain model directory."""
    args = _parser().parse_args(argv)
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
        from finetune.export import MERGE_MARKER, merge_adapter

        out = args.output or os.path.join(args.adapter, "merged")
        out = merge_adapter(
            args.adapter,
            out,
            dtype=args.dtype,
            overwrite=args.overwrite,
            base_model=args.base_model,
            allow_other_base=args.allow_other_base,
        )
    except ConfigError as e:
        print(e.render("what finetune merge was given"), file=sys.stderr)
        return 2
    with open(os.path.join(out, MERGE_MARKER)) as f:
        print(f"base model weights: {json.load(f)['base_weights']}")
    print(f"merged model saved to {os.path.abspath(out)} (load it with from_pretrained)")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line of `finetune merge` (main's docstring is its description)."""
    parser = argparse.ArgumentParser(prog="finetune merge", description=main.__doc__)
    parser.add_argument("adapter", help="an adapter directory written by finetune (e.g. outputs/run/final)")
    parser.add_argument(
        "--base_model",
        metavar="PATH_OR_ID",
        help="the base model to merge into: a local model directory or a Hub id (default: base_model_name_or_path in "
        "ADAPTER/adapter_config.json, which is left as it is); for an adapter trained on another machine, or a base "
        "model that has moved. It must be the model the adapter was trained on: one whose modules or shapes do not "
        "fit the adapter is refused, and so is one whose weights are not those the adapter was trained on (finetune "
        "records a fingerprint of them in ADAPTER/base_model.json; without one the merge says it could not verify)",
    )
    parser.add_argument(
        "--allow_other_base",
        action="store_true",
        help="merge into a base model whose weights differ from those the adapter was trained on, on purpose (a "
        "sibling fine-tune of the same architecture); its modules and shapes must still fit",
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
    return parser
