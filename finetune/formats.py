"""What a row looks like and what the loss learns from it: the data formats, the shapes the Hub writes them in,
how `format: auto` tells them apart, and each format's row -> (input_ids, labels). Labels = -100 are not learned.

format          shapes (the columns, by default)                           the loss sees
text            text                                                       every token
instruction     prompt + response; prompt + completion (TRL's standard     the response (or completion) + EOS; the
                prompt-completion); instruction [+ input] + output (alpaca)  prompt is shown through prompt_template
chat            messages of {role, content} [+ tools]; conversations of     the assistant turns (prompt-completion:
                {from, value} (ShareGPT); prompt + completion as message     those of the completion), through the
                lists (TRL's conversational prompt-completion)             tokenizer's chat template
classification  text [+ text_pair] + label                                 the label
source_target   source + target (task seq2seq)                             the target + EOS
preference      prompt + chosen + rejected, as text or message lists;      the two answers, compared (method dpo,
                chosen + rejected conversations (the prompt their start)   ipo, orpo, simpo: finetune/preference.py)

The same conversation in any of the chat shapes becomes the same tokens and labels (one assistant answer after
its prompt: also the same as prompt-completion). A template that renders an earlier answer otherwise once later
turns follow (Qwen3) gives that answer a row of its own (chat_rows). Task seq2seq: the encoder reads the prompt
(prompt_template is the causal LM's way of showing it and is not used) or the source; the labels are the answer +
EOS, all learned.

A row with nothing to learn (a null or empty answer, no assistant turn, or truncated away) is dropped and counted
by why; a row the format cannot read (an unknown role, messages that are not messages) stops the run, naming it.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from finetune.config import TASK_FORMATS, ConfigError, DataArgs

IGNORE = -100
CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates know
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}  # ShareGPT's role names, read without a role_map
MESSAGE_KEYS = (("role", "content"), ("from", "value"))  # a message's (role, content) keys: ours/TRL's, ShareGPT's
CONVERSATION_COLUMNS = ("messages", "conversations")  # where auto looks for conversations (ShareGPT: the second)
ANSWER_COLUMNS = ("response", "completion")  # where auto looks for an instruction's answer (TRL: the second)


class BadExample(ValueError):
    """A row the format cannot read; `key` is the config field that would fix it."""

    def __init__(self, key: str, message: str):
        super().__init__(key, message)
        self.key, self.message = key, message


@dataclass(frozen=True)
class Layout:
    """How one data source's rows are read: the format, the shape it was found in, and the columns it reads."""

    format: str
    shape: str  # what the rows look like, in words (the start log, the model card)
    columns: tuple[str, ...]  # the columns it reads (an eval set must have them too)
    prompt: str | None = None  # instruction: the prompt column (None: alpaca's); chat: the prompt's messages
    answer: str | None = None  # instruction: the answer column; chat: the completion's messages
    messages: str | None = None  # chat: the conversation column
    role_key: str = "role"
    content_key: str = "content"
    roles: dict = field(default_factory=dict)  # the data's role name -> the chat template's
    tools: str | None = None  # chat: the column of tool definitions handed to the chat template
    pair: tuple[str, ...] = ()  # preference: the (chosen, rejected) columns
    conversational: bool = False  # preference: the pair (and prompt) are message lists

    def describe(self) -> str:
        return f"{self.format} format: {self.shape} (reads {', '.join(map(repr, self.columns)) or 'no column'})"


# ---------------------------------------------------------------- which format and shape


def layout_of(ds, data: DataArgs, task: str) -> Layout:
    """The format named in config, or the one the columns imply (in the order classification, source_target,
    chat, instruction, text, among the task's formats), read in the one shape of it the columns fit."""
    columns = list(ds.column_names)
    features = _features_of(ds)
    if data.format != "auto":
        return _READERS[data.format](columns, features, data)
    for fmt in ("classification", "source_target", "preference", "chat", "instruction", "text"):
        if fmt in TASK_FORMATS[task] and _claims(fmt, columns, features, data):
            return _READERS[fmt](columns, features, data)
    if task == "seq2seq":
        fix = (
            f"cannot find input -> target pairs for task seq2seq in columns {columns}; set source_column and "
            "target_column (format source_target) or prompt_column and response_column (format instruction)"
        )
    else:
        fix = (
            f"cannot tell the format from columns {columns}: none of text, prompt + response/completion, "
            "instruction + output, messages or conversations; set format (text/instruction/chat) and the "
            "matching *_column fields (docs/data.md lists the shapes)"
        )
    raise ConfigError([("format", fix)])


def _features_of(ds, sample: int = 100) -> dict:
    """The columns' features, for telling the format. Where objects in a list differ in their keys (a
    reasoning_content or tool_calls on some messages only), datasets 5 reads the column as lists of JSON values
    (List(Json)), which name no keys; such a column is described here as lists of records with every key the
    objects of its first `sample` rows have, as datasets describes lists of objects that share their keys."""
    import datasets

    json_value = getattr(datasets, "Json", None)
    features = dict(ds.features or {})
    loose = [c for c, f in features.items() if json_value and isinstance(getattr(f, "feature", None), json_value)]
    if not loose:
        return features
    rows = ds.take(sample) if isinstance(ds, datasets.IterableDataset) else ds.select(range(min(sample, len(ds))))
    for column in loose:
        keys: dict = {}  # in the order first seen
        for row in rows:
            for item in row[column] or []:
                keys.update(dict.fromkeys(item) if isinstance(item, dict) else {})
        if keys:
            features[column] = datasets.List({key: datasets.Value("string") for key in keys})
    return features


def missing_columns(layout: Layout, columns: list[str]) -> list[str]:
    """The columns the layout reads that `columns` (another split's) lacks."""
    return [c for c in layout.columns if c not in columns]


def _claims(fmt: str, columns: list[str], features, data: DataArgs) -> bool:
    """Whether auto takes the data for `fmt`: the columns that only this format's shapes have are there."""
    if fmt == "classification":
        return True  # the task's only format
    if fmt == "source_target":
        return data.source_column in columns and data.target_column in columns
    if fmt == "preference":
        return data.chosen_column in columns and data.rejected_column in columns
    if fmt == "chat":
        return bool(_conversation_columns(columns, data)) or _conversational_pair(columns, features, data)
    if fmt == "instruction":
        return data.prompt_column in columns or "instruction" in columns
    return data.text_column in columns


def _message_fields(feature) -> list[str] | None:
    """The keys of the records a column's feature lists (messages, as the datasets library reads JSON lists of
    objects); None when it holds something else."""
    inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    return list(inner) if isinstance(inner, dict) else None


