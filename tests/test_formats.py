"""The shapes the Hub writes data in (formats.py): each is found without configuration, the same conversation in any
of them is the same tokens and labels (and so the same training), and bad rows are named as what they are.

Tokens and labels are checked against the chat template's own rendering here, not against the product's code.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import random

import pytest
from conftest import base_args, finetune, max_weight_diff

from finetune.config import ConfigError, DataArgs
from finetune.data import IGNORE, build_datasets
from finetune.demo import write_jsonl

SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}
# A ChatML template that renders tool definitions in the system turn (as Qwen's and Hermes' do).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }}"
    "({{ t['function']['parameters'] | tojson }}) {% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Single-answer conversations (optional system, user, assistant): every chat shape can hold them."""
    rng = random.Random(seed)
    words = "match rain code bread storm team chip soup wind goal oven data".split()
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "You name topics."}] if i % 3 else []
        turns.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 9)))})
        turns.append({"role": "assistant", "content": rng.choice(["sports", "weather", "tech", "food"]) + f" {i}"})
        out.append(turns)
    return out


def multi_turn(convs: list[list[dict]], answers: list[str], seed: int) -> list[list[dict]]:
    """Each conversation with 0 to 2 more exchanges ("Are you sure?" and one of the answers) after it."""
    rng = random.Random(seed)
    more = [{"role": "user", "content": "Are you sure?"}, {"role": "assistant", "content": ""}]
    out = []
    for c in convs:
        turns = [[more[0], {**more[1], "content": rng.choice(answers)}] for _ in range(rng.randint(0, 2))]
        out.append(c + [m for turn in turns for m in turn])
    return out


def as_messages(convs):
    return [{"messages": c} for c in convs]


def as_prompt_completion(convs):
    return [{"prompt": c[:-1], "completion": c[-1:]} for c in convs]


def as_sharegpt(convs):
    return [{"conversations": [{"from": SHAREGPT[m["role"]], "value": m["content"]} for m in c]} for c in convs]


def as_text_pairs(convs, answer: str):
    return [{"prompt": c[-2]["content"], answer: c[-1]["content"]} for c in convs]


def build(path: str, tokenizer, **kw):
    data = DataArgs(dataset=path, **{"eval_fraction": 0.0, **kw})
    return build_datasets(data, "causal_lm", tokenizer, 0, contextlib.nullcontext)


def tokens(ds) -> list[tuple[list[int], list[int]]]:
    return list(zip(ds.train["input_ids"], ds.train["labels"]))


def shape_said(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("data "))


@pytest.mark.parametrize("shape", ["messages", "sharegpt", "prompt_completion", "preference"])
def test_messages_whose_keys_differ_are_read_as_messages(assets, tmp_path, shape):
    """A key on some messages only (reasoning_content, tool_calls, a weight) makes datasets 5 read the column as lists
    of JSON values, which name no keys: still detected as messages in every conversational shape, and the same tokens
    and labels as without that key (the demo's template does not read it)."""
    import datasets

    convs = conversations(12, seed=6)
    if shape == "preference":
        rows = [{"prompt": c[:-1], "chosen": c[-1:], "rejected": [{**c[-1], "content": "no"}]} for c in convs]
    else:
        rows = {"messages": as_messages, "sharegpt": as_sharegpt, "prompt_completion": as_prompt_completion}[shape](
            convs
        )
    answers = {"messages": "messages", "sharegpt": "conversations"}.get(
        shape, "chosen" if shape == "preference" else "completion"
    )
    loose = [{**r, answers: [{**m, "weight": 0} for m in r[answers]]} if i % 2 else r for i, r in enumerate(rows)]
    plain_file, loose_file = write_jsonl(rows, tmp_path / "plain.jsonl"), write_jsonl(loose, tmp_path / "loose.jsonl")
    feature = datasets.load_dataset("json", data_files=loose_file, split="train").features[answers]
    assert isinstance(feature.feature, datasets.Json)  # what datasets made of it
    got, want = build(loose_file, assets.tokenizer), build(plain_file, assets.tokenizer)
    assert got.format == want.format == ("preference" if shape == "preference" else "chat")
    assert len(want.train) == len(convs)
    assert got.train.to_dict() == want.train.to_dict()


