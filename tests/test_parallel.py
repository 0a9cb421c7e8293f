"""The parallel/ package: the one home of backend differences, and its pure parts (no processes)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Words that name a backend, a distributed type or a sharding scheme.
BACKEND_WORDS = (
    "distributed_type",
    "distributedtype",
    "deepspeed",
    "zero_stage",
    "ds_numel",
    "ds_id",
    "fsdp",
    "megatron",
    "tp_size",
    "tp_enabled",
    "parallelism_config",
    "multi_cpu",
    "multi_gpu",
    "family",
    "checkpoint_format",
)


def branch_conditions(tree: ast.AST):
    """Every expression a branch depends on: if/elif/while tests, conditional expressions, match subjects."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            yield node.test
        elif isinstance(node, ast.Match):
            yield node.subject
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


# Backend names that only ever appear as text: a checkpoint's format, and the shipped Accelerate configs' names.
CHECKPOINT_FORMATS = ("native", "portable", "full")
CONFIG_NAMES = tuple(p.stem for p in (ROOT / "accelerate_configs").glob("*.yaml"))
# Parts of those names a branch could test a string for (name.endswith("_pp2"), "zero3" in name, "fsdp2_...").
CONFIG_PARTS = re.compile(r"zero[0-3]|(?<![a-z])[tp]p[0-9]|fsdp[0-9]")


def words_in(expr: ast.AST, constants: dict[str, set[str]]) -> tuple[set[str], set[str], set[str]]:
    """(names and attributes, string constants, the strings of the module-level constants it names, e.g.
    GPU_ONLY = ("megatron_tp2", ...)) of an expression."""
    names, texts, named = set(), set(), set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Name):
            names.add(node.id.lower())
            named |= constants.get(node.id, set())
        elif isinstance(node, ast.Attribute):
            names.add(node.attr.lower())
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.add(node.value.lower())
    return names, texts, named


def module_constants(tree: ast.Module) -> dict[str, set[str]]:
    """name -> the strings in its value, for each module-level NAME = <literal>."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            strings = {
                n.value.lower()
                for n in ast.walk(node.value)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
            out.update({t.id: strings for t in node.targets})
    return out


def backend_branches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    constants = module_constants(tree)
    out = []
    for cond in branch_conditions(tree):
        names, texts, named = words_in(cond, constants)
        hits = {w for w in names | texts for b in BACKEND_WORDS if b in w}
        hits |= (texts | named) & {*CHECKPOINT_FORMATS, *CONFIG_NAMES}  # whole names only: constants hold messages
        hits |= {t for t in texts if CONFIG_PARTS.search(t)}  # a part of a config's name, written in the branch
        if hits:
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            out.append(f"{where}:{cond.lineno}: {ast.unparse(cond)}")
    return out


def test_no_backend_branches_outside_parallel():
    """Outside finetune/parallel/, nothing branches on the distributed type, ZeRO, FSDP, TP or Megatron-LM, on a
    checkpoint's format or on an Accelerate config's name."""
    outside = [p for p in (ROOT / "finetune").rglob("*.py") if "parallel" not in p.relative_to(ROOT).parts]
    assert len(outside) >= 10 and len(CONFIG_NAMES) >= 10
    found = [hit for p in outside for hit in backend_branches(p)]
    assert found == [], "\n".join(found)


def test_the_invariant_check_sees_a_branch(tmp_path):
    """The check above can fail: planted branches on the distributed type, the ZeRO stage, a checkpoint's format
    (its value, or the attribute that holds it), a config's name or a part of one, and a constant that lists config
    names are each found; a branch on other words is not."""
    planted = tmp_path / "_planted_for_test.py"  # not in finetune/: another worker may be scanning it right now
    planted.write_text(
        'GPU_ONLY = ("megatron_tp2", "megatron_tp2_pp2")\n'
        "def f(acc, plugin, backend, layout, name, resume):\n"
        "    if str(acc.distributed_type) == 'DEEPSPEED':\n        return 1\n"
        "    if backend.checkpoint_format == 'native':\n        return 3\n"
        "    if layout.get('format') == 'portable':\n        return 4\n"
        "    if name == 'zero3':\n        return 5\n"
        "    if name in GPU_ONLY:\n        return 6\n"
        "    if resume.step > 2:\n        return 7\n"
        "    if backend.checkpoint_format != layout.kind:\n        return 8\n"
        "    if name.endswith('_pp2'):\n        return 9\n"
        "    if [n for n in layout if 'zero3' in n]:\n        return 10\n"
        "    if name.startswith('step_'):\n        return 11\n"
        "    return 2 if plugin.zero_stage == 3 else 0\n"
    )
    hits = backend_branches(planted)
    assert len(hits) == 10, "\n".join(hits)  # line 19 twice: the if, and the comprehension's condition
    assert not any("resume.step" in h or "step_" in h for h in hits)
    assert any("checkpoint_format != layout.kind" in h for h in hits) and any("_pp2" in h for h in hits)


def test_every_family_has_the_same_surface():
    """Each backend family module has the functions of surface.FamilyModule and a Backend with every method of
    surface.Backend (the typed surface the rest of finetune speaks), and nothing public beyond the default's."""
    from finetune.parallel import ddp, surface
    from finetune.parallel.environment import family_module
    from finetune.parallel.topology import FAMILIES

    methods = {n for n, v in vars(surface.Backend).items() if callable(v) and not n.startswith("_")}
    assert {"prepare", "full_state_dict", "full_adam_moments", "set_full_optimizer_state", "numel"} <= methods
    assert methods == {n for n, v in vars(ddp.Backend).items() if callable(v) and not n.startswith("_")}
    before = {n for n, v in vars(surface.FamilyModule).items() if callable(v) and not n.startswith("_")}
    assert before == {"environment", "problems", "accelerator_kwargs"}
    for family in FAMILIES:
        module = family_module(family)
        for fn in before:
            assert callable(getattr(module, fn, None)), (family, fn)
        backend = module.Backend
        assert all(callable(getattr(backend, n, None)) for n in methods), family
        assert backend.checkpoint_format in ("full", "portable", "native")