def _is_messages(feature) -> bool:
    return _message_fields(feature) is not None


def _conversation_columns(columns: list[str], data: DataArgs) -> list[str]:
    if data.messages_column:
        return [data.messages_column] if data.messages_column in columns else []
    return [c for c in CONVERSATION_COLUMNS if c in columns]


def _answer_columns(columns: list[str], data: DataArgs) -> list[str]:
    if data.response_column:
        return [data.response_column] if data.response_column in columns else []
    return [c for c in ANSWER_COLUMNS if c in columns]


def _conversational_pair(columns: list[str], features, data: DataArgs) -> bool:
    answers = _answer_columns(columns, data)
    return data.prompt_column in columns and len(answers) == 1 and _is_messages(features[data.prompt_column])


def _ambiguous(key: str, found: list[str], what: str, columns: list[str]) -> ConfigError:
    return ConfigError(
        [
            (
                key,
                f"columns {found} could each be {what} (columns: {columns}); set {key} to the one to learn from",
            )
        ]
    )


def _text_layout(columns: list[str], features, data: DataArgs) -> Layout:
    if data.text_column not in columns:
        raise ConfigError([("text_column", _not_there(data.text_column, columns, "text_column"))])
    return Layout("text", f"raw text in {data.text_column!r}", (data.text_column,))


def _classification_layout(columns: list[str], features, data: DataArgs) -> Layout:
    keys = [("text_column", data.text_column), ("label_column", data.label_column)]
    keys += [("text_pair_column", data.text_pair_column)] if data.text_pair_column else []
    problems = [(key, _not_there(col, columns, key)) for key, col in keys if col not in columns]
    if problems:
        raise ConfigError(problems)
    return Layout("classification", "text and label", tuple(col for _, col in keys))


def _source_target_layout(columns: list[str], features, data: DataArgs) -> Layout:
    keys = [("source_column", data.source_column), ("target_column", data.target_column)]
    problems = [(key, _not_there(col, columns, key)) for key, col in keys if col not in columns]
    if problems:
        raise ConfigError(problems)
    return Layout(
        "source_target", "source -> target", (data.source_column, data.target_column),
        prompt=data.source_column, answer=data.target_column,
    )  # fmt: skip


def _instruction_layout(columns: list[str], features, data: DataArgs) -> Layout:
    answers = _answer_columns(columns, data)
    if len(answers) > 1:
        raise _ambiguous("response_column", answers, "the answer", columns)
    if data.prompt_column not in columns and "instruction" in columns and "output" in columns:
        return Layout(
            "instruction", "alpaca (instruction [+ input] -> output)", ("instruction", "output"), answer="output"
        )
    if data.prompt_column not in columns or not answers:
        want = data.response_column or " or ".join(map(repr, ANSWER_COLUMNS))
        return _missing_pair(columns, data, want)
    prompt, answer = data.prompt_column, answers[0]
    for col in (prompt, answer):
        if _is_messages(features[col]):
            raise ConfigError(
                [
                    (
                        "prompt_column" if col == prompt else "response_column",
                        f"column {col!r} holds messages, not text: the instruction format (and task seq2seq) needs "
                        f"text; for causal LM, write both {prompt!r} and {answer!r} as message lists "
                        "(conversational prompt-completion, format chat)",
                    )
                ]
            )
    shape = (
        "prompt -> completion (TRL's standard prompt-completion)" if answer == "completion" else "prompt -> response"
    )
    return Layout("instruction", shape, (prompt, answer), prompt=prompt, answer=answer)


def _missing_pair(columns: list[str], data: DataArgs, want: str):
    problems = []
    if data.prompt_column not in columns:
        problems.append(("prompt_column", _not_there(data.prompt_column, columns, "prompt_column")))
    if not _answer_columns(columns, data):
        problems.append(
            (
                "response_column",
                f"no answer column ({want}) in the data (columns: {columns}); set response_column, or a format "
                "that fits the data",
            )
        )
    raise ConfigError(problems)


def _chat_layout(columns: list[str], features, data: DataArgs) -> Layout:
    conversations = _conversation_columns(columns, data)
    pair = _conversational_pair(columns, features, data) and not data.messages_column
    if len(conversations) + pair > 1:
        found = conversations + ([f"{data.prompt_column} + {_answer_columns(columns, data)[0]}"] if pair else [])
        raise _ambiguous("messages_column", found, "the conversation", columns)
    tools = data.tools_column if data.tools_column in columns else None
    if pair:
        prompt, answer = data.prompt_column, _answer_columns(columns, data)[0]
        if not _is_messages(features[answer]):
            raise ConfigError(
                [
                    (
                        "response_column",
                        f"column {prompt!r} holds messages but {answer!r} holds text; write both as message lists "
                        "(conversational prompt-completion) or both as text (format instruction)",
                    )
                ]
            )
        role_key, content_key = _message_keys(features[prompt], prompt, data)
        shape = "prompt -> completion as messages (TRL's conversational prompt-completion)"
        return Layout(
            "chat", shape, (prompt, answer) + ((tools,) if tools else ()), prompt=prompt, answer=answer,
            role_key=role_key, content_key=content_key, roles=role_names(data), tools=tools,
        )  # fmt: skip
    if not conversations:
        want = data.messages_column or " or ".join(map(repr, CONVERSATION_COLUMNS))
        raise ConfigError(
            [
                (
                    "messages_column",
                    f"no conversation column ({want}) in the data (columns: {columns}); set messages_column, or a "
                    "format that fits the data",
                )
            ]
        )
    messages = conversations[0]
    role_key, content_key = _message_keys(features[messages], messages, data)
    shape = (
        f"ShareGPT conversations ({{{role_key}, {content_key}}} messages)"
        if (role_key, content_key) == MESSAGE_KEYS[1]
        else f"conversations of {{{role_key}, {content_key}}} messages"
    )
    return Layout(
        "chat", shape, (messages,) + ((tools,) if tools else ()), messages=messages,
        role_key=role_key, content_key=content_key, roles=role_names(data), tools=tools,
    )  # fmt: skip


