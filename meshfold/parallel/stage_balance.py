"""The cost-balanced pipeline split lives in ``meshfold/models/stage_balance.py`` (torch
free, so the planner uses the same function); this name is kept for the runtime's imports."""

from meshfold.models.stage_balance import (balanced_split, block_cost, describe_split, embedding_cost,
                                           output_cost, stage_costs, stage_split_of)

__all__ = ["balanced_split", "block_cost", "describe_split", "embedding_cost", "output_cost", "stage_costs",
           "stage_split_of"]
