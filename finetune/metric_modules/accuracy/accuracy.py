"""Accuracy: the fraction of predictions equal to their references.

Shipped with finetune (evaluate.load("accuracy") needs the Hugging Face Hub); same inputs and
output as the Hub module: compute(predictions, references, normalize=True, sample_weight=None).
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions, references: lists of int class ids",
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        return {
            "accuracy": float(accuracy_score(references, predictions, normalize=normalize, sample_weight=sample_weight))
        }