def test_every_conversational_shape_is_detected_and_gives_the_same_tokens_and_labels(assets, tmp_path, caplog):
    tok = assets.tokenizer
    convs = conversations(12)
    shapes = {
        "messages": (as_messages(convs), "conversations of {role, content} messages"),
        "prompt_completion": (as_prompt_completion(convs), "TRL's conversational prompt-completion"),
        "sharegpt": (as_sharegpt(convs), "ShareGPT conversations ({from, value} messages)"),
    }
    built = {}
    for name, (rows, shape) in shapes.items():
        caplog.clear()
        with caplog.at_level("INFO", logger="finetune"):
            ds = build(write_jsonl(rows, tmp_path / f"{name}.jsonl"), tok)
        assert ds.format == "chat" and shape in shape_said(caplog), (name, shape_said(caplog))
        built[name] = tokens(ds)
    expected = []  # from the template itself: the whole rendering, the assistant's answer and its end learned
    for c in convs:
        prompt = tok(tok.apply_chat_template(c[:-1], tokenize=False, add_generation_prompt=True))["input_ids"]
        whole = tok(tok.apply_chat_template(c, tokenize=False))["input_ids"]
        assert whole[: len(prompt)] == prompt
        expected.append((whole, [IGNORE] * len(prompt) + whole[len(prompt) :]))
        assert tok.decode(whole[len(prompt) :]) == c[-1]["content"] + "<|im_end|>\n"
    assert len(expected) == 12
    for name, got in built.items():
        assert got == expected, name


def test_conversational_prompt_completion_learns_only_the_completion(assets, tmp_path):
    """With an earlier assistant turn in the prompt: the messages shape learns both answers, prompt-completion only
    the completion's; the tokens are the same."""
    tok = assets.tokenizer
    convs = [c + [{"role": "user", "content": "sure?"}, {"role": "assistant", "content": f"yes {i}"}]
             for i, c in enumerate(conversations(6, seed=6))]  # fmt: skip
    whole = tokens(build(write_jsonl(as_messages(convs), tmp_path / "m.jsonl"), tok))
    split = tokens(
        build(write_jsonl([{"prompt": c[:-1], "completion": c[-1:]} for c in convs], tmp_path / "pc.jsonl"), tok)
    )
    assert len(whole) == 6 and [ids for ids, _ in whole] == [ids for ids, _ in split]
    for (_, all_labels), (_, labels), c in zip(whole, split, convs):
        assert tok.decode([t for t in labels if t != IGNORE]) == c[-1]["content"] + "<|im_end|>\n"
        learned = tok.decode([t for t in all_labels if t != IGNORE])
        assert learned == "".join(m["content"] + "<|im_end|>\n" for m in c if m["role"] == "assistant")
        assert learned.count("<|im_end|>") == 2


def test_standard_prompt_completion_is_prompt_response(assets, tmp_path, caplog):
    tok = assets.tokenizer
    convs = conversations(10, seed=1)
    built = {}
    for answer in ("response", "completion"):
        caplog.clear()
        with caplog.at_level("INFO", logger="finetune"):
            ds = build(write_jsonl(as_text_pairs(convs, answer), tmp_path / f"{answer}.jsonl"), tok)
        assert ds.format == "instruction"
        assert ("TRL's standard prompt-completion" in shape_said(caplog)) == (answer == "completion")
        built[answer] = tokens(ds)
    assert len(built["response"]) == 10 and built["response"] == built["completion"]
    for (ids, labels), c in zip(built["completion"], convs):
        learned = [t for t, lab in zip(ids, labels) if lab != IGNORE]
        assert tok.decode(learned) == c[-1]["content"] + tok.eos_token


def test_the_same_conversations_in_every_shape_train_the_same(assets, tmp_path):
    """Losses step by step and the exported weights: identical whichever shape the data is written in."""
    convs = conversations(48, seed=2)
    runs = {}
    for name, rows in {
        "messages": as_messages(convs),
        "sharegpt": as_sharegpt(convs),
        "prompt_completion": as_prompt_completion(convs),
    }.items():
        path = write_jsonl(rows, tmp_path / f"{name}.jsonl")
        args = base_args(assets.llama, path, "--max_steps", "4", "--eval_fraction", "0.1", "--seed", "3")
        runs[name] = finetune(tmp_path / f"out_{name}", *args, launcher="python")
    losses = {name: r.losses() for name, r in runs.items()}
    assert len(losses["messages"]) == 4, losses
    assert losses["sharegpt"] == losses["messages"] == losses["prompt_completion"], losses
    evals = {name: [row["eval_loss"] for row in r.eval_rows] for name, r in runs.items()}
    assert evals["messages"] and evals["sharegpt"] == evals["messages"] == evals["prompt_completion"], evals
    for other in ("sharegpt", "prompt_completion"):
        assert max_weight_diff(tmp_path / "out_messages" / "final", tmp_path / f"out_{other}" / "final") == 0.0


