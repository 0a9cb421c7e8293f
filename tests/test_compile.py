"""torch_compile (issue 31): regional compilation of the repeated blocks through accelerate, with the same losses as
eager (fp32: within 1e-5 relative; compiled kernels may reorder float sums), under one process and under DDP with
the chunked loss; inductor really compiled (its cache fills); refused under Megatron-LM."""

from __future__ import annotations

import pytest
from conftest import base_args, finetune, max_rel_diff

from finetune.config import build_config

pytestmark = pytest.mark.xdist_group("compile")  # one worker: the eager reference and the compile cache are shared


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One inductor cache for this module's runs (the second compiles from it), never the user's."""
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture(scope="module")
def eager(assets, tmp_path_factory):
    return finetune(tmp_path_factory.mktemp("eager") / "run", *_args(assets), launcher="single")


def _args(assets, *more: str) -> list[str]:
    return base_args(assets.llama, assets.instruction, "--max_steps", "6", "--eval_fraction", "0", *more)


def test_one_process_compiled_equals_eager(assets, tmp_path, eager, cache):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    res = finetune(tmp_path / "run", *_args(assets, "--torch_compile", "true"), launcher="single", extra_env=env)
    assert "torch_compile: the first step took" in res.output, res.output[-2000:]
    assert any(p.is_file() for p in cache.rglob("*")), "inductor wrote nothing: nothing was compiled"
    want, got = eager.losses(), res.losses()
    assert len(want) == len(got) == 6
    assert max_rel_diff(want, got) <= 1e-5, (want, got)


def test_ddp_compiled_with_the_chunked_loss_equals_eager(assets, tmp_path, eager, cache):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    more = ("--per_device_train_batch_size", "2", "--torch_compile", "true", "--chunked_loss", "true")
    res = finetune(tmp_path / "run", *_args(assets, *more, "--loss_chunk_tokens", "40"), launcher="ddp", extra_env=env)
    assert "torch_compile: the first step took" in res.output and "chunked loss: up to 40 tokens" in res.output
    want, got = eager.losses(), res.losses()
    assert len(want) == len(got) == 6
    assert max_rel_diff(want, got) <= 1e-5, (want, got)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()  # the export found the model in its wrappers


def test_refused_under_megatron(tmp_path):
    from finetune.parallel.megatron import _model_option_problems

    values = {"model": "m", "dataset": "d.jsonl", "output_dir": str(tmp_path), "torch_compile": True}
    problems: list = []
    _model_option_problems(problems, build_config({**values, "chunked_loss": "true"}, check_filesystem=False))
    assert [key for key, _ in problems] == ["chunked_loss", "torch_compile"]
