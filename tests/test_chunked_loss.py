"""The chunked linear + cross-entropy loss (finetune/chunked_loss.py) and torch_compile (issue 31), against one
eager process with transformers' loss.

The chunked loss: the same loss and gradients as transformers' unchunked one, and the same per-step losses under
every layout (fp32: within 1e-5 relative), with LoRA on the head too. torch_compile: regional compilation through
accelerate, with the chunked loss under DDP, within 1e-5 of eager (compiled kernels may reorder float sums);
inductor really compiled (its cache fills); refused under Megatron-LM."""

from __future__ import annotations

import pytest
import torch
from conftest import EXPECTED, ROOT, base_args, finetune, max_rel_diff, max_weight_diff

from finetune import chunked_loss
from finetune.config import ConfigError, build_config
from finetune.metrics import per_example_stats

pytestmark = pytest.mark.xdist_group("chunked_loss")  # one worker: the eager reference runs once


def _model(path: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _loss_and_grads(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads
    return loss.item(), grads


def _batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 20), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100  # the prompt
    labels[2, 15:] = -100  # padding
    mask = torch.ones_like(ids)
    mask[2, 15:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("chunk, micro_batch_tokens", [(7, 60), (16, 60), (8, 200)])  # 200: empty chunks too
def test_same_loss_and_gradients_as_transformers(assets, chunk, micro_batch_tokens):
    plain, chunked = _model(assets.llama), _model(assets.llama)
    pieces = chunked_loss.install(chunked, chunk, micro_batch_tokens, micro_batch_tokens)
    assert pieces == -(-micro_batch_tokens // chunk) and pieces > 1
    batch = _batch(plain.config.vocab_size)
    want, want_grads = _loss_and_grads(plain, batch)
    got, got_grads = _loss_and_grads(chunked, batch)
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)
    assert want_grads.keys() == got_grads.keys()
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=1e-5, atol=1e-7), name
    with torch.no_grad():
        # generation (and any forward without ROW_NLL) keeps transformers' forward, with its logits
        logits = plain(**batch).logits
        assert torch.equal(chunked(**batch).logits, logits)
        # evaluation: each row's summed NLL, with one chunk's logits at a time, equal to the sums from whole logits
        heads = []
        chunked.lm_head.register_forward_hook(lambda module, args, out: heads.append(tuple(out.shape)))
        labels = batch["labels"]
        got = chunked(**batch, **{chunked_loss.ROW_NLL: True})["nll"]
        want = per_example_stats(logits, labels, "causal_lm")["nll"]
    assert len(heads) == pieces and max(rows for rows, _ in heads) <= chunk, heads
    assert got.shape == want.shape == (3,) and torch.allclose(got, want, rtol=1e-6), (got, want)
    # the run's evaluation asks for it (every backend's eval_stats is this one, Megatron-LM's aside)
    from types import SimpleNamespace

    from finetune.parallel import ddp

    backend = ddp.Backend(SimpleNamespace(unwrap_model=lambda m, **kw: m, mixed_precision="no"), None, None)
    heads.clear()
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        stats = backend.eval_stats(chunked, inputs, labels, "causal_lm")
    assert len(heads) == pieces and max(rows for rows, _ in heads) <= chunk, heads
    assert torch.equal(stats["nll"], got) and stats["count"].tolist() == [14, 14, 9]


def test_preference_answer_logps_chunked_with_and_without_gradients(assets):
    """Preference tuning's answer log-probs (backend.answer_logps: each row's summed log-prob of its labelled tokens)
    under the chunked loss: the head called a chunk at a time, the same sums, counts and gradients as
    preference.sequence_logps over the whole logits; without gradients (the references) too."""
    from types import SimpleNamespace

    from finetune.parallel import ddp
    from finetune.preference import sequence_logps

    plain, chunked = _model(assets.llama), _model(assets.llama)
    pieces = chunked_loss.install(chunked, 7, 60, 30)
    backend = ddp.Backend(SimpleNamespace(unwrap_model=lambda m, **kw: m, mixed_precision="no"), None, None)
    batch = _batch(plain.config.vocab_size)
    inputs, labels = {k: batch[k] for k in ("input_ids", "attention_mask")}, batch["labels"]
    heads = []
    chunked.lm_head.register_forward_hook(lambda module, args, out: heads.append(tuple(out.shape)))
    for grad in (True, False):
        plain.zero_grad(set_to_none=True), chunked.zero_grad(set_to_none=True), heads.clear()
        with torch.set_grad_enabled(grad):
            want, want_n = sequence_logps(plain(**inputs).logits, labels)
            got, got_n = backend.answer_logps(chunked, inputs, labels)
        assert len(heads) == pieces and max(rows for rows, _ in heads) <= 7, heads  # one pass, no recomputation yet
        assert got_n.tolist() == want_n.tolist() == [14, 14, 9]
        assert torch.allclose(got, want, rtol=1e-6), (got, want)
        if grad:
            (got * torch.tensor([1.0, -2.0, 0.5])).sum().backward()  # rows weighted apart, as a pair loss does
            (want * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
            assert len(heads) == 2 * pieces  # each chunk's logits rebuilt in backward
            grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
            assert grads and grads.keys() == {n for n, p in chunked.named_parameters() if p.grad is not None}
            for name, p in chunked.named_parameters():  # summed rows: gradients up to ~7, rounding ~1e-6
                if p.grad is not None:
                    assert (p.grad - grads[name]).abs().max() <= 1e-6 * grads[name].abs().max(), name


def _collated(vocab: int, positions: bool = True) -> dict:
    """_batch's rows through the run's collator (padding to a multiple of 8, its batch facts popped as the loop
    pops them): a prompt of 6 tokens and padding are not learned."""
    from finetune.data import BATCH_FACTS, Collator

    raw = _batch(vocab)
    rows = [
        {"input_ids": ids[mask.bool()].tolist(), "labels": lab[mask.bool()].tolist()}
        for ids, lab, mask in zip(raw["input_ids"], raw["labels"], raw["attention_mask"])
    ]
    batch = Collator(0, positions=positions)(rows)
    for fact in BATCH_FACTS:
        batch.pop(fact)
    return batch


def test_the_collator_gives_the_supervised_positions_of_a_causal_lm_batch(assets):
    """The flat indices of the positions whose next token is learned, found here from the labels, row by row."""
    from finetune.data import Collator

    batch = _collated(100)
    labels = batch["labels"]
    rows, width = labels.shape
    assert width == 24  # padded to a multiple of 8
    want = [r * width + t for r in range(rows) for t in range(width - 1) if labels[r, t + 1] != -100]
    assert want and len(want) == 14 + 14 + 9
    assert batch[chunked_loss.POSITIONS].tolist() == want
    assert chunked_loss.POSITIONS not in _collated(100, positions=False)  # a model without finetune's loss forward
    seq2seq = Collator(0, encoder_decoder=True, positions=True)([{"input_ids": [5, 6], "labels": [7, 8]}])
    classes = Collator(0, positions=True)([{"input_ids": [5, 6], "labels": 1}])
    assert chunked_loss.POSITIONS not in seq2seq and chunked_loss.POSITIONS not in classes


@pytest.mark.parametrize("chunked", [False, True])
def test_the_head_runs_on_the_supervised_positions_only(assets, chunked):
    """With the collator's positions the LM head's forward sees exactly the learned positions (chunked or not; eval
    chunked either way), and the loss, every gradient and each row's eval NLL are transformers' own from the whole
    logits; a micro batch with nothing to learn gives 0 and still calls the head as often (under ZeRO-3 each call
    is a collective)."""
    plain, ours = _model(assets.llama), _model(assets.llama)
    pieces = chunked_loss.install(ours, 7, 60, 60, chunked=chunked)
    assert pieces == (9 if chunked else 1)
    batch = _collated(plain.config.vocab_size)
    n_learned = batch[chunked_loss.POSITIONS].numel()
    rows = []
    ours.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    inputs = {k: v for k, v in batch.items() if k != chunked_loss.POSITIONS}
    want, want_grads = _loss_and_grads(plain, inputs)
    ours.zero_grad(set_to_none=True)
    loss = ours(**batch).loss
    assert len(rows) == pieces and sum(rows) == n_learned == 37, rows  # the forward: the learned rows only
    loss.backward()
    got_grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert abs(loss.item() - want) <= 1e-6 * abs(want), (loss.item(), want)
    assert want_grads and want_grads.keys() == got_grads.keys()
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=1e-5, atol=1e-7), name
    with torch.no_grad():
        rows.clear()
        got = ours(**batch, **{chunked_loss.ROW_NLL: True})["nll"]
        assert len(rows) == 9 and sum(rows) == n_learned, rows  # without gradients chunked either way
        want_nll = per_example_stats(plain(**inputs).logits, batch["labels"], "causal_lm")["nll"]
    assert got.shape == want_nll.shape == (3,) and torch.allclose(got, want_nll, rtol=1e-6), (got, want_nll)
    nothing = torch.full_like(batch["labels"], -100)
    rows.clear()
    positions = chunked_loss.supervised_positions(nothing)
    loss = ours(**{**batch, "labels": nothing, chunked_loss.POSITIONS: positions}).loss
    assert positions.numel() == 0 and loss.item() == 0.0 and len(rows) == pieces and sum(rows) == 0
    loss.backward()  # the head took part: its gradient is zero, not missing


@pytest.mark.parametrize("how", ["lora on the head", "modules_to_save"])
def test_adapters_on_the_head(assets, how):
    """LoRA on lm_head and a fully trained lm_head (modules_to_save) run their own forward inside the chunks."""
    from peft import LoraConfig, get_peft_model

    if how == "lora on the head":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    else:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    plain = get_peft_model(_model(assets.llama), config)
    base = _model(assets.llama)
    chunked_loss.install(base, 9, 60, 60)
    chunked = get_peft_model(base, config)
    chunked.load_state_dict(plain.state_dict())  # the same adapter weights
    batch = _batch(plain.config.vocab_size)
    want, want_grads = _loss_and_grads(plain, batch)
    got, got_grads = _loss_and_grads(chunked, batch)
    assert abs(got - want) <= 1e-6 * abs(want)
    assert any("lm_head" in n for n in want_grads), sorted(want_grads)  # the head itself learns
    assert want_grads.keys() == got_grads.keys()
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=1e-5, atol=1e-7), name