def test_role_and_content_keys_and_role_names_are_mapped(assets, tmp_path):
    """Any other shape through role_key, content_key and role_map: the same tokens as the messages shape; also per
    source of a mixture."""
    tok = assets.tokenizer
    convs = conversations(8, seed=3)
    names = {"system": "narrator", "user": "person", "assistant": "bot"}
    odd = [{"dialog": [{"speaker": names[m["role"]], "text": m["content"]} for m in c]} for c in convs]
    odd_path = write_jsonl(odd, tmp_path / "odd.jsonl")
    mapping = {"role_key": "speaker", "content_key": "text", "role_map": {v: k for k, v in names.items()}}
    mapped = build(odd_path, tok, format="chat", messages_column="dialog", **mapping)
    plain = build(write_jsonl(as_messages(convs), tmp_path / "plain.jsonl"), tok)
    assert len(tokens(plain)) == 8 and tokens(mapped) == tokens(plain)

    sharegpt = write_jsonl(as_sharegpt(convs), tmp_path / "sharegpt.jsonl")
    mix = DataArgs(
        datasets=[{"dataset": sharegpt}, {"dataset": odd_path, "messages_column": "dialog", **mapping}],
        eval_fraction=0.0,
    )
    from finetune.mixture import build_mixture_datasets

    both = build_mixture_datasets(mix, "causal_lm", tok, 0, contextlib.nullcontext)
    assert both.format == "chat" and len(both.train) == 16
    assert sorted(map(str, both.train["input_ids"])) == sorted(map(str, list(plain.train["input_ids"]) * 2))


def test_tools_reach_the_template_and_a_template_without_tools_is_refused(assets, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
    convs = conversations(6, seed=4)
    tools = [{"type": "function", "function": {"name": "topic_of", "parameters": {"type": "object"}}}]
    rows = [{"messages": c, "tools": tools if i % 2 else json.dumps(tools)} for i, c in enumerate(convs)]
    path = write_jsonl(rows, tmp_path / "tools.jsonl")
    with pytest.raises(ConfigError) as info:  # ChatML here never renders tools
        build(path, tok)
    assert [k for k, _ in info.value.problems] == ["tools_column"]
    without = build(path, tok, tools_column=None)
    tok.chat_template = TOOLS_TEMPLATE
    with_tools = build(path, tok)
    assert len(tokens(with_tools)) == 6
    for (ids, labels), (plain_ids, plain_labels), c in zip(tokens(with_tools), tokens(without), convs):
        text = tok.decode(ids)
        assert 'Tools: topic_of({"type": "object"})' in text and "topic_of" not in tok.decode(plain_ids)
        learned = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])
        assert learned == tok.decode([t for t, lab in zip(plain_ids, plain_labels) if lab != IGNORE])
        assert learned == c[-1]["content"] + "<|im_end|>\n"


@pytest.mark.parametrize(
    "rows, key, words",
    [
        ([{"messages": [], "conversations": []}], "messages_column", ["'messages'", "'conversations'"]),
        ([{"prompt": "p", "response": "r", "completion": "c"}], "response_column", ["'response'", "'completion'"]),
        (
            [{"prompt": [{"role": "user", "content": "p"}], "completion": "c"}],
            "response_column",
            ["holds messages but 'completion' holds text"],
        ),
        ([{"question": "q", "answer": "a"}], "format", ["['question', 'answer']", "set format"]),
        ([{"dialog": [{"who": "user", "said": "p"}]}], "role_key", ["['who', 'said']", "content_key"]),
    ],
    ids=["two_conversations", "two_answers", "mixed_prompt_completion", "unknown", "unknown_message_keys"],
)
def test_ambiguous_and_unknown_shapes_are_refused_with_the_columns_seen(assets, tmp_path, rows, key, words):
    extra = {"format": "chat", "messages_column": "dialog"} if "dialog" in rows[0] else {}
    with pytest.raises(ConfigError) as info:
        build(write_jsonl(rows * 4, tmp_path / "data.jsonl"), assets.tokenizer, **extra)
    [(said_key, message)] = info.value.problems
    assert said_key == key and all(w in message for w in words), message


