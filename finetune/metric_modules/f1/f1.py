"""F1 score: the harmonic mean of precision and recall.

Shipped with finetune (evaluate.load("f1") needs the Hugging Face Hub); same inputs and output as
the Hub module: compute(predictions, references, labels=None, pos_label=1, average="binary",
sample_weight=None). finetune asks for average="macro" when there are more than two classes.
"""

import datasets
import evaluate
from sklearn.metrics import f1_score


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions, references: lists of int class ids",
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
        score = f1_score(
            references, predictions, labels=labels, pos_label=pos_label, average=average, sample_weight=sample_weight
        )
        return {"f1": score.tolist() if hasattr(score, "tolist") and getattr(score, "ndim", 0) else float(score)}
