"""Recognising Hugging Face models without importing transformers: what the context-parallel and pipeline checks
refuse of them (``context_checks.py``, ``pipeline_support.py``)."""

from __future__ import annotations

import sys

from torch import nn


def pretrained_model_class() -> type[nn.Module] | None:
    """``transformers.PreTrainedModel`` when transformers is imported (a Hugging Face model exists only then)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling, "PreTrainedModel", None)


def is_hugging_face_class(cls: type) -> bool:
    """Defined by transformers, or by a model's own code that transformers loaded (``trust_remote_code``)."""
    return cls.__module__.split(".")[0] in ("transformers", "transformers_modules")