def test_where_it_is_refused_or_off():
    llama_1b = ("llama", "causal_lm", 128_256, 2048, 1_235_814_400)  # Llama 3.2 1B's shape
    assert chunked_loss.wanted("auto", *llama_1b)
    assert not chunked_loss.wanted("false", *llama_1b)
    small_vocab = ("llama", "causal_lm", 8_192, 2048, 1_000_000_000)
    assert not chunked_loss.wanted("auto", *small_vocab)  # its logits are small
    assert chunked_loss.wanted("true", *small_vocab)
    head_heavy = ("llama", "causal_lm", 128_256, 512, 93_000_000)  # bench/loss_memory.py's model
    assert chunked_loss.extra_cost(*head_heavy[2:]) > chunked_loss.AUTO_MAX_COST
    assert not chunked_loss.wanted("auto", *head_heavy)  # the extra head forward would cost over 10%
    assert not chunked_loss.wanted("auto", "gemma2", "causal_lm", 256_000, 2304, 2_600_000_000)
    for model_type, task in (("gemma2", "causal_lm"), ("bert", "classification")):
        with pytest.raises(ConfigError) as refused:
            chunked_loss.wanted("true", model_type, task, 256_000, 2304, 2_600_000_000)
        assert refused.value.problems[0][0] == "chunked_loss"


