"""Moved to ``models/deepseek/mtp.py`` (the DeepSeek family's package); this name is kept for
the importers in ``parallel/`` and ``train/`` while MTP moves behind the feature protocol (issue #40)."""

from meshfold.models.deepseek.mtp import MTPHeads, MTPModule, MTPOutput, mtp_valid, shift_left  # noqa: F401
