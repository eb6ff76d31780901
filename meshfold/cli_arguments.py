"""The arguments of the subcommands whose modules import torch when they load
(``meshfold.calibration``, ``meshfold.dryrun``, ``meshfold.convert``, ``meshfold.btm``): declared here, with the standard library
only, so ``meshfold calibrate --help`` and ``meshfold dry-run --help`` answer without
loading torch (``cli.py``'s ``Subcommand.arguments`` names this module)."""

from __future__ import annotations

CONVERT_HELP = ("Hugging Face (Llama 2/3.x, Mistral, Qwen2/2.5/3, Gemma 3, Mixtral, Qwen3-MoE, DeepSeek-V2/V3, "
                "Kimi K2, GLM-4.5, gpt-oss, Llama 4) <-> meshfold checkpoints")


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure compute and alpha/beta with gloo processes; write a cluster file")
    p.add_argument("--nproc", type=int, default=4,
                   help="gloo processes to measure with, all busy at once, as a training run's would be (default 4)")
    p.add_argument("--out", default=None,
                   help="cluster TOML to write (default cluster-cpu-N.toml, with --gpu cluster-gpu.toml)")
    p.add_argument("--gpu", default=None, metavar="PRESET",
                   help="measure this machine's GPU instead (GEMM, HBM copy, fused attention) and write "
                        "PRESET's cluster with the measured efficiencies (e.g. --gpu h100)")


def add_dry_run_parser(sub) -> None:
    p = sub.add_parser("dry-run", help="build and step a layout for N ranks on this machine (fake ranks, "
                                       "fake tensors): memory per rank and collectives, next to the planner's")
    p.add_argument("config", help="TOML config, e.g. configs/debug.toml")
    p.add_argument("--world", type=int, required=True, help="number of ranks (GPUs) to simulate")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--cluster", default="h100", help="planner cluster preset or TOML (default h100)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: fake CUDA tensors; adds host syncs, attention kernels, wire dtypes and errors "
                        "(docs/gpu.md); exit 1 when there are errors")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")


def add_convert_parser(sub) -> None:
    p = sub.add_parser("convert", help=CONVERT_HELP)
    direction = p.add_subparsers(dest="direction", required=True)
    imp = direction.add_parser("import",
                               help="HF folder (config.json + safetensors + tokenizer) -> meshfold checkpoint")
    imp.add_argument("hf_dir", help="Hugging Face model folder (config.json, *.safetensors, tokenizer)")
    imp.add_argument("out", help="checkpoint folder to create (use it as train.init_from)")
    imp.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint meshfold wrote")
    imp.add_argument("--untie", action="store_true",
                     help="tied embeddings: give the output projection its own copy (for parallel.pp > 1)")
    exp = direction.add_parser("export", help="meshfold checkpoint (e.g. RUN_DIR/checkpoints/step-N) -> HF folder")
    exp.add_argument("checkpoint", help="meshfold checkpoint folder, e.g. RUN_DIR/checkpoints/step-N")
    exp.add_argument("out", help="Hugging Face folder to write")
    exp.add_argument("--overwrite", action="store_true", help="replace OUT if it is a folder meshfold exported")
    exp.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"), default=None, help="cast weights (default: as saved)")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file in GB (default 5)")
    exp.add_argument("--arch", default=None,  # checked in convert.run: the family list loads torch
                     help="Hugging Face model_type to write, e.g. llama, qwen2, qwen3, mistral (default: qwen3 with q/k norms, qwen2 with q/k/v biases, "
                          "else llama)")
    exp.add_argument("--tokenizer", default=None,
                     help="tokenizer folder or tokenizer.json to copy (default: the checkpoint's own, or its "
                          "run's data.tokenizer)")
    chk = direction.add_parser("check", help="logits of transformers vs meshfold's import, fp32, same tokens")
    chk.add_argument("hf_dir", help="Hugging Face model folder to import and compare")
    chk.add_argument("--json", action="store_true", help="print one JSON object (key max_abs_diff)")
    chk.add_argument("--batch", type=int, default=2, help="sequences of random tokens to compare (default 2)")
    chk.add_argument("--seq", type=int, default=64, help="tokens per sequence (at most model.seq_len)")
    chk.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")


def add_btm_parser(sub) -> None:
    p = sub.add_parser("btm", help="Branch-Train-Merge: branch a seed per domain, merge or ensemble the branches")
    cmd = p.add_subparsers(dest="btm_command", required=True)
    b = cmd.add_parser("branch", help="one run directory per domain, seeded from a checkpoint")
    b.add_argument("seed", help="seed checkpoint (RUN_DIR/checkpoints/step-N or a model-only checkpoint)")
    b.add_argument("--domain", action="append", default=[], metavar="NAME=SOURCE",
                   help="a branch and its data.source (or default:K/N, part K of N of the default corpus)")
    b.add_argument("--out", required=True, help="folder to create, one run directory per domain in it")
    b.add_argument("--config", default=None, help="base config (default: the seed run's config.toml)")
    b.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a key of every branch (e.g. train.steps=40)")
    m = cmd.add_parser("merge", help="average the branches into one checkpoint, or write an ensemble")
    m.add_argument("folder", help="the folder btm branch wrote (its branches trained)")
    m.add_argument("--out", required=True, help="checkpoint folder (or, with --ensemble, ensemble folder) to write")
    m.add_argument("--weights", action="append", default=[], metavar="NAME=W",
                   help="weight of a branch in the average (or the ensemble's prior); default equal")
    m.add_argument("--ensemble", action="store_true", help="keep every branch; weight them by the domain posterior")
    e = cmd.add_parser("eval", help="per-domain validation loss of the branches, extra models and an ensemble")
    e.add_argument("folder", help="the folder btm branch wrote (its branches trained)")
    e.add_argument("--model", action="append", default=[], metavar="LABEL=CKPT", help="another model to score")
    e.add_argument("--ensemble", default=None, help="an ensemble written by merge --ensemble")
    e.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


add_parser = {"calibrate": add_calibrate_parser, "dry-run": add_dry_run_parser, "convert": add_convert_parser,
              "btm": add_btm_parser}