def test_auto_decides_from_full_sizes_as_the_planner_does(assets):
    """The run's auto decision reads the sizes the planner reads, also from a ZeRO-3 rank's model, whose
    parameters hold only their partition (zero.Init: an empty tensor and the full size in ds_numel)."""
    from finetune.memory.estimate import ModelShape
    from finetune.model import full_sizes
    from finetune.parallel import ddp, deepspeed

    model = _model(assets.llama)
    shape = ModelShape.of_model(model, model.config, 4)
    want = (shape.vocab, shape.hidden, shape.total)
    whole, zero3 = ddp.Backend.__new__(ddp.Backend), deepspeed.Backend.__new__(deepspeed.Backend)
    assert min(want) > 0 and full_sizes(model, whole.numel) == want
    for p in model.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    assert full_sizes(model, zero3.numel) == want
    assert full_sizes(model, whole.numel) != want  # a layout's own numel is what makes it right


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """One process, transformers' loss: what every layout with the chunked loss must equal."""
    out = tmp_path_factory.mktemp("chunked") / "reference"
    res = finetune(out, *_args(assets), "--chunked_loss", "false")
    assert "chunked loss:" not in res.output
    return res


def _args(assets, *more: str) -> list[str]:
    return base_args(assets.llama, assets.instruction, "--max_steps", "5", "--eval_fraction", "0.1", *more)