def test_the_launcher_environment_is_read_in_one_place():
    """topology.Launcher: torchrun's ranks, MPI's size, the family and sizes `accelerate launch` sets."""
    from finetune.parallel.topology import Launcher

    torchrun = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    got = Launcher.read(torchrun)
    assert (got.world_size, got.rank, got.local_rank, got.node, got.machines(4)) == (4, 3, 1, 1, 2)
    assert (got.family, got.distributed, got.use_cpu, got.tp_size) == ("ddp", True, False, 1)
    assert Launcher.read({"OMPI_COMM_WORLD_SIZE": "3"}).world_size == 3
    assert Launcher.read({"ACCELERATE_NUM_MACHINES": "2"}).machines(4) == 2
    # DeepSpeed's launch.py (its pdsh and nossh launchers; tests/test_multinode.py runs pdsh's), then MPI's names
    pdsh = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "2"}
    got = Launcher.read(pdsh)
    assert (got.node, got.machines(4), got.local_world_size) == (1, 2, 2)
    mpi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    got = Launcher.read(mpi)
    assert (got.world_size, got.rank, got.node, got.machines(4)) == (4, 3, 1, 2)
    assert Launcher.read({"MV2_COMM_WORLD_LOCAL_SIZE": "2", "MV2_COMM_WORLD_RANK": "2"}).node == 1
    assert Launcher.read({"MPI_LOCALNRANKS": "4", "PMI_RANK": "5", "PMI_SIZE": "8"}).machines(8) == 2
    assert Launcher.read({"WORLD_SIZE": "4", "RANK": "3"}).node == 0  # nothing says how many per machine: one
    alone = Launcher.read({})
    assert (alone.world_size, alone.rank, alone.local_rank, alone.node, alone.distributed) == (1, 0, None, 0, False)
    fsdp_tp = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    assert Launcher.read({**fsdp_tp, "PARALLELISM_CONFIG_TP_SIZE": "2"}).family == "fsdp"
    tp = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2"}
    assert (Launcher.read(tp).family, Launcher.read(tp).tp_size) == ("tensor", 2)
    megatron = {"ACCELERATE_USE_MEGATRON_LM": "true", "ACCELERATE_USE_DEEPSPEED": "true", "MEGATRON_LM_PP_DEGREE": "2"}
    assert (Launcher.read(megatron).family, Launcher.read(megatron).megatron_pp) == ("megatron", 2)


def test_a_topology_checks_itself():
    """Every Topology, from a started run or a config file, is one: sizes >= 1, a known family, ranks in range,
    ZeRO only under DeepSpeed and FSDP only under FSDP."""
    from finetune.parallel.topology import Topology

    ok = {"family": "ddp", "distributed_type": "MULTI_CPU", "num_processes": 2, "num_machines": 1, "process_index": 1}
    Topology(**ok, dp=2)
    Topology(**{**ok, "family": "deepspeed"}, dp=2, zero_stage=3)
    wrong = [
        {"family": "zero3"},
        {"num_processes": 0},
        {"process_index": 2},
        {"dp": 0},
        {"dp_rank": 2},
        {"zero_stage": 3},
        {"fsdp_version": 2},
        {"family": "deepspeed", "zero_stage": 4},
    ]
    for bad in wrong:
        with pytest.raises(ValueError, match="not a topology"):
            Topology(**{**ok, "dp": 2, **bad})