def _message_keys(feature, column: str, data: DataArgs) -> tuple[str, str]:
    """(role key, content key) of the messages in `column`: role_key/content_key, else role/content or from/value."""
    keys = _message_fields(feature)
    if keys is None:
        raise ConfigError(
            [
                (
                    "messages_column",
                    f"column {column!r} must hold lists of messages ({{role, content}}, or ShareGPT's "
                    f"{{from, value}}); it holds {_kind(feature)}. Set messages_column to such a column, or a format "
                    "that fits the data",
                )
            ]
        )
    found = next(((r, c) for r, c in MESSAGE_KEYS if r in keys and c in keys), (None, None))
    role_key, content_key = data.role_key or found[0], data.content_key or found[1]
    problems = [
        (key, f"the messages in {column!r} have no {value!r} key (their keys: {keys}); set {key} to the one that "
              f"holds the {key.split('_')[0]}")
        for key, value in (("role_key", role_key), ("content_key", content_key))
        if value not in keys
    ]  # fmt: skip
    if role_key is None or content_key is None:
        problems = [
            (
                "role_key",
                f"the messages in {column!r} have the keys {keys}, neither role/content nor from/value; set role_key "
                "and content_key to the keys that hold each message's role and text",
            )
        ]
    if problems:
        raise ConfigError(problems)
    return role_key, content_key


def _kind(feature) -> str:
    dtype = getattr(feature, "dtype", None)
    return f"{dtype} values" if dtype else type(feature).__name__


def _not_there(col: str, columns: list[str], key: str) -> str:
    return f"column {col!r} not in the data (columns: {columns}); set {key}, or a format that fits the data"


def role_names(data: DataArgs) -> dict:
    """The data's role name -> the chat template's: each template role as itself, ShareGPT's names, role_map."""
    return {**{r: r for r in CHAT_ROLES}, **SHAREGPT_ROLES, **(data.role_map or {})}


def _preference_layout(columns: list[str], features, data: DataArgs) -> Layout:
    """{prompt, chosen, rejected} as text (the prompt through prompt_template, as instruction data), or as message
    lists: with a prompt column (TRL's conversational preference), or chosen and rejected whole conversations whose
    shared start is the prompt (TRL's implicit prompt)."""
    pair = (data.chosen_column, data.rejected_column)
    missing = [(k, c) for k, c in (("chosen_column", pair[0]), ("rejected_column", pair[1])) if c not in columns]
    if missing:
        raise ConfigError([(k, _not_there(c, columns, k)) for k, c in missing])
    kinds = {_is_messages(features[c]) for c in pair}
    if len(kinds) > 1:
        raise ConfigError([("rejected_column", f"{pair[0]!r} and {pair[1]!r} must both be text or both be message "
                                               "lists; write them in one form")])  # fmt: skip
    conversational = kinds.pop()
    prompt = data.prompt_column if data.prompt_column in columns else None
    if not conversational and prompt is None:
        raise ConfigError([("prompt_column", _not_there(data.prompt_column, columns, "prompt_column") + " (text "
                                             "pairs need the prompt they answer)")])  # fmt: skip
    if conversational and prompt and not _is_messages(features[prompt]):
        raise ConfigError([("prompt_column", f"{prompt!r} holds text but {pair[0]!r} holds messages; write the "
                                             "prompt as a message list too")])  # fmt: skip
    role_key, content_key = _message_keys(features[pair[0]], pair[0], data) if conversational else ("role", "content")
    if not conversational:
        shape = "prompt -> chosen / rejected answers (text, the prompt through prompt_template)"
    elif prompt:
        shape = "prompt -> chosen / rejected as messages (TRL's conversational preference)"
    else:
        shape = "chosen / rejected conversations, their shared start the prompt (TRL's implicit prompt)"
    return Layout(
        "preference", shape, ((prompt,) if prompt else ()) + pair, prompt=prompt, role_key=role_key,
        content_key=content_key, roles=role_names(data), pair=pair, conversational=conversational,
    )  # fmt: skip


_READERS: dict[str, Callable[..., Layout]] = {
    "preference": _preference_layout,
    "text": _text_layout,
    "instruction": _instruction_layout,
    "chat": _chat_layout,
    "classification": _classification_layout,
    "source_target": _source_target_layout,
}


