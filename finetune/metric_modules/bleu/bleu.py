"""BLEU (Papineni et al., 2002): corpus-level modified n-gram precision (up to 4-grams) times a brevity
penalty, over text tokenized as mteval-v13a does (the WMT standard, sacrebleu's default).

Shipped with finetune (evaluate.load("bleu") needs the Hugging Face Hub); same inputs and output as the
Hub module: compute(predictions, references, tokenizer=None, max_order=4, smooth=False) ->
{bleu, precisions, brevity_penalty, length_ratio, translation_length, reference_length}, in [0, 1].
references: one string per prediction, or a list of strings (several references) per prediction.
"""

import math
import re
from collections import Counter

import datasets
import evaluate

# mteval-v13a: punctuation and symbols become tokens; periods and commas too unless inside a number;
# a dash after a digit too.
_V13A = [
    (re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "),
    (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),
    (re.compile(r"([\.,])([^0-9])"), r" \1 \2"),
    (re.compile(r"([0-9])(-)"), r"\1 \2 "),
]


def tokenize_13a(line: str) -> list[str]:
    line = line.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in line:
        line = line.replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    line = f" {line} "
    for pattern, repl in _V13A:
        line = pattern.sub(repl, line)
    return line.split()


def _ngrams(tokens: list[str], max_order: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for n in range(1, max_order + 1) for i in range(len(tokens) - n + 1))


def corpus_bleu(hypotheses: list[list[str]], references: list[list[list[str]]], max_order=4, smooth=False) -> dict:
    """Matches of each n-gram order clipped by the most any one reference has; the reference length of an
    example is its shortest reference's."""
    matches, possible = [0] * max_order, [0] * max_order
    hyp_len = ref_len = 0
    for hyp, refs in zip(hypotheses, references):
        hyp_len += len(hyp)
        ref_len += min(len(r) for r in refs)
        most: Counter = Counter()
        for r in refs:
            most |= _ngrams(r, max_order)
        overlap = _ngrams(hyp, max_order) & most
        for gram, count in overlap.items():
            matches[len(gram) - 1] += count
        for n in range(1, max_order + 1):
            possible[n - 1] += max(len(hyp) - n + 1, 0)
    if smooth:
        precisions = [(m + 1.0) / (p + 1.0) for m, p in zip(matches, possible)]
    else:
        precisions = [m / p if p > 0 else 0.0 for m, p in zip(matches, possible)]
    geo_mean = math.exp(sum(math.log(p) for p in precisions) / max_order) if min(precisions) > 0 else 0.0
    ratio = hyp_len / ref_len if ref_len else 0.0
    penalty = 1.0 if ratio > 1.0 else (math.exp(1 - 1 / ratio) if ratio > 0 else 0.0)
    return {
        "bleu": geo_mean * penalty,
        "precisions": precisions,
        "brevity_penalty": penalty,
        "length_ratio": ratio,
        "translation_length": hyp_len,
        "reference_length": ref_len,
    }


class Bleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="Papineni et al. BLEU: a Method for Automatic Evaluation of Machine Translation. ACL, 2002.",
            inputs_description="predictions: list of strings; references: list of strings or of lists of strings",
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string"),
                        "references": datasets.Sequence(datasets.Value("string"), id="sequence"),
                    }
                ),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references, tokenizer=tokenize_13a, max_order=4, smooth=False):
        references = [[r] if isinstance(r, str) else r for r in references]
        return corpus_bleu(
            [tokenizer(p) for p in predictions],
            [[tokenizer(r) for r in refs] for refs in references],
            max_order=max_order,
            smooth=smooth,
        )
