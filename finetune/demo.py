"""Offline building blocks: a tokenizer, tiny base models and small task datasets, made locally.

Used by the demo (`./run.sh demo`, no Hugging Face Hub needed) and by the tests. Everything goes
through the same `save_pretrained` -> `from_pretrained` path a Hub model would.

    python -m finetune.demo prepare --dir demo      # demo/base_model, demo/data/{train,eval}.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]

TOPICS = {
    "sports": "match goal team coach season score player league stadium victory referee tournament",
    "weather": "rain storm sunny forecast wind cloud snow temperature cold humid thunder drizzle",
    "tech": "software laptop chip code server app network robot data battery processor update",
    "food": "recipe bread soup chef spice dinner cheese oven fruit salad butter flavor",
}
FILLER = (
    "the a this that my our their today yesterday again really very quite new old big small good bad "
    "people city morning evening week news report talk story was is seems looked felt about with"
).split()


def topic_examples(n: int, seed: int) -> list[dict]:
    """Short sentences, each about one of four topics: words of its topic among neutral filler."""
    rng = random.Random(seed)
    names = sorted(TOPICS)
    out = []
    for _ in range(n):
        label = rng.choice(names)
        words = [rng.choice(FILLER) for _ in range(rng.randint(5, 10))]
        for w in rng.sample(TOPICS[label].split(), rng.randint(1, 3)):
            words.insert(rng.randrange(len(words) + 1), w)
        out.append({"text": " ".join(words), "label": label})
    return out


def instruction_examples(n: int, seed: int) -> list[dict]:
    """prompt/response pairs: name the topic of a sentence."""
    return [
        {"prompt": f"Which topic is this about? {e['text']}", "response": f"It is about {e['label']}."}
        for e in topic_examples(n, seed)
    ]


def chat_examples(n: int, seed: int) -> list[dict]:
    """Two-turn conversations (system, user, assistant, user, assistant)."""
    rng = random.Random(seed)
    out = []
    for e in topic_examples(n, seed):
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "You name topics."},
                    {"role": "user", "content": e["text"]},
                    {"role": "assistant", "content": e["label"]},
                    {"role": "user", "content": "Are you sure?"},
                    {"role": "assistant", "content": rng.choice(["Yes.", "Quite sure.", f"Yes, {e['label']}."])},
                ]
            }
        )
    return out


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def build_tokenizer(path: str | os.PathLike, vocab_size: int = 600, chat_template: bool = True):
    """A byte-level BPE tokenizer trained on the demo vocabulary, saved as a standard HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = (
        [e["text"] for e in topic_examples(2000, 0)]
        + [" ".join(TOPICS)]
        + [
            "Which topic is this about? It is about Are you sure? Yes. Quite sure. You name topics. system user assistant"
        ]
    )
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=512,
    )
    if chat_template:
        hf.chat_template = CHATML
    hf.save_pretrained(path)
    return hf


def llama_config(
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int = 32000,
    max_positions: int = 512,
    **more,
):
    """A Llama-shaped transformers config, the one builder of the demo's, the benchmarks' and the tests' Llamas:
    the demo's tiny one with its defaults; intermediate defaults to SwiGLU's ~8/3 x hidden (rounded to 64)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate or 64 * round(8 * hidden / 3 / 64),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        **more,
    )


def build_model(arch: str, path: str | os.PathLike, tokenizer, seed: int = 0, **overrides):
    """A tiny randomly initialised base model of a real architecture, saved with its tokenizer.

    arch: llama, qwen2, qwen3, gpt2 (causal LMs, also usable as classifiers), bert (an encoder for classification), or t5,
    bart (encoder-decoders, task seq2seq). Dropout is off unless asked (overrides), so runs are exactly comparable.
    """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; use one of {', '.join(TINY_CONFIGS)}")
    config = TINY_CONFIGS[arch](
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    auto = {"bert": AutoModel, "t5": AutoModelForSeq2SeqLM, "bart": AutoModelForSeq2SeqLM}.get(
        arch, AutoModelForCausalLM
    )
    model = auto.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _tiny_gpt2(**ids):
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids
    )


def _tiny_bert(**ids):
    from transformers import BertConfig

    return BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **ids,
    )


def _tiny_t5(**ids):  # the decoder starts from the pad token, as in T5
    from transformers import T5Config

    return T5Config(
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        decoder_start_token_id=ids["pad_token_id"],
        **ids,
    )


def _tiny_bart(**ids):  # the decoder starts from EOS, as in BART
    from transformers import BartConfig

    return BartConfig(
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=512,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        decoder_start_token_id=ids["eos_token_id"],
        forced_eos_token_id=ids["eos_token_id"],
        **ids,
    )


def _tiny_decoder(model_type: str):
    """The tiny Llama's shape in another decoder family: qwen2 (biases on q, k and v), qwen3 (per-head q/k norms),
    qwen3_moe (those norms and a mixture of experts)."""

    def build(vocab_size: int, **ids):
        from transformers import AutoConfig

        shape = llama_config(kv_heads=2, intermediate=128, vocab=vocab_size).to_dict()
        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        keep += ("vocab_size", "max_position_embeddings", "tie_word_embeddings")
        return AutoConfig.for_model(model_type, head_dim=16, **{k: shape[k] for k in keep}, **ids)

    return build


TINY_CONFIGS = {
    "llama": lambda vocab_size, **ids: llama_config(kv_heads=2, intermediate=128, vocab=vocab_size, **ids),
    "qwen2": _tiny_decoder("qwen2"),
    "qwen3": _tiny_decoder("qwen3"),
    "qwen3_moe": _tiny_decoder("qwen3_moe"),  # give num_experts etc. (its defaults are Qwen3-30B-A3B's 128 experts)
    "gpt2": _tiny_gpt2,
    "bert": _tiny_bert,
    "t5": _tiny_t5,
    "bart": _tiny_bart,
}


def prepare(workdir: str | os.PathLike, n_train: int = 4000, n_eval: int = 400) -> dict[str, str]:
    """Everything the demo needs, under workdir: base model + tokenizer, and a 4-topic dataset."""
    work = Path(workdir)
    tok = build_tokenizer(work / "tokenizer")
    model_dir = build_model("llama", work / "base_model", tok)
    train = write_jsonl(topic_examples(n_train, seed=1), work / "data" / "train.jsonl")
    evalset = write_jsonl(topic_examples(n_eval, seed=2), work / "data" / "eval.jsonl")
    return {"model": model_dir, "train": train, "eval": evalset}


def _main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the demo base model, tokenizer and data")
    p.add_argument("--dir", default="demo", help="where to put them (default: demo)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Building the model on the CPU: DeepSpeed (imported by transformers when installed) need not guess the device
    # (its guess prints "Setting accelerator to CPU"), and one tiny model needs no progress bar.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    out = prepare(args.dir)
    print(f"demo base model: {out['model']}\ndemo data: {out['train']}, {out['eval']}")


if __name__ == "__main__":
    _main()