# ---------------------------------------------------------------- rows -> tokens and labels


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _blank(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _why_blank(value, column: str) -> str:
    return f"a null {column!r}" if value is None else f"an empty {column!r}"


def _kept(ids: list[int], labels: list[int], max_len: int, spans: list[tuple[int, int]]) -> dict:
    """A causal-LM row, cut to max_len. `spans` are the [start, end) runs of learned labels; `learned` counts those
    left after the cut and the one-token shift (without a pass over the labels), and `skip` says
    why there are none ('' when there are)."""
    learned = sum(max(0, min(end, max_len) - max(start, 1)) for start, end in spans)
    skip = "" if learned else f"truncated away at max_seq_length={max_len}"
    return {"input_ids": ids[:max_len], "labels": labels[:max_len], "skip": skip, "learned": learned}


def _skipped(why: str) -> dict:
    return {"input_ids": [], "labels": [], "skip": why, "learned": 0}


def _rows_of(batch: dict) -> list[dict]:
    return [dict(zip(batch, values)) for values in zip(*batch.values())]


def row_facts(fmt: str) -> list[str]:
    """The columns a format's rows carry beside its tokens, for the data pipeline (dropped once read): why a row is
    skipped, what it learns, and where rows are not the data's rows one for one, the data's row each comes from
    (`raw_row`; chat_rows: one or more per conversation; text_blocks: a block, from the row it starts in)."""
    return ["skip", "learned", "raw_row"] if fmt in ("chat", "text") else ["skip", "learned"]


def _columns(rows: list[dict]) -> dict:
    return {key: [r[key] for r in rows] for key in ("input_ids", "labels", "skip", "learned")}


def at_rest(tokenizer):
    """The tokenizer, with no truncation or padding set on its Rust tokenizer. transformers sets both there from
    each call's arguments and leaves them set (tokenizer(..., truncation=True, max_length=n) in classification_rows
    and seq2seq_rows), so they tell only what the last call asked; the tokenizer they were loaded with had none that
    counts (transformers' next call sets its own). Written into tokenizer.json they would cut every input at n
    (tokenizers.Tokenizer.from_file), in final/ and in prepared data's fingerprint, after a run that tokenized and
    not after one whose tokenized rows came from the cache."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()
    return tokenizer


_PROBES = ["Hello world.", " two  spaces\tand a tab\n\nnew lines 12345 ünïcode", "<|im_start|>user\nhi<|im_end|>\n"]


@dataclass(frozen=True)
class Encoder:
    """A batch of texts -> token ids: the Rust tokenizer's encode_batch_fast (ids only, no offsets) where it gives
    what tokenizer(...) gives, else tokenizer(...) itself. (Its fields are what datasets hashes into the cache key.)"""

    tokenizer: Any
    fast: bool
    # The Rust tokenizer without its post-processor, for character offsets (a ByteLevel post-processor trims
    # whitespace off them); None where the fast path is off or offsets were not asked for.
    located: Any = None
    # Per token id, the bytes of text it stands for, where every token is exactly its bytes of the text (byte-level
    # BPE: GPT-2, Llama-3, Qwen): where a rendering ends in the tokens then follows from the ids alone, without
    # offsets (a quarter less tokenizing). None elsewhere (SentencePiece's normalizer, tokens that take in
    # whitespace around them).
    widths: Any = None

    @classmethod
    def of(cls, tokenizer, offsets: bool = False) -> Encoder:
        """Checked on probe texts, with and without special tokens. offsets: also the copy that cuts() reads
        offsets from (a copy of the whole tokenizer: only the chat format asks for it)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        fast = getattr(backend, "encode_batch_fast", None)
        want = {special: tokenizer(_PROBES, add_special_tokens=special)["input_ids"] for special in (True, False)}
        same = fast is not None and all(
            [e.ids for e in fast(_PROBES, add_special_tokens=special)] == ids for special, ids in want.items()
        )
        if not (same and offsets):
            return cls(tokenizer, same)
        located = type(backend).from_str(backend.to_str())
        located.post_processor = None
        plain = [e.ids for e in located.encode_batch(_PROBES, add_special_tokens=False)]
        if plain != want[False]:
            return cls(tokenizer, True)
        encoder = cls(tokenizer, True, located, _byte_widths(backend))
        return encoder if encoder.widths is None or encoder._widths_agree() else cls(tokenizer, True, located)

    def __call__(self, texts: list[str], special: bool) -> list[list[int]]:
        if not texts:
            return []
        if self.fast:
            return [
                e.ids for e in self.tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=special)
            ]
        return self.tokenizer(texts, add_special_tokens=special)["input_ids"]

    def cuts(self, renders: list[list[str]], where: list[str]) -> list[tuple[list[int], list[int]]]:
        """Per conversation, given its growing renderings (the last is the whole conversation): the whole one's tokens
        (no special tokens added) and the token count at which each rendering ends in them. The whole is tokenized
        once; each rendering's end is found from the tokens' byte widths or character offsets. Raises ValueError
        where a rendering is not a prefix of the next, or ends inside a token (where the tokens of the parts would
        not be the whole's), naming the conversation (where: each one's place in the data).
        """
        if self.located is None:
            flat = self([text for texts in renders for text in texts], False)
            ends = list(itertools.accumulate(len(texts) for texts in renders))
            return [_cuts_by_prefix(flat[a:b], at) for a, b, at in zip([0, *ends], ends, where)]
        found = self._ends_by_width(renders) if self.widths is not None else [None] * len(renders)
        missing = [i for i, ends in enumerate(found) if ends is None]
        for i, ends in zip(missing, self._ends_by_offsets([renders[i] for i in missing])):
            found[i] = ends
        for texts, (_, ends), at in zip(renders, found, where):
            if not all(following.startswith(text) for text, following in zip(texts[:-1], texts[1:])):
                raise ValueError(
                    f"{at}: the chat template does not render a conversation prefix as a prefix of the whole "
                    "conversation; set chat_template to one that does"
                )
            for text, (_, inside) in zip(texts, ends):
                if inside:
                    raise ValueError(
                        f"{at}: the chat template's rendering of a conversation prefix ends inside a token "
                        f"({text[-30:]!r} | {texts[-1][len(text) : len(text) + 30]!r}); set chat_template to one "
                        "that ends each turn where a token ends"
                    )
        return [(ids, [n for n, _ in ends]) for ids, ends in found]

    def _widths_agree(self) -> bool:
        """_ends_by_width places the end of every prefix of the probe texts where _ends_by_offsets does (the token
        count only matters where the end is not inside a token)."""
        renders = [[text[:end] for end in range(len(text) + 1)] for text in _PROBES]
        found = self._ends_by_width(renders)

        def placed(conversations: list) -> list:
            return [(ids, [(None if inside else n, inside) for n, inside in ends]) for ids, ends in conversations]

        return None not in found and placed(found) == placed(self._ends_by_offsets(renders))

    def _ends_by_offsets(self, renders: list[list[str]]) -> list[tuple[list[int], list[tuple[int, bool]]]]:
        """Per conversation, the whole rendering's ids and, for each rendering, (the tokens that start before it
        ends, whether the last of them runs past its end): from the tokens' character offsets."""
        wholes = self.located.encode_batch([texts[-1] for texts in renders], add_special_tokens=False)
        return [
            (whole.ids, [*(_token_at(whole, len(text)) for text in texts[:-1]), (len(whole.ids), False)])
            for texts, whole in zip(renders, wholes)
        ]

    def _ends_by_width(self, renders: list[list[str]]) -> list[tuple[list[int], list[tuple[int, bool]]] | None]:
        """_ends_by_offsets for a batch, from the ids' byte widths: every conversation's tokens laid end to end, each
        rendering's end in bytes looked up among the tokens' ends. None (the offsets are asked) for a conversation
        whose text is not in NFC (a normalizer may change it) or whose tokens do not add up to its text."""
        wholes = [texts[-1] for texts in renders]
        take = [i for i, text in enumerate(wholes) if unicodedata.is_normalized("NFC", text)]
        found: list = [None] * len(renders)
        if not take:
            return found
        wholes = [wholes[i] for i in take]
        renders = [renders[i] for i in take]
        ids = [e.ids for e in self.tokenizer.backend_tokenizer.encode_batch_fast(wholes, add_special_tokens=False)]
        counts = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(counts.sum()))
        token_ends = np.concatenate([[0], np.cumsum(self.widths[flat])])  # [0, where token 0 ends, ...] in bytes
        firsts = np.cumsum(counts) - counts  # where each conversation starts in tokens
        starts = token_ends[firsts]  # and in bytes
        sizes = np.fromiter((len(text.encode()) for text in wholes), np.int64, len(wholes))
        adds_up = (token_ends[firsts + counts] - starts == sizes).tolist()
        per = [len(texts) for texts in renders]
        at = np.fromiter((len(t.encode()) for texts in renders for t in texts), np.int64, sum(per))
        at += np.repeat(starts, per)
        # The tokens that start before each rendering ends (all conversations': one that does not add up may place
        # another's ends in its tokens, and is dropped).
        k = np.minimum(np.searchsorted(token_ends, at), len(token_ends) - 1)
        n = (k - np.repeat(firsts, per)).tolist()
        inside = (token_ends[k] != at).tolist()
        bounds = list(itertools.accumulate(per, initial=0))
        for i, x, a, b, ok in zip(take, ids, bounds, bounds[1:], adds_up):
            if ok:
                found[i] = (x, list(zip(n[a:b], inside[a:b])))
        return found