def _assert_same_eval(want, got) -> None:
    """The final eval loss (the chunked loss computes it too, a chunk at a time) within 1e-5 of the reference's."""
    assert want.eval_rows and got.eval_rows
    assert got.eval_rows[-1]["eval_loss"] == pytest.approx(want.eval_rows[-1]["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("launcher", ["zero3", "fsdp2", "tp2"])  # DDP: with torch_compile below
def test_every_layout_equals_one_process_without_it(assets, tmp_path, reference, launcher):
    per_device = "4" if launcher == "tp2" else "2"  # tensor parallel ranks share their batch: global batch 4 each
    res = finetune(
        tmp_path / launcher,
        *_args(assets, "--per_device_train_batch_size", per_device, "--chunked_loss", "true"),
        "--loss_chunk_tokens",
        "40",
        launcher=launcher,
    )
    assert "chunked loss: up to 40 tokens per chunk, " in res.output, res.output[-2000:]
    if launcher in EXPECTED:
        assert res.train_rows[-1]["world_size"] == EXPECTED[launcher][1]
    want, got = reference.losses(), res.losses()
    assert len(want) == len(got) == 5
    assert max_rel_diff(want, got) <= 1e-5, (want, got)
    _assert_same_eval(reference, res)


def test_lora_on_the_head_under_zero3_equals_one_process(assets, tmp_path):
    """ZeRO-3 shards the head: each chunk's call gathers its whole weight (a fused loss reading lm_head.weight would
    see the empty local shard)."""
    peft = (
        "--peft.method",
        "lora",
        "--peft.r",
        "4",
        "--peft.alpha",
        "8",
        "--peft.target_modules",
        "q_proj,v_proj,lm_head",
    )
    args = _args(assets, *peft)
    one = finetune(tmp_path / "one", *args, "--chunked_loss", "false")
    zero3 = finetune(
        tmp_path / "zero3",
        *args,
        "--per_device_train_batch_size",
        "2",
        "--chunked_loss",
        "true",
        "--loss_chunk_tokens",
        "40",
        launcher="zero3",
    )
    assert "chunked loss: up to 40 tokens per chunk, " in zero3.output
    want, got = one.losses(), zero3.losses()
    assert len(want) == len(got) == 5
    assert max_rel_diff(want, got) <= 1e-5, (want, got)
    _assert_same_eval(one, zero3)
    assert want[-1] < want[0]  # it learned


def test_the_planner_counts_one_chunk_of_logits(tmp_path):
    """`finetune plan` (and the capacity benchmarks) count one chunk's logits under the chunked loss in training
    (without it: the micro batch's whole logits, which at 128k entries outweigh the model) and in evaluation, where
    finetune's loss forward goes a chunk at a time with chunked_loss false too; no eval data, no eval part."""
    from finetune import demo, memory

    vocab, seq = 128_256, 2048
    shape_config = demo.llama_config(256, 2, vocab=vocab, max_positions=seq)
    logits, evals, totals = {}, {}, {}
    for setting in ("true", "false"):
        values = {"model": "(config given)", "dataset": "d.jsonl", "output_dir": str(tmp_path / setting)}
        values |= {"max_seq_length": seq, "per_device_train_batch_size": 1, "chunked_loss": setting}
        values |= {"per_device_eval_batch_size": 4, "eval_fraction": 0.05}
        cfg = build_config(values, check_filesystem=False)
        shape = memory.shape_from_config(cfg, config=shape_config)
        assert shape.model_type == "llama" and shape.vocab == vocab
        machines = memory.Machines(cpu_processes=1)
        single = ROOT / "accelerate_configs" / "single.yaml"
        est = memory.plan_config(shape, cfg, single, machines)
        logits[setting], evals[setting] = est.by_kind()["logits"] * 1e9, est.by_kind()["eval"] * 1e9
        always = sum(p.bytes for p in est.parts if p.phase == "always")
        phases = {phase: sum(p.bytes for p in est.parts if p.phase == phase) for phase in ("backward", "step", "eval")}
        assert est.host_gb * 1e9 == pytest.approx(always + max(phases.values()))  # the largest phase on top
        totals[setting] = est.host_gb
        values["eval_fraction"] = 0
        no_eval = memory.plan_config(shape, build_config(values, check_filesystem=False), single, machines)
        assert "eval" not in no_eval.by_kind()
    chunk = chunked_loss.chunk_tokens(0, vocab)
    assert chunk == 261
    assert logits["false"] == pytest.approx(seq * vocab * 12)  # fp32: 3 copies of the whole logits
    assert logits["true"] == pytest.approx(chunk * vocab * 12 + vocab * 256 * 4)  # and a chunk's head gradient
    # evaluation a chunk at a time either way (no gradients: nothing to recompute); tests/test_memory.py's
    # test_evaluation_that_does_not_fit_is_named counts a whole eval batch's logits, for a model without that forward
    assert evals["false"] == evals["true"] == pytest.approx(chunk * vocab * 12)
    assert totals["false"] > totals["true"] + 2.5  # GB: the unchunked training logits (3.2 GB)


@pytest.mark.parametrize("setting", ["true", "false"])
def test_torch_compile_compiles_the_loss_with_the_same_loss_and_gradients(assets, monkeypatch, setting):
    """torch_compile compiles the loss too (regional compilation compiles only the decoder blocks): the chunked
    loss's per-chunk cross-entropy, or transformers' loss. Inductor compiles what dynamo captured; the graphs
    captured are recorded here, and must be the cross-entropy."""
    import torch._dynamo
    from torch._inductor.compile_fx import compile_fx

    from finetune.config.schema import ModelArgs
    from finetune.model import build_model, load_tokenizer

    graphs = []

    def recorded(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return compile_fx(gm, example_inputs)

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend=recorded))
    torch._dynamo.reset()
    m = ModelArgs(model=assets.llama, chunked_loss=setting, loss_chunk_tokens=7, torch_compile=True)
    torch.manual_seed(0)
    compiled = build_model(m, load_tokenizer(m), None, 64, micro_batch_tokens=60, eval_batch_tokens=60)
    plain = _model(assets.llama)
    batch = _batch(plain.config.vocab_size)
    want, want_grads = _loss_and_grads(plain, batch)
    got, got_grads = _loss_and_grads(compiled, batch)
    assert graphs and all(any("cross_entropy" in t for t in g) for g in graphs), graphs
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert want_grads.keys() == got_grads.keys()
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=1e-4, atol=1e-6), name
    torch._dynamo.reset()


