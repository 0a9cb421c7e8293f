"""Preference tuning (method dpo/ipo/orpo/simpo): the losses are TRL's formulas (written out here, apart from the
product's code), the reference log-probs are the starting model's, 2 ranks x GA 1 make the same updates as 1 rank x
GA 2, and what cannot work is refused by key."""

from __future__ import annotations

import contextlib
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import base_args, crash_after, finetune, max_rel_diff, max_weight_diff

from finetune.config import ConfigError, DataArgs, build_config
from finetune.preference import pair_losses, sequence_logps

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def pairs(path, n: int = 160, seed: int = 0, conversational: bool = False) -> str:
    """Pairs whose chosen answer lists the prompt's words sorted, the rejected one sorted backwards."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ws = rng.sample(WORDS, 4)
        prompt, good, bad = "List: " + " ".join(ws), " ".join(sorted(ws)), " ".join(sorted(ws, reverse=True))
        if conversational:
            user = [{"role": "user", "content": prompt}]
            rows.append({"chosen": user + [{"role": "assistant", "content": good}],
                         "rejected": user + [{"role": "assistant", "content": bad}]})  # fmt: skip
        else:
            rows.append({"prompt": prompt, "chosen": good, "rejected": bad})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------- TRL's formulas, written out


def trl_dpo(pc, pr, rc, rr, beta, ls):  # trl DPOTrainer.dpo_loss, loss_type "sigmoid"
    logits = (pc - pr) - (rc - rr)
    losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    return losses, beta * (pc - rc), beta * (pr - rr)


def trl_ipo(pc, pr, rc, rr, beta):  # loss_type "ipo": log-probs averaged over the answer's tokens first
    logits = (pc - pr) - (rc - rr)
    return (logits - 1 / (2 * beta)) ** 2


def trl_orpo(ac, ar, beta):  # ORPOTrainer.odds_ratio_loss (average log-probs), plus the chosen NLL
    log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
    return -ac - beta * F.logsigmoid(log_odds), beta * ac, beta * ar


def trl_simpo(ac, ar, beta, gamma, ls):  # CPOTrainer.cpo_loss, loss_type "simpo" (cpo_alpha 0)
    logits = (ac - ar) - gamma / beta
    return -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls


def test_the_losses_are_trls_formulas():
    g = torch.Generator().manual_seed(0)
    nc, nr = torch.randint(1, 30, (6,), generator=g), torch.randint(1, 30, (6,), generator=g)
    pc, pr = (
        -torch.rand(6, generator=g, dtype=torch.float64) * nc,
        -torch.rand(6, generator=g, dtype=torch.float64) * nr,
    )
    rc, rr = (
        pc + torch.randn(6, generator=g, dtype=torch.float64),
        pr + torch.randn(6, generator=g, dtype=torch.float64),
    )
    close = lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-12)  # noqa: E731
    for ls in (0.0, 0.2):
        ours, want = pair_losses("dpo", 0.3, (pc, pr), (nc, nr), (rc, rr), ls), trl_dpo(pc, pr, rc, rr, 0.3, ls)
        assert all(close(a, b) for a, b in zip(ours, want))
    ipo = pair_losses("ipo", 0.3, (pc, pr), (nc, nr), (rc, rr))[0]
    assert close(ipo, trl_ipo(pc / nc, pr / nr, rc / nc, rr / nr, 0.3))
    ours = pair_losses("orpo", 0.25, (pc, pr), (nc, nr))
    assert all(close(a, b) for a, b in zip(ours, trl_orpo(pc / nc, pr / nr, 0.25)))
    simpo = pair_losses("simpo", 2.0, (pc, pr), (nc, nr), None, 0.1, 0.5)[0]
    assert close(simpo, trl_simpo(pc / nc, pr / nr, 2.0, 0.5, 0.1))
    assert pair_losses("dpo", 0.1, (pc, pr), (nc, nr), (pc, pr))[0].sub(math.log(2)).abs().max() < 1e-12

    logits, labels = torch.randn(3, 7, 11, generator=g), torch.randint(0, 11, (3, 7), generator=g)
    labels[:, :3] = -100  # the prompt
    for grad in (True, False):  # without gradients (evaluation, the references' pass) it goes a row at a time
        with torch.set_grad_enabled(grad):
            sums, counts = sequence_logps(logits, labels)
        assert sums.shape == counts.shape == (3,)
        for row in range(3):  # token by token: log p(label t | tokens before t)
            want = sum(torch.log_softmax(logits[row, t - 1], -1)[labels[row, t]] for t in range(3, 7))
            assert abs(sums[row] - want) < 1e-5 and counts[row] == 4


# ---------------------------------------------------------------- the data


def test_pairs_in_text_and_conversational_shapes(assets, tmp_path):
    from finetune.data import Collator, build_datasets

    text = build_datasets(
        DataArgs(dataset=pairs(tmp_path / "t.jsonl"), max_seq_length=64, eval_fraction=0),
        "causal_lm", assets.tokenizer, 1, contextlib.nullcontext,
    )  # fmt: skip
    chat = build_datasets(
        DataArgs(dataset=pairs(tmp_path / "c.jsonl", conversational=True), max_seq_length=64, eval_fraction=0),
        "causal_lm", assets.tokenizer, 1, contextlib.nullcontext,
    )  # fmt: skip
    assert text.format == chat.format == "preference" and len(text.train) == len(chat.train) == 160
    row = text.train[0]
    tok = assets.tokenizer
    assert row["chosen_ids"][-1] == tok.eos_token_id and row["chosen_ids"] != row["rejected_ids"]
    assert tok.decode(row["chosen_ids"][:-1]).strip() == json.loads(open(tmp_path / "t.jsonl").readline())["chosen"]
    c = chat.train[0]
    assert tok.decode(c["prompt_ids"]).endswith(tok.decode(tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True))[-20:])  # fmt: skip
    batch = Collator(tok.pad_token_id)([text.train[i] for i in range(3)])
    assert batch["input_ids"].shape[0] == 6 and batch["num_supervised"] == 3
    learned = (batch["labels"] != -100).sum(1).tolist()
    assert learned == [len(text.train[i]["chosen_ids"]) for i in range(3)] + [
        len(text.train[i]["rejected_ids"]) for i in range(3)
    ]


def test_pairs_with_nothing_to_compare_are_refused_or_dropped(assets, tmp_path):
    from finetune.data import build_datasets

    path = tmp_path / "same.jsonl"
    rows = [{"prompt": f"p{i}", "chosen": "same", "rejected": "same"} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as e:
        build_datasets(DataArgs(dataset=str(path), eval_fraction=0), "causal_lm", assets.tokenizer, 1,
                       contextlib.nullcontext)  # fmt: skip
    key, message = e.value.problems[0]
    assert key == "rejected_column" and "same 'chosen' and 'rejected'" in message
    rows[0]["rejected"] = "different"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = build_datasets(DataArgs(dataset=str(path), eval_fraction=0), "causal_lm", assets.tokenizer, 1,
                        contextlib.nullcontext)  # fmt: skip
    assert len(ds.train) == 1 and ds.supervised_tokens == 1


def test_conversational_pairs_a_template_cannot_render_are_refused_naming_the_row(assets, tmp_path):
    """A template whose generation prompt is not the start of the answered conversation, and one that raises on a
    pair (jinja's raise_exception): refused at the first such pair, by row, with the fix."""
    from transformers import AutoTokenizer

    from finetune.data import build_datasets

    path = Path(pairs(tmp_path / "c.jsonl", n=12, conversational=True))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[7]["chosen"][-1]["content"] += " FORBIDDEN"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    turns = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    refusing = "{% for m in messages %}{% if 'FORBIDDEN' in m.content %}{{ raise_exception('no forbidden words') }}"
    for template, key, says in (
        (turns + "{% if add_generation_prompt %}ASSISTANT>{% endif %}", "dataset",
         "train row 0: the chat template does not render the prompt as the start of the whole conversation"),
        (refusing + "{% endif %}" + turns[len("{% for m in messages %}"):] + "{% if add_generation_prompt %}assistant: "
         "{% endif %}", "chat_template", "train row 7: the chat template cannot render this conversation "
         "(TemplateError: no forbidden words)"),
    ):  # fmt: skip
        tok = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
        tok.chat_template = template
        with pytest.raises(ConfigError) as refused:
            build_datasets(DataArgs(dataset=str(path), eval_fraction=0), "causal_lm", tok, 1,
                           contextlib.nullcontext)  # fmt: skip
        [(k, message)] = refused.value.problems
        assert k == key and says in message and "chat_template" in message, message


# ---------------------------------------------------------------- runs


def _references_of_the_start(model_dir, tokenizer, ds, adapter: str | None = None) -> torch.Tensor:
    """Summed answer log-probs of each train pair under the starting model (the base with `adapter` loaded, where
    one is continued), one pair at a time, token by token."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        net = PeftModel.from_pretrained(net, adapter).eval()
    out = []
    with torch.no_grad():
        for row in ds:
            p = row["prompt_ids"]
            pair = []
            for answer in (row["chosen_ids"], row["rejected_ids"]):
                logp = torch.log_softmax(net(torch.tensor([p + answer])).logits[0].double(), -1)
                pair.append(sum(logp[len(p) + k - 1, a].item() for k, a in enumerate(answer)))
            out.append(pair)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(
    "method, peft, layouts",
    [
        # (ZeRO-1 and DDP with a live reference: what ZeRO-2 offload's live frozen copy and orpo's ddp cover; suite time)
        ("dpo", "none", ["zero3", "zero3+live+chunked", "fsdp2+live", "zero2_offload+live"]),
        ("orpo", "none", ["ddp", "zero3", "fsdp2+chunked"]),
        ("dpo", "lora", ["zero3+live"]),  # the references precomputed under ZeRO-3: without the adapter, above
        ("dpo", "dora", ["fsdp2+live"]),  # DoRA's magnitudes with the adapter disabled; DoRA under ZeRO-3: test_peft
    ],
)
def test_every_layout_equals_one_process_with_accumulation(assets, tmp_path, method, peft, layouts):
    """2 ranks x GA 1 under each layout against 1 process x GA 2: losses, rewards and eval within 1e-5, exported
    weights (LoRA: the adapter) within 2e-5; dpo's reference log-probs, computed by the prepared model under each layout, equal the
    starting model's own, pair by pair (LoRA: the base model's). +live: `reference: live` (a frozen copy of the
    starting model placed as the layout places the trained one; LoRA: the base with the adapter disabled) in each
    micro batch, against the one process's precomputed references. +chunked: `chunked_loss: true` (the answers'
    log-probs a chunk of the head's output at a time, the frozen copy's too), against the one process without it."""
    data = pairs(tmp_path / "pairs.jsonl")
    args = base_args(
        assets.llama, data, "--method", method, "--max_steps", "4", "--per_device_train_batch_size", "2",
        "--eval_fraction", "0.1", "--beta", "0.5", "--peft.method", peft,
    )  # fmt: skip
    weights = "adapter_model.safetensors" if peft != "none" else "model.safetensors"
    one = finetune(tmp_path / "one", *args, "--gradient_accumulation_steps", "2")
    assert len(one.losses()) == 4 and one.eval_rows
    runs = [
        finetune(tmp_path / layout, *args, *(["--reference", "live"] if "+live" in layout else []),
                 *(["--chunked_loss", "true", "--loss_chunk_tokens", "50"] if "+chunked" in layout else []),
                 launcher=layout.split("+")[0])
        for layout in layouts
    ]  # fmt: skip
    assert "chunked loss: up to" not in one.output
    for layout, two in zip(layouts, runs):
        assert ("chunked loss: up to 50 tokens" in two.output) == ("+chunked" in layout), layout
        assert max_rel_diff(one.losses(), two.losses()) <= 1e-5, layout
        for key in ("rewards_chosen", "reward_accuracy", "logps_rejected"):
            a, b = [r[key] for r in one.train_rows], [r[key] for r in two.train_rows]
            assert len(a) == len(b) == 4 and all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b)), key
        assert abs(one.eval_rows[-1]["eval_loss"] / two.eval_rows[-1]["eval_loss"] - 1) <= 1e-5, layout
        # 2e-5 = 2% of one Adam step (lr 1e-3): an element whose gradient is near zero (ORPO's ZeRO-3 run has one,
        # its next-largest difference is 1e-7) has it scaled up to a step by Adam, and so the summation order too
        assert max_weight_diff(one.output_dir / "final", two.output_dir / "final", weights) <= 2e-5, layout
    if method != "dpo":
        return
    assert one.losses()[0] == pytest.approx(math.log(2), abs=1e-5)  # the policy starts as the reference
    from finetune.data import build_datasets

    ds = build_datasets(DataArgs(dataset=data, max_seq_length=64, eval_fraction=0.1), "causal_lm", assets.tokenizer,
                        42, contextlib.nullcontext)  # fmt: skip
    want = _references_of_the_start(assets.llama, assets.tokenizer, ds.train)
    assert want.shape == (len(ds.train), 2)
    for layout, run in zip(["single", *layouts], (one, *runs)):
        if "+live" in layout:
            copy = (
                "a frozen copy of the starting model" if peft == "none" else "the base model with the adapter disabled"
            )
            assert f"reference log-probs: live, {copy}" in run.output
            assert not (run.output_dir / "reference_logps.pt").exists()
            continue
        saved = torch.load(run.output_dir / "reference_logps.pt", weights_only=True)["train"]
        assert saved.shape == want.shape and (saved - want).abs().max() <= 1e-6 * want.abs().max()


def test_resume_between_two_log_rows_continues_the_reward_statistics(assets, tmp_path):
    """dpo, a checkpoint between two log rows: the resumed run's rows, reward statistics included, are the
    uninterrupted run's (the window's sums before the checkpoint are in it)."""
    args = base_args(
        assets.llama, pairs(tmp_path / "pairs.jsonl"), "--method", "dpo", "--max_steps", "4", "--logging_steps", "3",
        "--save_steps", "2", "--per_device_train_batch_size", "2", "--eval_fraction", "0", "--beta", "0.5",
    )  # fmt: skip
    keys = ("step", "loss", "tokens_seen", "rewards_chosen", "reward_margin", "reward_accuracy", "logps_rejected")
    straight = [{k: r[k] for k in keys} for r in finetune(tmp_path / "run", *args).train_rows]
    crash_after(tmp_path / "run", 2)
    resumed = finetune(tmp_path / "run", *args, "--resume_from_checkpoint", "latest")
    assert [{k: r[k] for k in keys} for r in resumed.train_rows] == straight and [r["step"] for r in straight] == [3, 4]


def test_method_and_data_that_do_not_fit_are_refused(assets, tmp_path):
    sft_on_pairs = finetune(tmp_path / "a", *base_args(assets.llama, pairs(tmp_path / "p.jsonl"), "--max_steps", "1"),
                            launcher="python", expect_ok=False)  # fmt: skip
    assert sft_on_pairs.returncode == 2 and "  - method: method sft cannot train preference data" in sft_on_pairs.output
    dpo_on_sft = finetune(tmp_path / "b", *base_args(assets.llama, assets.instruction, "--method", "dpo"),
                          launcher="python", expect_ok=False)  # fmt: skip
    assert dpo_on_sft.returncode == 2 and "  - method: method dpo cannot train instruction data" in dpo_on_sft.output
    packed = finetune(tmp_path / "c", *base_args(assets.llama, pairs(tmp_path / "p.jsonl"), "--method", "orpo",
                      "--packing", "true"), launcher="python", expect_ok=False)  # fmt: skip
    assert packed.returncode == 2 and "  - packing: is not supported with method orpo" in packed.output
    for out in (sft_on_pairs, dpo_on_sft, packed):
        assert "Traceback" not in out.output


def _greedy_orders(model_dir, tokenizer, word_sets: list[list[str]]) -> tuple[int, int]:
    """How many greedy answers (transformers' generate, the prompt as instruction rows show it) start as the sorted
    list does (the prompt's smallest word first), and how many as the backwards one (its largest word first)."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    template = DataArgs(dataset="x").prompt_template
    ahead = backwards = 0
    for ws in word_sets:
        ids = tokenizer(template.format(prompt="List: " + " ".join(ws)), return_tensors="pt").input_ids
        out = net.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        said = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split()[:1]
        ahead += said == [min(ws)]
        backwards += said == [max(ws)]
    return ahead, backwards


def test_dpo_learns_a_preference_it_was_not_shown(assets, tmp_path):
    """The SFT start: the tiny model fine-tuned on the pairs' prompts answered half sorted, half backwards (it lists
    the words, in either order). DPO from it: on held-out pairs (word sets not trained on) the reward ranks the
    sorted answer over the backwards one in >= 90% of them after 40 steps (at the start the policy is the reference
    and ranks none: every margin 0), and on unseen word sets the trained model's greedy answers start as the
    sorted answer does more often than the SFT start's do, and as the backwards one less often (measured: of 60,
    26 / 30 at the start, 45 / 6 after)."""
    data = pairs(tmp_path / "pairs.jsonl", n=400, seed=1)
    sft_rows = [
        {"prompt": r["prompt"], "response": r["chosen"] if k % 2 else r["rejected"]}
        for k, r in enumerate(map(json.loads, Path(data).read_text().splitlines()))
    ]
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    sft = finetune(tmp_path / "sft", *base_args(assets.llama, str(sft_data), "--max_steps", "400",
                   "--per_device_train_batch_size", "16", "--learning_rate", "3e-3", "--eval_fraction", "0",
                   "--logging_steps", "100"), launcher="python")  # fmt: skip
    args = base_args(
        str(sft.output_dir / "final"), data, "--method", "dpo", "--beta", "0.5", "--max_steps", "40",
        "--per_device_train_batch_size", "8", "--learning_rate", "3e-4", "--eval_fraction", "0.2",
        "--eval_on_start", "true", "--logging_steps", "10", "--generation_max_new_tokens", "6",
        "--generation_num_examples", "8",
    )  # fmt: skip
    r = finetune(tmp_path / "dpo", *args, launcher="python")
    start, end = r.eval_rows[0], r.eval_rows[-1]
    assert start["step"] == 0 and start["eval_reward_margin"] == 0 and start["eval_reward_accuracy"] == 0
    assert end["step"] == 40 and end["eval_reward_accuracy"] >= 0.9 and end["eval_reward_margin"] > 1, end
    # each statistic the eval reports may be metric_for_best_model, and only those (it checked sft's keys: refused
    # eval_reward_accuracy and took perplexity, which then stopped the run at its first eval)

    reported = [k for k in end if k.startswith(("eval_loss", "eval_reward", "eval_logps"))]
    assert len(reported) == 7, end
    values = {"model": "m", "dataset": "d.jsonl", "output_dir": str(tmp_path / "x"), "method": "dpo"}
    for key in reported:
        build_config({**values, "metric_for_best_model": key}, check_filesystem=False)
    with pytest.raises(ConfigError) as refused:
        build_config({**values, "metric_for_best_model": "perplexity"}, check_filesystem=False)
    assert [k for k, _ in refused.value.problems] == ["metric_for_best_model"]
    # generation eval: the prompts continued and scored against the chosen answers, at every eval
    assert all("eval_exact_match" in row for row in (start, end))
    samples = [row["eval_samples"] for row in r.rows if "eval_samples" in row]
    assert len(samples) == len(r.eval_rows) == 2 and all(s and s[0]["reference"] for s in samples), samples[:1]
    seen = {frozenset(json.loads(line)["prompt"].split()[1:]) for line in Path(data).read_text().splitlines()}
    rng = random.Random(7)
    unseen = [ws for ws in (rng.sample(WORDS, 4) for _ in range(400)) if frozenset(ws) not in seen][:60]
    assert len(unseen) == 60
    before = _greedy_orders(sft.output_dir / "final", assets.tokenizer, unseen)
    after = _greedy_orders(r.output_dir / "final", assets.tokenizer, unseen)
    print("greedy answers starting sorted / backwards, SFT start and after DPO:", before, after)
    assert sum(before) >= 40, before  # the SFT start lists the words, in either order
    assert after[0] >= before[0] + 10 and after[1] < before[1], (before, after)


def test_a_mixture_of_preference_sources_trains_with_one_reference_row_per_pair(assets, tmp_path):
    """Two weighted preference sources (text pairs and conversations): every pair of the concatenation has its own
    reference row (indices 0..N-1 in train and in eval), and a DPO run over the mixture starts at log 2."""
    import yaml

    from finetune.mixture import build_mixture_datasets

    sources = [
        {"dataset": pairs(tmp_path / "text.jsonl", n=60), "weight": 1.0},
        {"dataset": pairs(tmp_path / "chat.jsonl", n=40, seed=3, conversational=True), "weight": 2.0},
    ]
    run = {"model": assets.llama, "datasets": sources, "max_seq_length": 64, "eval_fraction": 0.1,
           "output_dir": str(tmp_path / "x")}  # fmt: skip
    ds = build_mixture_datasets(build_config(run).data, "causal_lm", assets.tokenizer, 42, contextlib.nullcontext)
    assert ds.format == "preference" and len(ds.train) == 54 + 36 and len(ds.eval) == 10
    assert ds.train["pair_index"] == list(range(90)) and ds.eval["pair_index"] == list(range(10))
    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in run.items() if k != "output_dir"}))
    more = ["--method", "dpo", "--max_steps", "3", "--per_device_train_batch_size", "4", "--save_steps", "null"]
    more += ["--logging_steps", "1"]
    r = finetune(tmp_path / "run", "--config", str(config), *more, launcher="python")
    assert len(r.losses()) == 3 and r.losses()[0] == pytest.approx(math.log(2), abs=1e-5)
    assert r.eval_rows and "eval_reward_accuracy" in r.eval_rows[-1]


