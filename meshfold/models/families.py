"""The registered model families, one line each (``models/registry.py``; how to add one:
docs/families.md). The dense family's attention (``gqa``) is the default every other
composes."""

from meshfold.models import dense, deepseek, gemma3, glm4_moe, gpt_oss, llama4, sparse
from meshfold.models.registry import register

register(dense.FAMILY)
register(sparse.FAMILY)
register(deepseek.FAMILY)
register(gemma3.FAMILY)
register(glm4_moe.FAMILY)
register(gpt_oss.FAMILY)
register(llama4.FAMILY)
