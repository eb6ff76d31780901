"""Moved to ``models/deepseek/mla.py`` (the DeepSeek family's package); this name is kept for
the importers in ``parallel/`` while their MLA plans move (issue #40)."""

from meshfold.models.deepseek.mla import MLAttention, build_attention, mla_softmax_scale, yarn_mscale  # noqa: F401