def _byte_widths(backend) -> np.ndarray | None:
    """Encoder.widths: each token's length in bytes (a byte-level vocabulary's token has one character per byte; an
    added token is its content), where the tokenizer decodes byte-level, normalizes nothing or only to NFC (Qwen's:
    a text already in NFC stays as it is) and has no added token that takes in the whitespace around it (Encoder.of
    then checks it against the offsets: _widths_agree)."""
    spec = json.loads(backend.to_str())
    added = spec.get("added_tokens") or []
    normalizer = (spec.get("normalizer") or {}).get("type", "NFC")
    decoder = (spec.get("decoder") or {}).get("type")
    if normalizer != "NFC" or decoder != "ByteLevel" or any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    widths = np.zeros(1 + max([*vocab.values(), *(t["id"] for t in added)]), np.int64)
    for token, i in vocab.items():
        widths[i] = len(token)
    for t in added:
        widths[t["id"]] = len(t["content"].encode())
    return widths


def _token_at(whole, end: int) -> tuple[int, bool]:
    """How many of an encoding's tokens start before character `end`, and whether the last of them runs past it.
    The first token holding that character, asked of the Rust encoding (no Python list of every token's offsets);
    past the end, or at a character no token holds (a tokenizer that drops some), by bisecting the offsets."""
    k = whole.char_to_token(end)
    if k is not None:
        return k, whole.token_to_chars(k)[0] < end
    starts = [a for a, _ in whole.offsets]
    n = bisect.bisect_left(starts, end)
    return n, bool(n and whole.offsets[n - 1][1] > end)


def _cuts_by_prefix(tokenized: list[list[int]], where: str) -> tuple[list[int], list[int]]:
    """Encoder.cuts where there are no offsets: each rendering tokenized, each a token prefix of the whole."""
    whole = tokenized[-1]
    if any(whole[: len(ids)] != ids for ids in tokenized):
        raise ValueError(
            f"{where}: the chat template does not render a conversation prefix as a token prefix of the whole "
            "conversation; set chat_template to one that does"
        )
    return whole, [len(ids) for ids in tokenized]


def _prompt_answer(ex: dict, layout: Layout) -> tuple:
    """An instruction row's (prompt, answer) and their columns; alpaca's instruction + input is the prompt."""
    if layout.prompt:
        return (ex[layout.prompt], layout.prompt), (ex[layout.answer], layout.answer)
    prompt = (
        ex["instruction"]
        if _blank(ex["instruction"])
        else ex["instruction"] + (f"\n\n{ex['input']}" if ex.get("input") else "")
    )
    return (prompt, "instruction"), (ex["output"], "output")


def _pairs(batch: dict, layout: Layout) -> tuple[list, list[str]]:
    """A batch's (prompt, answer) pairs (instruction, source_target) and why each row has nothing to learn."""
    if layout.format == "source_target":
        s, t = layout.prompt, layout.answer
        pairs = [((src, s), (tgt, t)) for src, tgt in zip(batch[s], batch[t])]
    else:
        pairs = [_prompt_answer(ex, layout) for ex in _rows_of(batch)]
    why = [
        _why_blank(a, a_col) if _blank(a) else _why_blank(p, p_col) if p is None else ""
        for (p, p_col), (a, a_col) in pairs
    ]
    return pairs, why


def instruction_rows(tokenizer, data: DataArgs, layout: Layout, max_len: int) -> Callable:
    """The prompt through prompt_template (with the tokenizer's special tokens), then the answer + EOS: learned."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    encode = Encoder.of(tokenizer)
    template = data.prompt_template  # (fn captures only what shapes the rows: its hash is datasets' cache key)

    def fn(batch: dict, idx: list[int]) -> dict:
        pairs, why = _pairs(batch, layout)
        keep = [k for k, w in enumerate(why) if not w]
        prompts = [template.format(prompt=pairs[k][0][0]) for k in keep]
        rows = [_skipped(w) for w in why]
        answers = encode([str(pairs[k][1][0]) for k in keep], False)
        for k, p, r in zip(keep, encode(prompts, True), answers):
            ids = p + r + eos
            rows[k] = _kept(ids, [IGNORE] * len(p) + r + eos, max_len, [(len(p), len(ids))])
        return _columns(rows)

    return fn


def seq2seq_rows(tokenizer, data: DataArgs, layout: Layout, max_len: int) -> Callable:
    """Encoder input: the prompt (or source) with the tokenizer's special tokens (T5 appends EOS, BART wraps in
    BOS/EOS), one longer than max_len cut as the tokenizer cuts it (its text, the special tokens kept); labels: the
    response (or target) + EOS, cut to max_len."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    encode = Encoder.of(tokenizer)

    def fn(batch: dict, idx: list[int]) -> dict:
        pairs, why = _pairs(batch, layout)
        keep = [k for k, w in enumerate(why) if not w]
        rows = [_skipped(w) for w in why]
        texts = [str(pairs[k][0][0]) for k in keep]
        sources = encode(texts, True)
        long = [j for j, s in enumerate(sources) if len(s) > max_len]
        if long:
            cut = tokenizer([texts[j] for j in long], truncation=True, max_length=max_len)["input_ids"]
            for j, ids in zip(long, cut):
                sources[j] = ids
        for k, s, t in zip(keep, sources, encode([str(pairs[k][1][0]) for k in keep], False)):
            labels = (t + eos)[:max_len]  # all learned (no shift)
            rows[k] = {"input_ids": s[:max_len], "labels": labels, "skip": "", "learned": len(labels)}
        return _columns(rows)

    return fn