def test_a_live_reference_needs_a_method_that_compares(tmp_path):

    values = {"model": "m", "dataset": "d.jsonl", "output_dir": str(tmp_path), "method": "dpo", "reference": "live"}
    for more, key, says in (
        ({"method": "orpo"}, "reference", "orpo compares with no reference model"),
        ({"reference": "online"}, "reference", "'online'"),
    ):
        with pytest.raises(ConfigError) as refused:
            build_config({**values, **more}, check_filesystem=False)
        assert any(k == key and says in why for k, why in refused.value.problems), refused.value.problems
    assert build_config(values, check_filesystem=False).train.reference == "live"


def test_a_live_reference_refuses_a_continued_adapter(tmp_path):
    """reference: live with an adapter runs the policy with its adapter disabled: the base model, which is where
    training starts only for a fresh adapter (LoRA's B = 0). Continuing one (peft.adapter) would pull towards the
    base model, not the model training starts from: refused, naming both keys and the fix."""

    values = {"model": "m", "dataset": "d.jsonl", "output_dir": str(tmp_path), "method": "dpo", "reference": "live"}
    continued = {"method": "lora", "adapter": str(tmp_path / "sft" / "final")}
    for method in ("dpo", "ipo"):
        with pytest.raises(ConfigError) as refused:
            build_config({**values, "method": method, "peft": continued}, check_filesystem=False)
        [(key, says)] = [(k, why) for k, why in refused.value.problems if "peft.adapter" in why]
        assert key == "reference" and "reference: precomputed" in says, says
    fresh = build_config({**values, "peft": {"method": "lora"}}, check_filesystem=False)
    assert fresh.train.reference == "live" and fresh.peft.adapter is None
    precomputed = build_config({**values, "reference": "precomputed", "peft": continued}, check_filesystem=False)
    assert precomputed.peft.adapter == continued["adapter"]


