"""Exact match: the fraction of predictions equal to their references (strings).

Shipped with finetune (evaluate.load("exact_match") needs the Hugging Face Hub); same inputs and
output as the Hub module: compute(predictions, references, regexes_to_ignore=None, ignore_case=False,
ignore_punctuation=False, ignore_numbers=False). finetune strips surrounding whitespace from both first.
"""

import re
import string

import datasets
import evaluate


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions, references: lists of strings",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(
        self,
        predictions,
        references,
        regexes_to_ignore=None,
        ignore_case=False,
        ignore_punctuation=False,
        ignore_numbers=False,
    ):
        def normalize(text: str) -> str:
            for pattern in regexes_to_ignore or []:
                text = re.sub(pattern, "", text)
            if ignore_case:
                text = text.lower()
            if ignore_punctuation:
                text = text.translate(str.maketrans("", "", string.punctuation))
            if ignore_numbers:
                text = text.translate(str.maketrans("", "", string.digits))
            return text

        if not predictions:
            return {"exact_match": 0.0}
        hits = sum(normalize(p) == normalize(r) for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions)}