def _clean(value):
    """A value as the data meant it: the datasets library fills a record's missing keys with None (every message
    gets every key any message has); a template must not see them."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def conversation(ex: dict, layout: Layout, where: str) -> tuple[list[dict], int]:
    """A chat row's messages ({role, content, ...} with the template's role names) and the index of the first one
    that may be learned (prompt-completion: the completion's first)."""
    if layout.messages:
        parts = [(ex[layout.messages], layout.messages)]
    else:
        parts = [(ex[layout.prompt], layout.prompt), (ex[layout.answer], layout.answer)]
    messages = [m for raw, column in parts for m in _to_messages(raw, column, layout, where)]
    return messages, (len(parts[0][0]) if not layout.messages else 0)


def _to_messages(raw, column: str, layout: Layout, where: str) -> list[dict]:
    """One column's messages as the chat template reads them: {role, content, ...} with the template's role names."""
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        key = {layout.prompt: "prompt_column", layout.answer: "response_column"}.get(column, "messages_column")
        raise BadExample(
            key,
            f"{where}: column {column!r} must hold a list of messages, got {str(raw)[:60]!r}; fix the row",
        )
    messages = []
    for m in raw:
        role = m.get(layout.role_key)
        if role not in layout.roles:
            raise BadExample(
                "role_map",
                f"{where}: the role {role!r} in {column!r} is not a chat role ({', '.join(CHAT_ROLES)}); set "
                f"role_map to map it to one, e.g. role_map: {{{role}: assistant}}",
            )
        rest = {k: v for k, v in m.items() if k not in (layout.role_key, layout.content_key)}
        messages.append({"role": layout.roles[role], "content": m.get(layout.content_key), **_clean(rest)})
    return messages


def chat_rows(tokenizer, data: DataArgs, layout: Layout, max_len: int, split: str) -> Callable:
    """Render with the chat template; learn exactly the tokens each assistant turn adds.

    The whole conversation is tokenized once; the rendering of each conversation prefix that ends a learned turn
    (and of the one before, with the generation prompt) is a prefix of the whole rendering, ending where a token
    ends, with the usual ChatML/Llama/Mistral templates. Where a template renders a turn otherwise once later turns
    follow (Qwen3 writes its reasoning block only into the answers after the last user message; a template may
    write the system message into the last user turn), that turn is learned in a row of its own, the conversation
    up to it rendered as the template renders it for that answer (`_rows_of_turns`); such conversations give more
    than one row (`conversation`: the conversation's row in the split). What _rows_of_turns refuses, and a
    rendering that ends inside a token, stop the run naming the row.
    """
    encode = Encoder.of(tokenizer, offsets=True)

    def fn(batch: dict, idx: list[int]) -> dict:
        wheres = [f"{split} row {i}" for i in idx]
        plans = [_turns(ex, layout, at) for ex, at in zip(_rows_of(batch), wheres)]
        kept = [(plan, at) for plan, at in zip(plans, wheres) if isinstance(plan, Turns)]
        jobs = [(_job(plan, k, gen), at) for plan, at in kept for k, gen, _ in plan.steps]
        flat = iter(render_all(tokenizer, [job for job, _ in jobs], [at for _, at in jobs]))
        per_plan = [
            _rows_of_turns(plan, [_step_text(next(flat), k, at) for k, _, _ in plan.steps], at) for plan, at in kept
        ]
        rendered = [(texts, at) for turn_rows, (_, at) in zip(per_plan, kept) for texts, _ in turn_rows]
        cuts = iter(encode.cuts([texts for texts, _ in rendered], [at for _, at in rendered]))
        rows, conversations, turn_rows_of = [], [], iter(per_plan)
        for plan, i in zip(plans, idx):
            if isinstance(plan, str):
                rows.append(_skipped(plan))
                conversations.append(i)
                continue
            for _, learned_steps in next(turn_rows_of):
                ids, ends = next(cuts)
                labels: list[int] = []
                spans = []
                for learned, start, end in zip(learned_steps, [0, *ends], ends):
                    labels += ids[start:end] if learned else [IGNORE] * (end - start)
                    spans += [(start, end)] if learned else []
                rows.append(_kept(ids, labels, max_len, spans))
                conversations.append(i)
        return {**_columns(rows), "raw_row": conversations}

    return fn


def _rows_of_turns(plan: Turns, texts: list[str], where: str) -> list[tuple[list[str], list[bool]]]:
    """The rows a conversation's learned turns go into: (the growing renderings, each ending a step, and whether the
    tokens each adds are learned). The whole conversation's row takes every turn whose renderings (its generation
    prompt, its end) are prefixes of the whole rendering; a turn whose are not gets a row of its own, rendered up
    to its end as the template renders it when that answer is the last message (what the model sees when it writes
    it), its prompt not learned. Refused (ValueError, naming the conversation): a template whose rendering with
    the answer does not start with its rendering of the prompt (the prompt the answer is written for is in no
    rendering), and one whose rendering leaves the whole one's after the answer starts (it renders the answer
    itself otherwise: a header written after every last message, say)."""
    whole = texts[-1]
    # step indices of each learned turn: its generation prompt's and its end's
    turns = [[j - 1, j] for j, (_, _, learned) in enumerate(plan.steps) if learned]
    rows, main = [], []
    for turn in turns:
        if all(whole.startswith(texts[j]) for j in turn):
            main += turn
            continue
        prompt, end = texts[turn[0]], texts[turn[1]]
        if not end.startswith(prompt):
            at = max(len(os.path.commonprefix([prompt, end])) - 15, 0)  # a little before where they part
            raise ValueError(
                f"{where}: the chat template renders the conversation before an answer otherwise once the answer "
                f"follows ({prompt[at : at + 40]!r} with the generation prompt, {end[at : at + 40]!r} with the "
                "answer; Mistral-Nemo's, say, drops a system message there), so no rendering holds the prompt the "
                "answer is written for; set chat_template to one that keeps it, or drop the system message"
            )
        if len(os.path.commonprefix([end, whole])) > len(prompt):
            raise ValueError(
                f"{where}: the chat template does not render a conversation prefix as a prefix of the whole "
                "conversation (an answer ends otherwise once later turns follow); set chat_template to one that does"
            )
        rows.append(([texts[j] for j in turn], [plan.steps[j][2] for j in turn]))
    if main:  # the whole conversation's row, where it learns anything
        steps = main if main[-1] == len(texts) - 1 else [*main, len(texts) - 1]
        rows.insert(0, ([texts[j] for j in steps], [plan.steps[j][2] and j in main for j in steps]))
    return rows


@dataclass(frozen=True)
class Turns:
    """A chat row's messages and tools, and the growing prefixes where what is learned starts or ends: each step
    (prefix length, with the generation prompt, the tokens it adds are learned), the last the whole conversation."""

    messages: list[dict]
    tools: list | None
    steps: list[tuple[int, bool, bool]]  # (0, True, False): what the template writes before an opening answer


# An answer that opens the conversation has no rendering before it to learn from: transformers renders no empty
# conversation. What the template writes before it (BOS, a default system prompt, the assistant header), context
# as the generation prompt is before any other answer, is read off the rendering of that answer alone with this
# text for its content: everything before it.
_ANSWER_STAND_IN = "FINETUNE-ANSWER-7c1e"


def _job(plan: Turns, k: int, gen: bool) -> tuple[list[dict], bool, list | None]:
    """What a step renders: the first k messages, with the generation prompt or not; for an answer that opens the
    conversation (k = 0), that answer alone with a stand-in content (_step_text keeps what comes before it)."""
    if k == 0:
        return [{"role": "assistant", "content": _ANSWER_STAND_IN}], False, plan.tools
    return plan.messages[:k], gen, plan.tools


def _step_text(text: str, k: int, where: str) -> str:
    """A step's rendering as _rows_of_turns reads it: for k = 0, the text before the stand-in answer."""
    if k:
        return text
    at = text.find(_ANSWER_STAND_IN)
    if at < 0:
        raise BadExample(
            "chat_template",
            f"{where}: the conversation opens with an assistant turn, and the chat template does not write an "
            "answer's text as it is given, so what it writes before the answer (not learned) cannot be told from "
            "the answer; start the conversation with a user or system message, or set chat_template to one that "
            "writes the answer's text as given",
        )
    return text[:at]


def _turns(ex: dict, layout: Layout, where: str) -> Turns | str:
    """A chat row's Turns, or why the row has nothing to learn. An assistant turn is learned, the generation prompt
    before it is not (before an answer that opens the conversation: what the template writes before it, _job).
    Only those prefixes: each rendering costs about what tokenizing the whole conversation does."""
    for column in (layout.answer, layout.prompt):  # null: dropped, as in format instruction (not a list to refuse)
        if column and ex[column] is None:
            return _why_blank(None, column)
    messages, first = conversation(ex, layout, where)
    learned = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k >= first]
    if layout.answer and not ex[layout.answer]:
        return f"an empty {layout.answer!r}"
    if not learned:
        return "no assistant turn" + (f" in {layout.answer!r}" if layout.answer else "")
    steps = []
    for k in learned:
        steps.append((k, True, False))  # the turn starts after the template's generation prompt
        steps.append((k + 1, False, True))
    if learned[-1] < len(messages) - 1:
        steps.append((len(messages), False, False))
    return Turns(messages, _tools(ex, layout), steps)