def test_precomputed_references_of_a_continued_adapter_are_the_starting_models(assets, tmp_path):
    """What the refusal above points to: DPO continuing an adapter whose B != 0 (peft.adapter) with precomputed
    references computes them with the adapter on: the base + adapter's log-probs, pair by pair (not the base
    model's), and the first loss is log 2 (the policy starts as its reference)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.data import build_datasets

    net = get_peft_model(
        AutoModelForCausalLM.from_pretrained(assets.llama), LoraConfig(r=4, target_modules="all-linear")
    )
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    adapter = tmp_path / "sft_final"
    net.save_pretrained(adapter)
    data = pairs(tmp_path / "pairs.jsonl", n=24)
    args = base_args(assets.llama, data, "--method", "dpo", "--max_steps", "1", "--eval_fraction", "0",
                     "--peft.method", "lora", "--peft.adapter", str(adapter))  # fmt: skip
    run = finetune(tmp_path / "dpo", *args)
    assert run.losses()[0] == pytest.approx(math.log(2), abs=1e-5)
    ds = build_datasets(DataArgs(dataset=data, max_seq_length=64, eval_fraction=0), "causal_lm", assets.tokenizer, 42,
                        contextlib.nullcontext)  # fmt: skip
    start = _references_of_the_start(assets.llama, assets.tokenizer, ds.train, adapter=str(adapter))
    base = _references_of_the_start(assets.llama, assets.tokenizer, ds.train)
    saved = torch.load(run.output_dir / "reference_logps.pt", weights_only=True)["train"]
    assert (saved - start).abs().max() <= 1e-6 * start.abs().max()
    assert (base - start).abs().max() > 0.1  # the adapter moves them: the base would be the wrong reference


# finetune with the frozen live reference's parameters checked after each of its passes: the names of those not
# sharded (not DTensors) then, per pass, in $PROBE_DIR/rank<r>.json. Launched in place of `-m finetune`.
FROZEN_PROBE = """
import json, os, sys
from torch.distributed.tensor import DTensor
import finetune.preference as preference
from finetune.cli import run_cli