def test_compiled_under_ddp_with_the_chunked_loss_equals_eager(assets, tmp_path, reference):
    cache = tmp_path / "inductor"  # never the user's cache: what is in it was compiled by this run
    more = ("--per_device_train_batch_size", "2", "--torch_compile", "true", "--chunked_loss", "true")
    res = finetune(
        tmp_path / "run",
        *_args(assets, *more, "--loss_chunk_tokens", "40"),
        launcher="ddp",
        extra_env={"TORCHINDUCTOR_CACHE_DIR": str(cache)},
    )
    assert "torch_compile: the first step took" in res.output and "chunked loss: up to 40 tokens" in res.output
    assert any(p.is_file() for p in cache.rglob("*")), "inductor wrote nothing: nothing was compiled"
    want, got = reference.losses(), res.losses()
    assert len(want) == len(got) == 5
    assert max_rel_diff(want, got) <= 1e-5, (want, got)
    _assert_same_eval(reference, res)
    # the export is the plain transformers model (no compiled wrappers' names), the trained weights of the eager run
    assert max_weight_diff(reference.output_dir / "final", tmp_path / "run" / "final") <= 1e-5


def test_refused_under_megatron(tmp_path):
    from finetune.parallel.megatron import _model_option_problems

    values = {"model": "m", "dataset": "d.jsonl", "output_dir": str(tmp_path), "torch_compile": True}
    problems: list = []
    _model_option_problems(problems, build_config({**values, "chunked_loss": "true"}, check_filesystem=False))
    assert [key for key, _ in problems] == ["chunked_loss", "torch_compile"]