def render_all(tokenizer, jobs: list[tuple[list[dict], bool, list | None]], wheres: list[str]) -> list[str]:
    """The chat template's renderings of (messages, with the generation prompt, tools), each from the row wheres[i].
    Plain conversations straight through the template (_renderer); others without tools in one apply_chat_template
    call per setting of the generation prompt (its work per call done once per batch, not once per rendering); those
    with tools one call each. A template that raises renders them one at a time, to name the row."""
    out: list[str | None] = [None] * len(jobs)
    direct = _renderer(tokenizer)
    for i, (messages, gen, tools) in enumerate(jobs):
        if direct and tools is None and all(len(m) == 2 and type(m.get("content")) is str for m in messages):
            try:
                out[i] = direct(messages, gen)
            except Exception:  # noqa: BLE001 (rendered again as apply_chat_template does, to name the row)
                out[i] = render(tokenizer, messages, gen, None, wheres[i])
    for gen in (True, False):
        batch = [i for i, (_, g, tools) in enumerate(jobs) if out[i] is None and g == gen and tools is None]
        if not batch:
            continue
        try:
            texts = tokenizer.apply_chat_template(
                [jobs[i][0] for i in batch], tokenize=False, add_generation_prompt=gen
            )
        except Exception:  # noqa: BLE001 (rendered again, one at a time, to say which row)
            texts = [render(tokenizer, jobs[i][0], gen, None, wheres[i]) for i in batch]
        for i, text in zip(batch, texts):
            out[i] = text
    for i, (messages, gen, tools) in enumerate(jobs):
        if tools is not None:
            out[i] = render(tokenizer, messages, gen, tools, wheres[i])
    return out  # type: ignore[return-value]


_PROBE_CHAT = [
    {"role": "user", "content": "Hi there."},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": " two  spaces\tand ünïcode\n"},
    {"role": "assistant", "content": "Noted.\n\n"},
]


def _renderer(tokenizer) -> Callable[[list[dict], bool], str] | None:
    """Plain conversations (messages of a role and a text only) rendered by the chat template as transformers compiles
    it, with what apply_chat_template gives it besides (the special tokens, no tools or documents): the same text
    at a quarter of the cost. apply_chat_template rebuilds each message as plain data and renames reasoning fields,
    and jinja's render merges the template's globals into a new context, on every rendering; here the globals and
    special tokens are merged once, and each rendering is one shared context (jinja's Template.new_context). None,
    and apply_chat_template is used, where this transformers has no such compiled template or renders the probe
    conversation's prefixes otherwise."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = _compile_jinja_template(tokenizer.get_chat_template())
    except Exception:  # noqa: BLE001 (another transformers, or no template: apply_chat_template says which)
        return None
    context = {**template.globals, **tokenizer.special_tokens_map, "tools": None, "documents": None}

    def fn(messages: list[dict], gen: bool) -> str:
        variables = {**context, "messages": messages, "add_generation_prompt": gen}
        return template.environment.concat(template.root_render_func(template.new_context(variables, shared=True)))

    probes = [(_PROBE_CHAT[:k], gen) for k in range(1, len(_PROBE_CHAT) + 1) for gen in (False, True)]
    try:
        same = all(
            fn(m, g) == tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=g) for m, g in probes
        )
    except Exception:  # noqa: BLE001 (a template that refuses the probe: apply_chat_template for every row)
        return None
    return fn if same else None


def render(tokenizer, messages: list[dict], gen: bool, tools: list | None, where: str) -> str:
    """The chat template's rendering; a template that raises (jinja's raise_exception: roles that must alternate, a
    system message it does not take ...) is a bad row, named."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    except Exception as e:  # noqa: BLE001 (jinja's TemplateError, or what the template's code raised)
        raise BadExample(
            "chat_template",
            f"{where}: the chat template cannot render this conversation ({first_line(e)}); fix "
            "the row, or set chat_template to one that renders it",
        ) from None


def _tools(ex: dict, layout: Layout) -> list | None:
    """The row's tool definitions (a list, or its JSON text, as the Hub often stores them), or None."""
    value = ex[layout.tools] if layout.tools else None
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    return _clean(value) or None


PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")  # a tokenized preference pair (data.Collator joins them)