passes, live = [], preference.live_reference

def checked(backend, model, adapter):
    logps = live(backend, model, adapter)
    def after(batch):
        out = logps(batch)
        passes.append([n for n, p in model.named_parameters() if not isinstance(p, DTensor)])
        return out
    return after

preference.live_reference = checked
sys.argv[0] = "finetune"
code = run_cli()
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(passes, f)
os._exit(code)
"""


def test_fsdp2_reshards_the_frozen_reference_after_each_pass(assets, tmp_path):
    """Under FSDP2 a forward leaves the modules that end it (final norm, LM head: reshard_after_forward False, for
    the backward that follows) whole; the frozen live reference runs no backward, so after each of its passes
    backend.end_inference reshards it: every parameter is its DTensor shard again, on every rank, at every pass."""
    probe = tmp_path / "probe"
    probe.mkdir()
    script = tmp_path / "frozen_probe.py"
    script.write_text(FROZEN_PROBE)
    args = base_args(assets.llama, pairs(tmp_path / "pairs.jsonl", n=32), "--method", "dpo", "--reference", "live",
                     "--max_steps", "2", "--eval_fraction", "0")  # fmt: skip
    finetune(tmp_path / "run", *args, launcher="fsdp2", entry=(str(script),), extra_env={"PROBE_DIR": str(probe)})
    reports = {p.name: json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))}
    assert list(reports) == ["rank0.json", "rank1.json"]
    for name, passes in reports.items():
        assert len(passes) == 2 and passes == [[], []], (name, passes)  # a pass per step; nothing left whole


def test_references_are_made_from_the_pairs_not_the_files_paths_or_times(assets, tmp_path):
    """The check a resume makes of reference_logps.pt: a copy of the same pairs at another path and time (another
    machine's own copy beside a shared output_dir) is the same data; other pairs are not. It hashed datasets'
    fingerprints, which hold the file's path and modification time: that machine's resume was always refused."""
    import contextlib
    import os
    import shutil

    from transformers import AutoTokenizer

    from finetune.data import build_datasets
    from finetune.preference import references_made_from

    tokenizer = AutoTokenizer.from_pretrained(assets.llama)

    def made_from(path) -> str:
        cfg = build_config({"model": assets.llama, "dataset": str(path), "output_dir": str(tmp_path / "x"),
                            "method": "dpo", "eval_fraction": 0.1}, check_filesystem=False)  # fmt: skip
        ds = build_datasets(cfg.data, "causal_lm", tokenizer, 42, contextlib.nullcontext)
        return references_made_from(ds, assets.llama)

    original = pairs(tmp_path / "pairs.jsonl", n=40)
    (tmp_path / "machine1").mkdir()
    copy = shutil.copy(original, tmp_path / "machine1" / "pairs.jsonl")
    os.utime(copy, (1_000_000, 1_000_000))
    assert made_from(original) == made_from(copy)
    assert made_from(original) != made_from(pairs(tmp_path / "other.jsonl", n=40, seed=1))