def test_fsdp2_before_torch_2_13_keeps_it_off(monkeypatch, tmp_path):
    """Seen on an H100 with torch 2.11 (bench/gpu_verify.py): FSDP2 with the chunked loss failed its first step, the
    head run on its sharded weight in backward's recomputation. Before 2.13, auto is off (run.build_model) and true
    is refused before any model loads, with the reason and the fix; from 2.13, whose FSDP2 runs above prove it, it
    runs. The version is the gate because the failure is torch's, fixed in its FSDP2."""
    import torch

    from finetune.parallel import fsdp

    assert fsdp.chunked_loss_blocker("2.13.0") is None and fsdp.chunked_loss_blocker("2.14.1+cu130") is None
    assert "torch 2.11.0+cu130 (before 2.13)" in fsdp.chunked_loss_blocker("2.11.0+cu130")
    assert "2.12.1" in fsdp.chunked_loss_blocker("2.12.1")  # unproven there
    values = {"model": "(config given)", "dataset": "d.jsonl", "output_dir": str(tmp_path)}
    for setting in ("true", "auto"):
        cfg = build_config({**values, "chunked_loss": setting}, check_filesystem=False)
        assert not [k for k, _ in fsdp.problems(cfg) if k == "chunked_loss"]  # this suite's torch
        monkeypatch.setattr(torch, "__version__", "2.11.0")
        refused = [why for k, why in fsdp.problems(cfg) if k == "chunked_loss"]
        monkeypatch.undo()
        if setting == "true":
            assert len(refused) == 1 and "upgrade torch to 2.13 or newer, or set chunked_loss: auto" in refused[0]
        else:
            assert not refused  # auto: off at load, logged


def test_a_layout_that_cannot_run_it_leaves_auto_off(assets, tmp_path, monkeypatch, caplog):
    """run.build_model asks the backend (chunked_loss_blocker): with a reason, auto is off and logged; without, on."""
    import types

    from finetune import model, run
    from finetune.parallel import ddp

    monkeypatch.setattr(chunked_loss, "AUTO_MIN_VOCAB", 1)  # auto on for the tiny Llama
    monkeypatch.setattr(chunked_loss, "AUTO_MAX_COST", 1.0)
    cfg = build_config({"model": assets.llama, "dataset": assets.instruction, "output_dir": str(tmp_path)})
    assert cfg.model.chunked_loss == "auto"

    class Backend(ddp.Backend):
        def __init__(self, blocker):
            self.cfg, self.mixed_precision, self.blocker = cfg, "no", blocker

        def chunked_loss_blocker(self):
            return self.blocker

    tokenizer = model.load_tokenizer(cfg.model)
    installed = {}
    for blocker in (None, "a reason"):
        caplog.clear()
        with caplog.at_level("INFO", logger="finetune"):
            net, _ = run.build_model(cfg, Backend(blocker), tokenizer, types.SimpleNamespace(label_names=None), None)
        assert "forward" in vars(net)  # chunked_loss.install replaced the instance's forward: the supervised positions
        installed[blocker] = chunked_loss.chunks(net)  # and chunked, or not
        assert ("chunked loss off (chunked_loss auto): a reason" in caplog.text) == bool(blocker), caplog.text
    assert installed == {None: True, "a reason": False}
