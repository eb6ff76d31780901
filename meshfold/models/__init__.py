"""Model code, free of parallelism: the shared decoder (``llama.py``), shared blocks (MoE,
attention kernels) and one package per family behind ``registry.py``. Importing the package
registers the families (``families.py``), so any ``meshfold.models.*`` import sees them."""

from meshfold.models import families  # noqa: F401  (the registration lines)
