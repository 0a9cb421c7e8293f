"""ROUGE (Lin, 2004): n-gram (rouge1, rouge2) and longest-common-subsequence (rougeL, rougeLsum) overlap
F-measures of predictions against references, through Google's `rouge_score` package.

Shipped with finetune (evaluate.load("rouge") needs the Hugging Face Hub); same inputs and keys as the
Hub module: compute(predictions, references, rouge_types=None, use_aggregator=True, use_stemmer=False,
tokenizer=None). One difference: the aggregate is the plain mean of the per-example F-measures, where
the Hub module reports the middle of a random bootstrap (so it is deterministic here, as every eval
number must be). rouge_score's default tokenizer lowercases and keeps only [a-z0-9] words: give
`tokenizer` (an object with .tokenize(text)) for other scripts.
"""

import datasets
import evaluate
from rouge_score import rouge_scorer


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="Lin, Chin-Yew. ROUGE: A Package for Automatic Evaluation of Summaries. ACL workshop, 2004.",
            inputs_description="predictions, references: lists of strings",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(
        self, predictions, references, rouge_types=None, use_aggregator=True, use_stemmer=False, tokenizer=None
    ):
        rouge_types = rouge_types or ["rouge1", "rouge2", "rougeL", "rougeLsum"]
        scorer = rouge_scorer.RougeScorer(rouge_types, use_stemmer=use_stemmer, tokenizer=tokenizer)
        scores = [scorer.score(ref, pred) for ref, pred in zip(references, predictions)]
        per_type = {t: [s[t].fmeasure for s in scores] for t in rouge_types}
        if not use_aggregator:
            return per_type
        return {t: (sum(v) / len(v) if v else 0.0) for t, v in per_type.items()}