def preference_rows(tokenizer, data: DataArgs, layout: Layout, max_len: int, split: str) -> Callable:
    """A pair as token ids: the prompt (text through prompt_template with the tokenizer's special tokens, or the chat
    template's rendering of the prompt messages with its generation prompt) and each answer (text + EOS, or what
    the chat template adds for the answer's messages), tokenized apart, as TRL does. Cut to max_seq_length prompt
    first (its start, down to half of max_seq_length), then the answers (their ends). A pair with an empty answer,
    or whose answers are the same tokens after the cut, has nothing to compare and is dropped (counted)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    encode = Encoder.of(tokenizer)
    template = data.prompt_template
    chosen, rejected = layout.pair

    def fn(batch: dict, idx: list[int]) -> dict:
        wheres = [f"{split} row {i}" for i in idx]
        parts = [_pair_parts(ex, layout, template, at) for ex, at in zip(_rows_of(batch), wheres)]
        texts = _pair_texts(tokenizer, parts, wheres)
        kept = [t for t in texts if isinstance(t, tuple)]
        prompts = iter(encode([t[0] for t in kept], not layout.conversational))
        answers = iter(encode([a for t in kept for a in t[1:]], False))
        out: dict[str, list] = {k: [] for k in (*PAIR_COLUMNS, "skip", "learned")}
        for t in texts:
            row = dict(zip(PAIR_COLUMNS, ([], [], []))) | {"skip": t, "learned": 0}
            if isinstance(t, tuple):
                end = [] if layout.conversational else eos
                whole = next(prompts), next(answers) + end, next(answers) + end
                p, c, r = _fit_pair(*whole, max_len)
                why = (
                    ""
                    if c != r
                    else f"the same {chosen!r} and {rejected!r}"
                    + (f" after the cut to max_seq_length={max_len}" if whole[1] != whole[2] else "")
                )
                row = {"prompt_ids": p, "chosen_ids": c, "rejected_ids": r, "skip": why, "learned": int(not why)}
            for k, v in row.items():
                out[k].append(v)
        return out

    return fn


def _pair_parts(ex: dict, layout: Layout, template: str, where: str) -> tuple | str:
    """(prompt, chosen answer, rejected answer): text, or message lists (conversational); or why the row has nothing
    to compare."""
    chosen, rejected = layout.pair
    for col in layout.pair:
        if _blank(ex[col]) or ex[col] == []:
            return _why_blank(ex[col], col) if ex[col] != [] else f"an empty {col!r}"
    if not layout.conversational:
        if ex[layout.prompt] is None:
            return _why_blank(None, layout.prompt)
        return template.format(prompt=ex[layout.prompt]), str(ex[chosen]), str(ex[rejected])
    c, r = (_to_messages(ex[col], col, layout, where) for col in layout.pair)
    if layout.prompt:
        prompt = _to_messages(ex[layout.prompt], layout.prompt, layout, where)
    else:  # the shared start of the two conversations
        k = next((k for k, (a, b) in enumerate(zip(c, r)) if a != b), min(len(c), len(r)))
        prompt, c, r = c[:k], c[k:], r[k:]
        if not prompt or not c or not r:
            return f"no shared prompt before different answers in {chosen!r} and {rejected!r}"
    return prompt, c, r


def _pair_texts(tokenizer, parts: list[tuple | str], wheres: list[str]) -> list[tuple[str, str, str] | str]:
    """Each pair's (prompt, chosen answer, rejected answer) as text: message lists rendered with the chat template
    (the prompt with its generation prompt; each answer what the whole conversation adds to it), all at once."""
    convs = [i for i, p in enumerate(parts) if isinstance(p, tuple) and isinstance(p[0], list)]
    jobs = [(parts[i][0] + more, not more, None) for i in convs for more in ([], *parts[i][1:])]
    flat = iter(render_all(tokenizer, jobs, [wheres[i] for i in convs for _ in range(3)]))
    texts = list(parts)
    for i in convs:
        start, *wholes = next(flat), next(flat), next(flat)
        if not all(whole.startswith(start) for whole in wholes):
            raise ValueError(
                f"{wheres[i]}: the chat template does not render the prompt as the start of the whole conversation; "
                "set chat_template to one that does"
            )
        texts[i] = (start, *(whole[len(start) :] for whole in wholes))
    return texts


def _fit_pair(p: list[int], c: list[int], r: list[int], max_len: int) -> tuple[list[int], list[int], list[int]]:
    """Prompt + the longer answer within max_len: the prompt's start cut first (down to half of max_len), then the
    answers' ends."""
    longest = max(len(c), len(r))
    if len(p) + longest > max_len:
        p = p[-max(max_len - longest, max_len // 2) :]
        c, r = c[: max_len - len(p)], r[: max_len - len(p)]
    return p, c, r


def classification_rows(tokenizer, data: DataArgs, max_len: int, label_ids: dict | None) -> Callable:
    text, pair_column, label = data.text_column, data.text_pair_column, data.label_column

    def fn(batch: dict, idx: list[int]) -> dict:
        pair = batch[pair_column] if pair_column else None
        enc = tokenizer(batch[text], pair, truncation=True, max_length=max_len)
        labels = [label_ids[v] if label_ids else v for v in batch[label]]
        return {
            "input_ids": enc["input_ids"],
            "labels": labels,
            "skip": [""] * len(labels),
            "learned": [1] * len(labels),
        }

    return fn


def text_rows(tokenizer, data: DataArgs) -> Callable:
    """A text row's tokens and EOS (`ids`): text_blocks then joins the rows and cuts the blocks."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    column = data.text_column

    def fn(batch: dict, idx: list[int]) -> dict:
        return {"ids": [ids + eos for ids in tokenizer(batch[column])["input_ids"]]}

    return fn


TEXT_BATCH = 1000  # rows joined and cut together (datasets' default batch): the tail of each batch is not learned


def text_blocks(max_len: int) -> Callable:
    """text_rows' rows, TEXT_BATCH at a time, joined and cut into blocks of max_len, each learned whole; the row
    each block starts in is its `raw_row`. Run by one process over the rows in order, so the blocks do not depend
    on how many processes tokenized them (a machine's cores: data.preparing_processes)."""

    def fn(batch: dict, idx: list[int]) -> dict:
        texts = batch["ids"]
        stream = [t for ids in texts for t in ids]
        n = max(len(stream) // max_len, 1)  # a short batch still yields one (shorter) block
        blocks = [stream[i * max_len : (i + 1) * max_len] for i in range(n)]
        learned = [len(b) - 1 for b in blocks]  # every token but the first is predicted
        skip = ["" if n else "a single token (nothing to predict)" for n in learned]
        starts = list(itertools.accumulate((len(ids) for ids in texts), initial=0))  # rows in the stream
        first = [idx[min(bisect.bisect_right(starts, i * max_len), len(idx)) - 1] for i in range(n)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks], "skip": skip, "learned": learned,
                "raw_row": first}  # fmt: skip

    return fn


def tools_problem(layout: Layout, tokenizer) -> tuple[str, str] | None:
    """Tool definitions in the data that the chat template would silently drop."""
    template = tokenizer.chat_template
    text = " ".join(template.values()) if isinstance(template, dict) else str(template or "")
    if layout.tools and "tools" not in text:
        return (
            "tools_column",
            f"the data has tool definitions in {layout.tools!r} but the chat template never renders tools, so the "
            "model would learn tool calls without seeing the tools; set chat_template to one that renders them, or "
            "tools_column: null to train without them",
        )
    return None
