"""finetune: fine-tune Hugging Face models with one loop; the Accelerate config picks the parallelism."""

__version__ = "0.1.0"