def test_bad_rows_are_named_as_such(assets, tmp_path, caplog):
    """An unknown role, or a conversation the chat template raises on, stops the run naming the row; an empty completion and a conversation with no assistant
    turn are dropped, counted by why, with an example row, never blamed on truncation."""
    tok = assets.tokenizer
    convs = conversations(9, seed=5)
    rows = as_prompt_completion(convs)
    rows[2]["completion"] = []
    rows[5] = {"prompt": convs[5][:-1], "completion": [{"role": "user", "content": "and?"}]}
    with caplog.at_level("WARNING", logger="finetune"):
        ds = build(write_jsonl(rows, tmp_path / "pc.jsonl"), tok)
    assert len(ds.train) == 7
    said = caplog.text
    assert "dropped 2 of 9 training rows with nothing to learn" in said and "truncated" not in said
    assert "1 with an empty 'completion' (e.g. train row 2:" in said
    assert "1 with no assistant turn in 'completion' (e.g. train row 5:" in said

    # a template that raises (jinja's raise_exception) for one conversation of the batch: that row is named
    from transformers import AutoTokenizer

    refusing = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
    refusing.chat_template = (
        "{% for m in messages %}{% if 'FORBIDDEN' in m.content %}{{ raise_exception('no forbidden words') }}"
        "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    marked = json.loads(json.dumps(as_messages(convs)))  # (its own messages)
    marked[6]["messages"][-1]["content"] += " FORBIDDEN"
    with pytest.raises(ConfigError) as info:
        build(write_jsonl(marked, tmp_path / "refused.jsonl"), refusing)
    [(key, message)] = info.value.problems
    assert key == "chat_template" and message.startswith(
        "train row 6: the chat template cannot render this conversation (TemplateError: no forbidden words)"
    ), message

    unknown = as_messages(convs)
    unknown[4]["messages"][-1]["role"] = "bot"
    with pytest.raises(ConfigError) as info:
        build(write_jsonl(unknown, tmp_path / "bot.jsonl"), tok)
    [(key, message)] = info.value.problems
    assert key == "role_map" and "train row 4" in message and "'bot'" in message

    no_answer = [{"messages": c[:-1]} for c in convs]
    with pytest.raises(ConfigError) as info:
        build(write_jsonl(no_answer, tmp_path / "no_answer.jsonl"), tok)
    [(key, message)] = info.value.problems
    assert key == "messages_column" and "no conversation has an assistant turn" in message


def test_the_batch_encoder_gives_what_the_tokenizer_gives(assets):
    """formats.Encoder (the Rust tokenizer's encode_batch_fast where it agrees on probe texts) gives exactly the ids
    of tokenizer(...) for each model family's tokenizer, with and without special tokens."""
    from transformers import AutoTokenizer

    from finetune.formats import Encoder

    rng = random.Random(7)
    words = ["rain", "Match", "  spaced", "tab\there", "new\nline", "ünï", "42", "<|im_start|>", "</s>", "!?"]
    texts = [
        "".join(rng.choice(words) + rng.choice([" ", "", "  "]) for _ in range(rng.randint(0, 30))) for _ in range(60)
    ]
    fast = []
    for model in (assets.llama, assets.t5, assets.bart, assets.bert, assets.gpt2):
        tok = AutoTokenizer.from_pretrained(model)
        encode = Encoder.of(tok)
        fast.append(encode.fast)
        for special in (True, False):
            assert encode(texts, special) == tok(texts, add_special_tokens=special)["input_ids"], (model, special)
    assert any(fast)  # the fast path was exercised


# Templates whose rendering of a conversation's start is not the start of the whole conversation's tokens.
# Answers learned in rows of their own (test_turns_a_template_renders_otherwise_later_are_learned_in_rows_of_their_own):
SYSTEM_INTO_LAST_USER = (  # as Mistral's: the system text goes into the last user turn
    "{% set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages if m['role'] != 'system' %}{% if m['role'] == 'user' %}[INST] "
    "{% if loop.last or (loop.revindex == 2 and not add_generation_prompt) %}{{ sys }} {% endif %}{{ m['content'] }}"
    " [/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
REASONING_AFTER_THE_LAST_USER = (  # as Qwen3's: an empty reasoning block only in the answers after the last user turn
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and "
    "loop.index0 > ns.last %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Refused:
ALWAYS_A_HEADER = (  # as a base model's: the assistant header whatever comes last
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
SPACE_BEFORE_THE_ANSWER = (  # the generation prompt's trailing space is the first byte of the answer's first token
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.mark.parametrize(
    ("template", "trim_offsets", "words"),
    [
        (ALWAYS_A_HEADER, False, "not render a conversation prefix as a prefix of the whole conversation"),
        # A ByteLevel post-processor trims the space off the answer token's offsets: it must not hide the cut.
        (SPACE_BEFORE_THE_ANSWER, True, "ends inside a token"),
    ],
)
def test_a_template_whose_prefixes_are_not_the_conversations_is_refused(
    assets, tmp_path, template, trim_offsets, words
):
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
    tok.chat_template = template
    if trim_offsets:
        tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    more = [{"role": "user", "content": "Are you sure?"}, {"role": "assistant", "content": "Yes."}]
    convs = [c + more for c in conversations(6, seed=2) if c[0]["role"] == "system"]
    assert convs
    with pytest.raises(ConfigError) as info:
        build(write_jsonl(as_messages(convs), tmp_path / "chat.jsonl"), tok)
    [(key, message)] = info.value.problems
    assert key == "dataset" and "train row 0: " in message and words in message and "chat_template" in message
    if trim_offsets:  # the cut is shown: the rendering's end, then what follows it
        assert "assistant: ' | '" in message


@pytest.mark.parametrize("template", [SYSTEM_INTO_LAST_USER, REASONING_AFTER_THE_LAST_USER])
def test_turns_a_template_renders_otherwise_later_are_learned_in_rows_of_their_own(assets, tmp_path, caplog, template):
    """A template that renders an earlier answer (or the context before it) otherwise once later turns follow, as
    Mistral's and Qwen3's do: that answer is learned in a row of its own, the conversation up to it as the template
    renders it when it is the last message; the whole conversation's row learns the others. Rows and labels are
    turn_rows' (computed here from apply_chat_template), every answer is learned exactly once, and the log says
    how many rows the conversations became."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
    tok.chat_template = template
    convs = multi_turn(conversations(9, seed=2), ["Yes.", "No"], seed=4)
    assert any(len(c) > 4 for c in convs) and any(len(c) <= 3 for c in convs)
    with caplog.at_level(logging.INFO, logger="finetune"):
        got = tokens(build(write_jsonl(as_messages(convs), tmp_path / "chat.jsonl"), tok, max_seq_length=1024))
    want = turn_rows(tok, convs)
    assert len(want) > len(convs)  # some answers are in rows of their own
    assert got == want
    learned = sum(sum(lab != IGNORE for lab in labels) for _, labels in got)
    assert learned == sum(answer_tokens(tok, c) for c in convs)  # each answer once
    assert f"train: {len(want)} rows from {len(convs)} conversations" in caplog.text


def test_a_dropped_row_is_shown_as_the_conversation_it_came_from(assets, tmp_path, caplog):
    """Where conversations become several rows, the example of a dropped row is its conversation (raw row 1 here,
    though its row is the third after tokenizing: conversation 0 gave two)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
    tok.chat_template = REASONING_AFTER_THE_LAST_USER
    split = [
        {"role": r, "content": t}
        for r, t in [("user", "Hi"), ("assistant", "Yo"), ("user", "Ok?"), ("assistant", "Ok")]
    ]
    long = [{"role": "user", "content": "rain " * 200}, {"role": "assistant", "content": "weather"}]
    with caplog.at_level(logging.WARNING, logger="finetune"):
        ds = build(write_jsonl(as_messages([split, long]), tmp_path / "chat.jsonl"), tok, max_seq_length=64)
    assert len(ds.train) == 2  # conversation 0's two rows
    assert (
        "1 truncated away at max_seq_length=64 (e.g. train row 1: {'messages': [{'role': 'user', 'content': 'rain"
        in caplog.text
    )


def turn_rows(tok, convs: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """Each conversation's rows as the chat format defines them, computed apart from the product. An assistant turn
    whose renderings (the conversation before it with the generation prompt, and up to its end) are prefixes of
    the whole conversation's rendering is learned in the whole conversation's row (its tokens: what its rendering
    adds to the prompt's); any other in a row of its own: the conversation up to its end rendered and tokenized,
    the prompt's tokens not learned. The whole conversation's row first (where it learns anything), then the
    others in turn order."""

    def render(c, gen=False):
        return tok.apply_chat_template(c, tokenize=False, add_generation_prompt=gen)

    def ids_of(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    rows = []
    for c in convs:
        whole = render(c)
        ids = ids_of(whole)
        labels, own = [IGNORE] * len(ids), []
        for k, m in enumerate(c):
            if m["role"] != "assistant":
                continue
            prompt, end = (render(c[:k], True) if k else ""), render(c[: k + 1])
            a, b = len(ids_of(prompt)) if prompt else 0, len(ids_of(end))
            if whole.startswith(prompt) and whole.startswith(end):
                assert ids[:b] == ids_of(end)
                labels[a:b] = ids[a:b]
            else:
                mine = ids_of(end)
                own.append((mine, [IGNORE] * a + mine[a:]))
        rows += ([(ids, labels)] if any(lab != IGNORE for lab in labels) else []) + own
    return rows


def answer_tokens(tok, c: list[dict]) -> int:
    """How many tokens the conversation's answers take where each is the last message (what each learns)."""
    n = 0
    for k, m in enumerate(c):
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(c[:k], tokenize=False, add_generation_prompt=True) if k else ""
            end = tok.apply_chat_template(c[: k + 1], tokenize=False)
            n += len(tok(end, add_special_tokens=False)["input_ids"]) - (
                len(tok(prompt, add_special_tokens=False)["input_ids"]) if prompt else 0
            )
    return n


def placed_by_offsets(enc, end: int) -> tuple[int, bool]:
    """How many tokens start before character `end` and whether the last of them runs past it, from every token's
    offsets."""
    starts = [a for a, _ in enc.offsets]
    assert starts
    n = bisect.bisect_left(starts, end)
    return n, bool(n and enc.offsets[n - 1][1] > end)


def assert_placed_as_the_offsets_place_it(enc, end: int, got: tuple[int, bool], text: str) -> None:
    """got against placed_by_offsets (the count only matters where the end is not inside a token)."""
    want = placed_by_offsets(enc, end)
    assert got[1] == want[1] and (got[1] or got[0] == want[0]), (text, end, got, want)


def test_a_rendering_end_is_placed_among_the_tokens_as_the_offsets_place_it(assets):
    """formats._token_at (the Rust encoding's char_to_token, where Encoder.cuts finds a turn's end) against the plain
    definition computed here from every token's offsets: how many tokens start before character L, and whether the
    last of them runs past L. At every L of texts with multi-byte characters and runs of spaces, for the byte-level
    BPE tokenizer (every character in a token) and a WordPiece one (spaces in none: the offsets' path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from finetune.formats import _token_at

    texts = ["user: héllo  wörld 😀\n\nassistant: ok  fine\n", "  leading\tand trailing  ", "日本語 です。 ok"]
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.train_from_iterator(texts * 20, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    unheld = 0
    for tokenizer in (assets.tokenizer.backend_tokenizer, wordpiece):
        for text, enc in zip(texts, tokenizer.encode_batch(texts, add_special_tokens=False)):
            for end in range(len(text) + 1):
                assert_placed_as_the_offsets_place_it(enc, end, _token_at(enc, end), text)
                unheld += end < len(text) and enc.char_to_token(end) is None
    assert unheld  # the offsets' path was taken too


@pytest.mark.parametrize("name", ["demo", "llama3_1", "qwen2_5", "gemma3"])
def test_a_rendering_end_found_from_byte_widths_is_where_the_offsets_place_it(assets, real_tokenizer, name):
    """Encoder's byte widths (a byte-level tokenizer's ids alone tell where a rendering ends: the chat format's fast
    path) against the definition computed here from the tokens' offsets, at every character of several texts laid
    end to end in one batch (multi-byte characters, emoji, special tokens, runs of spaces). Byte-level tokenizers
    (the demo's, Llama-3.1's, Qwen2.5's with its NFC normalizer) take the path; Gemma-3's (SentencePiece) does not,
    and a text not in NFC falls back to the offsets."""
    import unicodedata

    from finetune.formats import Encoder

    tok = assets.tokenizer if name == "demo" else real_tokenizer(name)
    encode = Encoder.of(tok, offsets=True)
    assert encode.located is not None
    if name == "gemma3":
        assert encode.widths is None
        return
    assert encode.widths is not None
    special = tok.all_special_tokens[-1]
    texts = [
        f"user: héllo  wörld 😀\n\n{special}assistant: ok  fine\n",
        "  leading\tand trailing  ",
        f"日本語 です。{special}{special} ok",
    ]
    decomposed = unicodedata.normalize("NFD", texts[0])
    assert decomposed != texts[0]
    texts.insert(1, decomposed)  # not in NFC: the offsets place its ends, and only its
    found = encode._ends_by_width([[text[:end] for end in range(len(text) + 1)] for text in texts])
    assert [ends is None for ends in found] == [False, True, False, False]
    encodings = encode.located.encode_batch(texts, add_special_tokens=False)
    inside = 0
    for text, enc, got in zip(texts, encodings, found):
        if got is not None:
            ids, placements = got
            assert ids == enc.ids and len(placements) == len(text) + 1
            for end, placed in enumerate(placements):
                assert_placed_as_the_offsets_place_it(enc, end, placed, text)
                inside += placed[1]
    assert inside  # ends inside a token were found too
    # Encoder.cuts over the same batch, at every end that falls between tokens: each conversation's cuts as the
    # offsets give them, the one not in NFC included.
    ends = [[e for e in range(len(text)) if not placed_by_offsets(enc, e)[1]] for text, enc in zip(texts, encodings)]
    aligned = [[text[:e] for e in at] + [text] for text, at in zip(texts, ends)]
    want = [(enc.ids, [placed_by_offsets(enc, e)[0] for e in at] + [len(enc.ids)]) for enc, at in zip(encodings, ends)]
    assert all(len(at) > 3 for at in ends), ends
    assert encode.cuts(aligned, [f"row {i}" for i in range(len(texts))]) == want


@pytest.mark.parametrize("name", ["demo", "llama3_1", "qwen2_5", "gemma3"])
def test_plain_conversations_render_as_apply_chat_template_renders_them(assets, real_tokenizer, name):
    """The chat format renders plain conversations through the compiled template directly (formats._renderer, a
    quarter of apply_chat_template's cost): the same text as apply_chat_template, with and without the generation
    prompt, for the demo's and three released templates."""
    from finetune.formats import _renderer

    tok = assets.tokenizer if name == "demo" else real_tokenizer(name)
    direct = _renderer(tok)
    assert direct is not None
    rng = random.Random(5)
    words = "match rain code  bread ünïcode 😀 日本 \n\t".split(" ")
    checked = 0
    for i in range(20):
        c = [{"role": "system", "content": "Be brief."}] if i % 2 else []
        for _ in range(1 + i % 3):
            c += [
                {"role": role, "content": " ".join(rng.choices(words, k=rng.randint(1, 8)))}
                for role in ("user", "assistant")
            ]
        for k in range(1, len(c) + 1):
            for gen in (False, True):
                assert direct(c[:k], gen) == tok.apply_chat_template(c[:k], tokenize=False, add_generation_prompt=gen)
                checked += 1
    assert checked > 100


def test_chat_tokens_are_the_whole_conversations_and_labels_the_turns_prefixes_add(assets, tmp_path):
    """Several assistant turns, also with a tokenizer whose ByteLevel post-processor trims offsets: the tokens are the
    whole rendering's, and the labels are what each assistant turn's rendering adds to the one before it, each
    prefix tokenized on its own (computed here, independently of the product's offsets)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    convs = multi_turn(conversations(10, seed=3), ["Yes.", " no  "], seed=3)
    assert any(len(c) > 4 for c in convs)
    for trim in (False, True):
        tok = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
        if trim:
            tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
        got = tokens(build(write_jsonl(as_messages(convs), tmp_path / f"chat{trim}.jsonl"), tok))
        assert len(got) == len(convs)
        assert got == prefix_labels(tok, convs), trim


def prefix_labels(tok, convs: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """Each conversation's tokens and labels as the chat format defines them, computed apart from the product: every
    prefix rendered and tokenized on its own (no special tokens added: the template writes them), each a token
    prefix of the next; an assistant turn learns what its rendering adds to the one before it with the generation
    prompt."""
    expected = []
    for c in convs:
        ids, labels = [], []
        for k, m in enumerate(c):
            if m["role"] == "assistant":
                prompt = tok(
                    tok.apply_chat_template(c[:k], tokenize=False, add_generation_prompt=True), add_special_tokens=False
                )["input_ids"]
                assert prompt[: len(ids)] == ids
                labels += [IGNORE] * (len(prompt) - len(ids))
                ids = prompt
            new = tok(tok.apply_chat_template(c[: k + 1], tokenize=False), add_special_tokens=False)["input_ids"]
            assert new[: len(ids)] == ids
            labels += new[len(ids) :] if m["role"] == "assistant" else [IGNORE] * (len(new) - len(ids))
            ids = new
        expected.append((ids, labels))
    return expected


@pytest.mark.parametrize("name", ["llama3_1", "qwen2_5", "gemma3", "qwen3", "mistral_nemo"])
def test_chat_labels_on_real_tokenizers_and_templates(real_tokenizer, tmp_path, name):
    """Llama-3.1's, Qwen2.5's, Gemma-3's, Qwen3's and Mistral-Nemo's own tokenizers and chat templates (header
    tokens, ChatML, the system text folded into the first user turn or, Mistral-Nemo's, into the last; Qwen3's
    reasoning block in the answers after the last user message only): multi-turn conversations with and without a
    system message, text with multi-byte characters and runs of spaces. The tokens and labels are turn_rows'
    (computed apart): one row per conversation where every turn renders as a prefix of the whole (prefix_labels',
    the first three templates), else the turns the template renders otherwise later in rows of their own (Qwen3
    with several exchanges, Mistral-Nemo with a system message); each answer learned once."""
    tok = real_tokenizer(name)
    rng = random.Random(11)
    words = "match rain code bread storm team chip soup wind goal oven data ünïcode 😀 日本".split()
    convs = []
    for i in range(12):
        c = [{"role": "system", "content": "You name topics."}] if i % 2 else []
        for _ in range(1 + i % 3):
            c.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 9)))})
            c.append(
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 6))) + " " * (i % 3)}
            )
        convs.append(c)
    if name == "mistral_nemo":  # with a system message: refused (test_a_prompt_the_template_drops_is_refused)
        convs = [c for c in convs if c[0]["role"] != "system"]
    if name == "qwen3":  # reasoning traces: the template writes one into an answer when it is the last message
        answers = [m for c in convs for m in c if m["role"] == "assistant"]
        for m in answers[::2]:
            m["reasoning_content"] = "Think: " + " ".join(rng.choices(words, k=4))
    got = tokens(build(write_jsonl(as_messages(convs), tmp_path / "chat.jsonl"), tok, max_seq_length=4096))
    want = turn_rows(tok, convs)
    assert all(sum(lab != IGNORE for lab in labels) for _, labels in want)
    assert got == want
    assert sum(sum(lab != IGNORE for lab in labels) for _, labels in got) == sum(answer_tokens(tok, c) for c in convs)
    if name == "qwen3":
        assert len(got) > len(convs)  # the answers before the last user message, in rows of their own
        think = tok("Think:", add_special_tokens=False)["input_ids"][0]
        assert any(think in labels for _, labels in got)  # reasoning traces learned (where the template writes them)
    else:
        assert len(got) == len(convs) and got == prefix_labels(tok, convs)


def test_a_prompt_the_template_drops_is_refused(real_tokenizer, tmp_path):
    """Mistral-Nemo's template writes a system message only into a last user message with the generation prompt, and
    drops it once an answer follows: no rendering holds both the prompt an answer is written for and the answer.
    Refused, naming the row and what differs, before anything trains."""
    tok = real_tokenizer("mistral_nemo")
    convs = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo"},
        ],
    ]
    with pytest.raises(ConfigError) as info:
        build(write_jsonl(as_messages(convs), tmp_path / "chat.jsonl"), tok)
    [(key, message)] = info.value.problems
    assert key == "dataset" and "train row 1: " in message and "drops a system message" in message, message
    assert "Be brief." in message and "chat_template" in message


@pytest.mark.parametrize("name", ["demo", "llama3_1", "qwen2_5"])
def test_an_answer_that_opens_the_conversation_learns_what_an_answer_elsewhere_learns(
    assets, real_tokenizer, tmp_path, name
):
    """An assistant turn first (a greeting as messages, ShareGPT's gpt first, prompt-completion with an empty prompt)
    learns its text and its end of turn, the tokens it learns after a user turn; what the template writes before it
    (BOS, Qwen2.5's default system prompt, the assistant header) is context. Checked against prefix_labels (computed
    apart) of the same conversations after a user turn, and against where the answer's text starts in the rendering."""
    tok = assets.tokenizer if name == "demo" else real_tokenizer(name)
    greeting = {"role": "assistant", "content": "Hi! How can I help?"}
    convs = [
        [greeting, {"role": "user", "content": "rain all day?"}, {"role": "assistant", "content": "weather"}],
        [greeting],
    ]
    hello = {"role": "user", "content": "Hello."}
    after_user = prefix_labels(tok, [[hello, *c] for c in convs])
    built = {
        shape: tokens(build(write_jsonl(rows, tmp_path / f"{shape}.jsonl"), tok))
        for shape, rows in [("messages", as_messages(convs)), ("sharegpt", as_sharegpt(convs))]
    }
    # (a prompt column of empty lists only is not told from text: one row has a prompt)
    pc = [{"prompt": [], "completion": c} for c in convs] + [{"prompt": [hello], "completion": [greeting]}]
    built["prompt_completion"] = tokens(build(write_jsonl(pc, tmp_path / "pc.jsonl"), tok))[: len(convs)]
    for shape, got in built.items():
        assert len(got) == len(convs), shape
        for (ids, labels), (_, want_labels), c in zip(got, after_user, convs):
            whole = tok.apply_chat_template(c, tokenize=False)
            assert ids == tok(whole, add_special_tokens=False)["input_ids"], shape
            assert [t for t in labels if t != IGNORE] == [t for t in want_labels if t != IGNORE], shape
            first = next(i for i, t in enumerate(labels) if t != IGNORE)
            assert tok.decode(ids[:first]) == whole[: whole.index(greeting["content"])], shape


def test_an_opening_answer_a_template_rewrites_is_refused(assets, tmp_path):
    """Where the template does not write an opening answer's text as given (here upper-cased), what it writes before
    the answer cannot be told from it: refused, naming the row, rather than learned from token 0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
    tok.chat_template = (
        "<s>{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    convs = conversations(3, seed=2)
    convs[1] = [{"role": "assistant", "content": "Hi!"}, *convs[1]]
    with pytest.raises(ConfigError) as info:
        build(write_jsonl(as_messages(convs), tmp_path / "chat.jsonl"), tok)
    [(key, message)] = info.value.problems
    assert key == "chat_template" and message.startswith("train row 1: the conversation opens with an assistant turn")


def test_a_null_completion_in_conversational_prompt_completion_is_dropped_and_counted(assets, tmp_path, caplog):
    """As docs/data.md says of every null answer (and format instruction of a null prompt): dropped and counted by
    why, not a refusal blaming the messages; a prompt that is not a list of messages is refused naming
    prompt_column, the key that reads it."""
    rows = as_prompt_completion(conversations(6, seed=4))
    rows[3]["completion"] = None
    rows[1]["prompt"] = None
    with caplog.at_level("WARNING", logger="finetune"):
        ds = build(write_jsonl(rows, tmp_path / "pc.jsonl"), assets.tokenizer)
    assert len(ds.train) == 4
    assert "dropped 2 of 6 training rows with nothing to learn: " in caplog.text, caplog.text
    assert "1 with a null 'completion' (e.g. train row 3:" in caplog.text, caplog.text
    assert "1 with a null 'prompt' (e.g. train row 1:" in caplog.text, caplog.text
    from datasets import Dataset

    from finetune import formats

    layout = formats.layout_of(Dataset.from_list(rows[4:]), DataArgs(dataset="(rows)"), "causal_lm")
    with pytest.raises(formats.BadExample) as refused:
        formats.conversation({**rows[4], "prompt": {"role": "user"}}, layout, "train row 4")
    assert refused.value.key == "prompt_column", refused.value.message