# ---------------------------------------------------------------- Megatron-Core shards -> HF (export)


def split_llama(sd: dict, config, tp: int) -> list[dict]:
    """A HF Llama state dict as Megatron-Core's TP shards (Megatron-LM's own layout rules, written here
    independently of finetune: per query group [q heads, k, v]; fc1 = [gate_r; up_r]; row/column splits)."""
    h, nq = config.hidden_size, config.num_attention_heads
    ng, d = config.num_key_value_heads, h // nq
    shards = [{} for _ in range(tp)]

    def put(name, tensor, dim=None):
        parts = tensor.chunk(tp, dim) if dim is not None else [tensor] * tp
        for s, p in zip(shards, parts):
            s[name] = p.clone()

    pad = 128 * tp - config.vocab_size % (128 * tp)  # Megatron pads the vocabulary
    put("embedding.word_embeddings.weight", torch.cat([sd["model.embed_tokens.weight"], torch.zeros(pad, h)]), 0)
    put("output_layer.weight", torch.cat([sd["lm_head.weight"], torch.zeros(pad, h)]), 0)
    put("decoder.final_layernorm.weight", sd["model.norm.weight"])
    for i in range(config.num_hidden_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = sd[hf + "self_attn.q_proj.weight"].view(ng, nq // ng * d, h)
        k = sd[hf + "self_attn.k_proj.weight"].view(ng, d, h)
        v = sd[hf + "self_attn.v_proj.weight"].view(ng, d, h)
        put(mc + "self_attention.linear_qkv.weight", torch.cat([q, k, v], 1).reshape(-1, h), 0)
        put(mc + "self_attention.linear_qkv.layer_norm_weight", sd[hf + "input_layernorm.weight"])
        put(mc + "self_attention.linear_proj.weight", sd[hf + "self_attn.o_proj.weight"], 1)
        put(mc + "mlp.linear_fc1.layer_norm_weight", sd[hf + "post_attention_layernorm.weight"])
        gate, up = sd[hf + "mlp.gate_proj.weight"].chunk(tp, 0), sd[hf + "mlp.up_proj.weight"].chunk(tp, 0)
        for s, g, u in zip(shards, gate, up):
            s[mc + "mlp.linear_fc1.weight"] = torch.cat([g, u], 0)
        put(mc + "mlp.linear_fc2.weight", sd[hf + "mlp.down_proj.weight"], 1)
    return shards


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_llama_shards_become_the_hf_model(tp):
    from transformers import LlamaForCausalLM

    from finetune.demo import llama_config
    from finetune.parallel.megatron import megatron_to_hf

    config = llama_config(64, 2, heads=8, kv_heads=2, intermediate=96, vocab=300, max_positions=2048)
    torch.manual_seed(0)
    sd = LlamaForCausalLM(config).state_dict()
    out = megatron_to_hf(split_llama(sd, config, tp), config)
    assert set(out) == set(sd)
    for name, value in sd.items():
        assert torch.equal(out[name], value), name


def test_megatron_gpt2_shards_become_the_hf_model():
    """GPT-2 (one query head per group, Conv1D [in, out] weights, biases, tied embeddings), TP 2."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from finetune.parallel.megatron import megatron_to_hf

    config = GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    torch.manual_seed(0)
    sd = GPT2LMHeadModel(config).state_dict()
    h, nh, tp = 64, 4, 2
    d = h // nh
    shards = [{} for _ in range(tp)]

    def put(name, tensor, dim=None):
        for s, p in zip(shards, tensor.chunk(tp, dim) if dim is not None else [tensor] * tp):
            s[name] = p.clone()

    put("embedding.word_embeddings.weight", torch.cat([sd["transformer.wte.weight"], torch.zeros(212, h)]), 0)
    put("embedding.position_embeddings.weight", sd["transformer.wpe.weight"])
    put("decoder.final_layernorm.weight", sd["transformer.ln_f.weight"])
    put("decoder.final_layernorm.bias", sd["transformer.ln_f.bias"])
    for i in range(2):
        hf, mc = f"transformer.h.{i}.", f"decoder.layers.{i}."
        w = sd[hf + "attn.c_attn.weight"].T.reshape(3, nh, d, h).transpose(0, 1).reshape(3 * h, h)
        b = sd[hf + "attn.c_attn.bias"].reshape(3, nh, d).transpose(0, 1).reshape(3 * h)
        put(mc + "self_attention.linear_qkv.weight", w, 0)
        put(mc + "self_attention.linear_qkv.bias", b, 0)
        put(mc + "self_attention.linear_qkv.layer_norm_weight", sd[hf + "ln_1.weight"])
        put(mc + "self_attention.linear_qkv.layer_norm_bias", sd[hf + "ln_1.bias"])
        put(mc + "self_attention.linear_proj.weight", sd[hf + "attn.c_proj.weight"].T, 1)
        put(mc + "self_attention.linear_proj.bias", sd[hf + "attn.c_proj.bias"])
        put(mc + "mlp.linear_fc1.layer_norm_weight", sd[hf + "ln_2.weight"])
        put(mc + "mlp.linear_fc1.layer_norm_bias", sd[hf + "ln_2.bias"])
        put(mc + "mlp.linear_fc1.weight", sd[hf + "mlp.c_fc.weight"].T, 0)
        put(mc + "mlp.linear_fc1.bias", sd[hf + "mlp.c_fc.bias"], 0)
        put(mc + "mlp.linear_fc2.weight", sd[hf + "mlp.c_proj.weight"].T, 1)
        put(mc + "mlp.linear_fc2.bias", sd[hf + "mlp.c_proj.bias"])
    out = megatron_to_hf(shards, config)
    want = {k: v for k, v in sd.items() if not k.endswith(".attn.bias") and not k.endswith("masked_bias")}
    assert set(out) == set(want), set(out) ^ set(want)
    for name, value in want.items():
        assert torch.equal(out[name], value), name


def test_accelerate_still_imports_deepspeed_to_unwrap():
    """The reason for finetune.parallel.base.unwrap_without_deepspeed: accelerate's unwrap_model imports deepspeed
    (when installed) even for a plain module. When this fails, accelerate no longer does: delete the workaround."""
    code = (
        "import sys, torch; from accelerate.utils.other import extract_model_from_parallel; "
        "extract_model_from_parallel(torch.nn.Linear(1, 1)); print('deepspeed' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stdout + out.stderr[-2000:]


def test_accelerate_still_drops_deepspeed_in_cpu_mode():
    """Why finetune.parallel.deepspeed.problems refuses ACCELERATE_USE_CPU beside a DeepSpeed launch (the bad-input
    case deepspeed_in_accelerate_cpu_mode): accelerate's AcceleratorState starts DeepSpeed only outside its CPU mode
    and drops the DeepSpeed plugin without a word. When this fails, accelerate runs DeepSpeed in CPU mode: drop the
    refusal, and check that Topology.read finds the plugin."""
    ds = str(ROOT / "ds_configs" / "zero2.json")
    code = (
        "from accelerate import Accelerator; from accelerate.utils import DeepSpeedPlugin; "
        f"acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={ds!r})); "
        "print(acc.distributed_type.name, acc.state.deepspeed_plugin)"
    )
    env = {**os.environ, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_CPU": "true"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip().splitlines()[-1:] == ["NO None"], out.stdout + out.stderr[-2000:]


# A child that runs a step-like pattern twelve times (activations, 32 MiB logits, softmax, gradients; all freed at
# the end) and reports the page faults of each: glibc's default maps the large buffers afresh every step, so
# their pages fault in (and are zeroed) again; `keep` mostly reuses them from the second step on.
REFILL = """
import resource, sys, torch
from finetune.parallel import set_cpu_allocator
print(set_cpu_allocator(sys.argv[1]))
w = torch.randn(512, 4096)
for step in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.randn(2048, 512)
    logits = x @ w
    p = logits.softmax(-1)
    g = (p - 1) @ w.T
    del x, logits, p, g
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_allocator_keep_reuses_freed_buffers_without_page_faults():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    faults = {}
    for mode in ("system", "keep", "release"):
        out = subprocess.run([sys.executable, "-c", REFILL, mode], capture_output=True, text=True, env=env, timeout=60)
        said, *counts = out.stdout.split()
        assert said == mode, out
        faults[mode] = [int(c) for c in counts]
    pages = 3 * (32 << 20) // 4096  # logits, softmax, their gradient
    for mode in ("system", "release"):
        assert min(faults[mode]) >= pages // 2, faults  # refilled every step
    # Kept and reused once the heap has grown to hold all three. Where a buffer lands varies from run to run (also
    # with one thread), so the heap has been seen to grow by a buffer in any of steps 2-8, several times in a row on a
    # loaded machine (CI: 8910, 8192, 0, 8192, 8192, 8192 in steps 2-7). Over steps 2-12: at most a third of what
    # the default maps afresh (three buffers every step; doing nothing, keep would fault as often).
    assert sum(faults["keep"][1:]) <= sum(faults["system"][1:]) / 3, faults
    given = subprocess.run(
        [sys.executable, "-c", REFILL, "keep"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "MALLOC_TRIM_THRESHOLD_": "0"},
    )
    assert given.stdout.splitlines()[0] == "system (the environment sets MALLOC_TRIM_THRESHOLD_)", given


def test_training_and_eval_forwards_build_no_kv_cache(assets):
    """use_cache=False reaches the model's forward in training and eval (Backend.no_kv_cache), directly and
    through PEFT, while the model's config keeps the base model's setting (what final/ exports for generation)."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.parallel import ddp

    ids = torch.tensor([[5, 6, 7, 8]])
    for wrap in (lambda m: m, lambda m: get_peft_model(m, LoraConfig(r=2, target_modules=["q_proj"]))):
        model = AutoModelForCausalLM.from_pretrained(assets.llama)
        assert model.config.use_cache
        caches = []
        model.model.register_forward_hook(lambda module, args, out, seen=caches: seen.append(out.past_key_values))
        net = wrap(model)
        backend = ddp.Backend(
            SimpleNamespace(unwrap_model=lambda m, **kw: m, mixed_precision="no"), topology=None, cfg=None
        )
        backend.forward_loss(net, {"input_ids": ids, "labels": ids}).backward()
        backend.eval_stats(net, {"input_ids": ids}, ids, "causal_lm")
        assert caches == [None, None] and model.config.use_cache
        net(input_ids=ids)  # the model's own default is untouched: a plain forward still builds one
        assert caches[-1] is not None


def test_the_accelerate_side_cannot_override_what_the_run_config_owns(tmp_path):
    """accelerate's DeepSpeedPlugin fills the JSON's "auto" accumulation and clipping from what the launcher passes
    (an inline deepspeed_config key, `accelerate launch --gradient_accumulation_steps`), and its accumulation then
    replaces the run config's; deepspeed.problems refuses every such value that differs, each naming the Accelerate
    key and the run-config key, as it refuses a JSON's. Also refused before any model loads: a JSON train_batch_size
    that is not the run's (DeepSpeed asserted after the model loaded), ZeRO stage 0, NVMe offload where DeepSpeed's
    async_io op cannot load (here only), and an FSDP1 config (finetune runs FSDP2 only). Each environment is the one
    accelerate's own launcher code builds from the config file (topology.launch_environment)."""
    import json

    import yaml

    from finetune.config import build_config
    from finetune.parallel import deepspeed, fsdp
    from finetune.parallel.topology import launch_environment

    values = {"model": "(config given)", "dataset": "d.jsonl", "output_dir": str(tmp_path)}
    values |= {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2, "max_grad_norm": 1.0}
    cfg = build_config(values, check_filesystem=False)

    def refused(acc: dict, ds: dict | None = None, flags: dict | None = None, here: bool = True) -> dict[str, str]:
        acc = {"distributed_type": "DEEPSPEED", "num_processes": 2, **acc}
        if ds is not None:
            shipped = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
            (tmp_path / "ds.json").write_text(json.dumps({**shipped, **ds}))
            acc["deepspeed_config"] = {"deepspeed_config_file": str(tmp_path / "ds.json")}
        (tmp_path / "acc.yaml").write_text(yaml.safe_dump(acc))
        env = {**launch_environment(tmp_path / "acc.yaml", 2), **(flags or {})}
        module = fsdp if acc["distributed_type"] == "FSDP" else deepspeed
        return dict(module.problems(cfg, env, here=here))

    assert refused({}, {}) == {}  # the shipped JSON: everything "auto"
    # `accelerate launch --gradient_accumulation_steps 4 / --gradient_clipping 0.5` (accelerate's launch.py sets these)
    flag = {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4", "ACCELERATE_GRADIENT_CLIPPING": "0.5"}
    got = refused({}, {}, flag)
    assert set(got) == {"gradient_accumulation_steps", "max_grad_norm"}, got
    assert "--gradient_accumulation_steps" in got["gradient_accumulation_steps"]
    assert "gradient_accumulation_steps=2" in got["gradient_accumulation_steps"]
    assert "--gradient_clipping" in got["max_grad_norm"] and "max_grad_norm=1.0" in got["max_grad_norm"]
    same = {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2", "ACCELERATE_GRADIENT_CLIPPING": "1.0"}
    assert refused({}, {}, same) == {}
    # what `accelerate config` writes inline: gradient_accumulation_steps 1; and a clipping of its own
    inline = {"gradient_accumulation_steps": 1, "gradient_clipping": 0.5, "zero_stage": 2}
    got = refused({"deepspeed_config": inline})
    assert set(got) == {"gradient_accumulation_steps", "max_grad_norm"}, got
    assert "deepspeed_config key gradient_accumulation_steps" in got["gradient_accumulation_steps"]
    assert refused({"deepspeed_config": {**inline, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}}) == {}
    # train_batch_size: per device 2 x accumulation 2 x 2 processes
    got = refused({}, {"train_batch_size": 16})
    assert list(got) == ["per_device_train_batch_size"] and '"auto"' in got["per_device_train_batch_size"], got
    assert "= 8" in got["per_device_train_batch_size"]
    assert refused({}, {"train_batch_size": 8}) == {}
    # ZeRO stage 0, from a JSON or inline
    assert list(refused({}, {"zero_optimization": {"stage": 0}})) == ["zero_stage"]
    got = refused({"deepspeed_config": {"zero_stage": 0}})
    assert list(got) == ["zero_stage"] and "accelerate_configs/ddp.yaml" in got["zero_stage"], got
    # NVMe offload: refused where DeepSpeed's async_io op cannot load (this machine's libaio decides), never in plans
    nvme = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    got = refused({}, {"zero_optimization": nvme})
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible():
        assert got == {}
    else:
        assert list(got) == ["offload_param"] and "libaio-dev" in got["offload_param"], got
    assert refused({}, {"zero_optimization": nvme}, here=False) == {}
    from finetune.parallel.topology import Topology

    where = {"offload_optimizer": True, "offload_params": True, "offload_to": ("cpu", "nvme")}
    said = Topology("deepspeed", "DEEPSPEED", num_processes=2, num_machines=1, process_index=0, dp=2, **where).summary()
    assert "offload optimizer to CPU, parameters to NVMe" in said, said
    # FSDP1 (no fsdp_version: accelerate's default) anywhere; FSDP2 not
    fsdp_config = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_offload_params": False}
    got = refused({"distributed_type": "FSDP", "fsdp_config": fsdp_config})
    assert list(got) == ["fsdp_version"] and "accelerate_configs/fsdp2.yaml" in got["fsdp_version"], got
    assert refused({"distributed_type": "FSDP", "fsdp_config": {**fsdp_config, "fsdp_version": 2}}) == {}


def test_a_parallelism_config_whose_ranks_share_a_batch_is_refused(tmp_path):
    """accelerate 1.15 gives the ranks of a context-parallel (cp_size) or sequence-parallel (sp_size) group one batch,
    and under DeepSpeed a parallelism_config tp_size splits no model (DeepSpeed splits by its JSON's AutoTP alone,
    which gives its tp ranks one batch too) while its tp ranks still read one batch: finetune, counting those ranks as
    data parallel or as tensor-parallel copies of a batch, would miscount losses, token counts and eval. Each is
    refused before any model loads, naming the Accelerate key and what to use instead; what finetune counts right
    is not (HSDP's dp_replicate, TP x FSDP2, a DeepSpeed parallelism_config without tp). Each environment is the one
    accelerate's own launcher code builds from the config file (topology.launch_environment): accelerate launches
    every one of these, DeepSpeed with a parallelism_config included."""
    import json
    import math

    import yaml

    from finetune.config import build_config
    from finetune.parallel.environment import family_module
    from finetune.parallel.topology import Launcher, launch_environment, shipped_by_name

    values = {"model": "(config given)", "dataset": "d.jsonl", "output_dir": str(tmp_path)}
    cfg = build_config(values, check_filesystem=False)
    fsdp2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}
    ddp = {"distributed_type": "MULTI_GPU"}

    def zero2(**json_fields) -> dict:
        shipped = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
        (tmp_path / "ds.json").write_text(json.dumps({**shipped, **json_fields}))
        return {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {"deepspeed_config_file": str(tmp_path / "ds.json")},
        }

    def problems(env: dict) -> dict[str, str]:
        return dict(family_module(Launcher.read(env).family).problems(cfg, env, here=False))

    def refused(layout: dict, **sizes: int) -> dict[str, str]:
        n = math.prod(sizes.values()) if sizes else 2
        pc = {"parallelism_config": {f"parallelism_config_{k}_size": v for k, v in sizes.items()}} if sizes else {}
        (tmp_path / "acc.yaml").write_text(yaml.safe_dump({**layout, "num_processes": n, **pc}))
        return problems(launch_environment(tmp_path / "acc.yaml", n))

    for layout, sizes in [
        (fsdp2, dict(dp_shard=2, cp=2)),
        (fsdp2, dict(dp_shard=2, tp=2, cp=2)),
        (ddp, dict(cp=2)),
        (zero2(), dict(cp=2)),
    ]:
        got = refused(layout, **sizes)
        assert list(got) == ["parallelism_config_cp_size"], (layout, sizes, got)
        assert "context parallelism" in got["parallelism_config_cp_size"]
        assert "set parallelism_config_cp_size: 1" in got["parallelism_config_cp_size"]
    for layout in (fsdp2, zero2()):
        got = refused(layout, dp_shard=2, sp=2)
        assert list(got) == ["parallelism_config_sp_size"] and "set parallelism_config_sp_size: 1" in str(got), got
    for n in (2, 4):  # tp alone, and tp with as many data-parallel ranks
        got = refused(zero2(), tp=2, dp_shard=n // 2)
        assert list(got) == ["parallelism_config_tp_size"], got
        assert (
            "DeepSpeed" in got["parallelism_config_tp_size"] and "tp2_fsdp2.yaml" in got["parallelism_config_tp_size"]
        )
    got = refused(zero2(tensor_parallel={"autotp_size": 2}))
    assert list(got) == ["tensor_parallel.autotp_size"] and "tp2_fsdp2.yaml" in got["tensor_parallel.autotp_size"]
    # counted right: HSDP (every dp_replicate x dp_shard rank reads its own batches), TP x FSDP2, HSDP x TP, a
    # DeepSpeed parallelism_config without tp (accelerate's DeepSpeed loaders shard by its "tp" only)
    assert refused(fsdp2, dp_replicate=2, dp_shard=2) == {}
    assert refused(fsdp2, dp_replicate=2, dp_shard=2, tp=2) == {}
    assert refused(zero2(), dp_shard=2) == {} and refused(zero2(tensor_parallel={"autotp_size": 1})) == {}
    for name in ("tp2_fsdp2", "tp2", "fsdp2", "zero2", "ddp"):
        path = shipped_by_name()[name]
        assert problems(launch_environment(path, int(yaml.safe_load(path.read_text())["num_processes"]))) == {}, name


def accelerate_refuses(n: int, **sizes: int) -> bool:
    """Whether accelerate 1.15 refuses this FSDP2 parallelism_config on n processes at Accelerator(): its
    ParallelismConfig as Accelerator.__init__ makes it, then _validate_accelerator of a started FSDP2 Accelerator
    (what that reads of it, faked)."""
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    started = SimpleNamespace(
        multi_device=n > 1, num_processes=n, is_fsdp2=True, distributed_type=DistributedType.FSDP, is_main_process=True
    )
    try:
        ParallelismConfig(**{f"{k}_size": v for k, v in sizes.items()})._validate_accelerator(started)
    except ValueError:
        return True
    return False


def test_an_fsdp2_mesh_accelerate_refuses_is_refused_first(tmp_path):
    """accelerate 1.15 refuses at Accelerator(), in a traceback on every rank, an FSDP2 parallelism_config that
    leaves FSDP2 no dp_shard ranks to shard over: tp_size equal to the processes, dp_replicate_size alone
    (_validate_accelerator: "no dimension for FSDP to shard across"), dp_replicate x tp (ParallelismConfig's
    __post_init__), and any size under 1 (seen each on 2 or 4 CPU processes under accelerate launch). finetune
    refuses each before the Accelerator, naming the key and a layout that runs; what accelerate runs is not refused
    (plain FSDP2, TP x FSDP2, HSDP, HSDP x TP: seen running on 2, 4, 4 and 8 CPU processes). Each from the
    environment accelerate's own launcher code builds for the config file (environment.launch_problems, which
    finetune plan asks). When an accelerate_refuses assertion fails, accelerate runs such a mesh: look again."""
    import math

    import yaml

    from finetune.config import build_config
    from finetune.parallel.environment import launch_problems

    cfg = build_config({"model": "(config given)", "dataset": "d.jsonl"}, check_filesystem=False)
    fsdp2 = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text())

    def refused(**sizes: int) -> dict[str, str]:
        n = abs(math.prod(sizes.values()))
        pc = {f"parallelism_config_{k}_size": v for k, v in sizes.items()}
        (tmp_path / "acc.yaml").write_text(yaml.safe_dump({**fsdp2, "num_processes": n, "parallelism_config": pc}))
        return dict(launch_problems(cfg, tmp_path / "acc.yaml", n))

    for sizes, fix in [
        (dict(tp=2), "accelerate_configs/tp2.yaml"),
        (dict(tp=4), "accelerate_configs/tp2.yaml"),
        (dict(dp_replicate=2), "accelerate_configs/ddp.yaml"),
        (dict(dp_replicate=2, tp=2), "dp_replicate x dp_shard x tp = the processes"),
        (dict(dp_replicate=2, dp_shard=1, tp=2), "tp2_fsdp2.yaml"),
    ]:
        assert accelerate_refuses(math.prod(sizes.values()), **sizes), sizes
        got = refused(**sizes)
        assert list(got) == ["parallelism_config_dp_shard_size"] and fix in got["parallelism_config_dp_shard_size"], got
    assert accelerate_refuses(2, dp_replicate=-1, dp_shard=-2)
    got = refused(dp_replicate=-1, dp_shard=-2)
    assert list(got) == ["parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size"], got
    assert all("must be a whole number >= 1" in why for why in got.values())
    for sizes in (
        dict(dp_shard=2),
        dict(dp_shard=2, tp=2),
        dict(dp_replicate=2, dp_shard=2),
        dict(dp_replicate=2, dp_shard=2, tp=2),
    ):
        assert not accelerate_refuses(math.prod(sizes.values()), **sizes), sizes
        assert refused(**sizes) == {}, sizes


def dealt_by_accelerate(pc, rows: int) -> list[list[int]]:
    """The rows each rank's train loader yields (batch 1) under accelerate's ParallelismConfig pc, outside DeepSpeed:
    prepare_data_loader as accelerate calls it for that rank, with what it reads of the device mesh accelerate builds
    for pc (its dimension names and sizes, ParallelismConfig._get_mesh), in this process."""
    from types import SimpleNamespace

    from accelerate.data_loader import prepare_data_loader

    names, shape = pc._get_mesh()

    class Mesh:
        mesh_dim_names = names

        def __getitem__(self, name: str):
            return SimpleNamespace(size=lambda: shape[names.index(name)])

    loader = torch.utils.data.DataLoader(torch.arange(rows), batch_size=1)
    n = pc.total_size
    return [
        [int(b) for b in prepare_data_loader(loader, num_processes=n, process_index=rank, torch_device_mesh=Mesh())]
        for rank in range(n)
    ]


def fsdp_topology(pc, rank: int):
    """Topology.read of rank `rank` of an FSDP2 launch whose Accelerator holds pc (accelerate's started state, faked)."""
    from types import SimpleNamespace

    from finetune.parallel.topology import Topology

    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    state = SimpleNamespace(fsdp_plugin=SimpleNamespace(cpu_offload=None, fsdp_version=2), distributed_type="FSDP")
    accelerator = SimpleNamespace(state=state, num_processes=pc.total_size, process_index=rank, parallelism_config=pc)
    return Topology.read(accelerator, env)


@pytest.mark.parametrize(
    "sizes",
    [dict(dp_replicate_size=2, dp_shard_size=2), dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2)],
    ids=["hsdp", "hsdp_x_tp"],
)
def test_topology_counts_the_batches_accelerate_deals_under_hsdp(sizes):
    """HSDP (dp_replicate_size > 1) is data parallel: accelerate's loaders give every dp_replicate x dp_shard rank
    its own batches (prepare_data_loader: process_index // (tp x cp) of dp_replicate x dp_shard), and Topology.read's
    dp (processes / tp) and dp_rank (rank // tp) say which: rank r's j-th batch is j x dp + dp_rank
    (plan.global_batch_index), the tp ranks of a group reading the same."""
    from accelerate.parallelism_config import ParallelismConfig

    pc = ParallelismConfig(**sizes)
    dealt = dealt_by_accelerate(pc, rows=8 * pc.total_size)
    for rank, rows in enumerate(dealt):
        topology = fsdp_topology(pc, rank)
        assert (topology.dp, topology.tp) == (pc.data_parallel_size, pc.tp_size)
        # what FSDP2 shards over (sharding._fsdp): each dp_replicate group holds the whole model
        assert (topology.dp_replicate, topology.dp_shard) == (pc.dp_replicate_size, pc.dp_shard_size)
        assert rows == [j * topology.dp + topology.dp_rank for j in range(len(rows))], (rank, rows)


def test_context_parallel_ranks_read_one_batch_and_a_topology_refuses_them():
    """accelerate gives the cp ranks of a group the same batches (the reason fsdp/ddp/tensor/deepspeed.problems refuse
    parallelism_config_cp_size > 1); a Topology read from such an Accelerator would have counted every rank as data
    parallel (dp 4 where accelerate deals 2 ways), so Topology.read refuses it too. When the first assertion fails,
    accelerate deals context-parallel batches otherwise: look again at what finetune refuses."""
    from accelerate.parallelism_config import ParallelismConfig

    pc = ParallelismConfig(dp_shard_size=2, cp_size=2)
    dealt = dealt_by_accelerate(pc, rows=16)
    assert dealt[0] == dealt[1] != dealt[2] == dealt[3]
    with pytest.raises(ValueError, match="cp_size 2"):
        fsdp_topology(pc, 0)
