"""flaxheads train: fine-tune (or linear-probe) a local Hugging Face model folder with any
pooler/head on a text-classification dataset, on CPU, GPU or TPU, one or many hosts.

Examples:
  flaxheads train                                   # all-MiniLM-L6-v2 on BBC News (the defaults)
  flaxheads train --freeze-backbone --epochs 5      # linear probe: backbone frozen, head only
  flaxheads train --lora-rank 8 --lora-targets query,value   # LoRA adapters + head, base frozen
  flaxheads train --model path/to/hf-folder --data my.csv --text-column review --label-column stars
  flaxheads train --train-file train.jsonl --validation-file dev.jsonl --test-file test.jsonl

Data: --data is `bbc_news` (packaged), a folder with one sub-folder of .txt files per class,
or a CSV / TSV / JSON Lines / Parquet file (UTF-8); it is split --split train,validation,test
(stratified, seeded). Or give the splits as files with --train-file/--validation-file/--test-file.
Large tables (files over 16 MiB, globs of shards, or --stream) are read from disk as the model
trains, in bounded memory (split by a hash of each row; --eval-limit N evaluates on a sample).
Labels: class names or integer ids (single-label), lists of names (multi-label), floats
(regression); --problem-type overrides the guess.

Output: a run folder (--output-dir) with config.json (every resolved setting), metrics.jsonl and
TensorBoard events (one entry per log line / evaluation), curve.png, confusion_matrix.png, eval.txt
(per-class table), predictions.npz (test logits and labels), summary.json (with the throughput) and
report.html (everything on one page, no network; `flaxheads report RUN` rebuilds it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flaxheads.cli import flags
from flaxheads.cli.flags import Program
from flaxheads.cli.lora_flags import add_lora_flags
from flaxheads.errors import TrainingError, UsageError
from flaxheads.heads.poolers import POOLER_NAMES
from flaxheads.layers.remat import REMAT_POLICIES
from flaxheads.model.base_dtype import BASE_DTYPES
from flaxheads.model.quantize import QUANTIZATIONS
from flaxheads.run import RunSpec, train
from flaxheads.run.spec import (
    DEFAULT_HEAD_LR,
    DEFAULT_LR,
    FIELD_GROUP,
    HEADS,
    PROBE_LR,
    PROBLEM_TYPES,
    RANKING_OBJECTIVES,
)
from flaxheads.runtime.precision import PRECISIONS
from flaxheads.runtime.sharding import parse_mesh

#: The defaults of every flag: the spec's own.
D = RunSpec().flat()
DEFAULT_MODEL = D["model"]


def _model_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"local Hugging Face model folder, or `{DEFAULT_MODEL}` (packaged; default)",
    )
    g.add_argument(
        "--pooler",
        default="mean",
        help="pooler name, comma-separated names to concatenate, or `preset` for the HF head of the "
        f"backbone (default: mean; names: {', '.join(sorted(POOLER_NAMES))})",
    )
    g.add_argument(
        "--head",
        default="linear",
        choices=HEADS,
        help="linear | mlp | preset | token-logits (default: linear). token-logits: an LLM reranker on a causal "
        "LM (Qwen3-Reranker's form: logit('yes') - logit('no') at the end of its prompt, each (query, document) "
        "written in it); with a ranking --objective",
    )
    g.add_argument(
        "--head-hidden", type=flags.positive_ints, default=None, help="--head mlp hidden widths, e.g. 256 or 512,256"
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="the backbone's compute precision; params, head, loss and softmax/LayerNorm statistics "
        "stay float32. auto (default, or $FLAXHEADS_PRECISION): bfloat16 where the hardware "
        "multiplies it natively (TPU, GPUs from sm_80, CPUs with AMX or AVX512-BF16), else float32",
    )
    g.add_argument("--bf16", action="store_true", help="same as --precision bfloat16")
    g.add_argument(
        "--remat",
        choices=REMAT_POLICIES,
        default="none",
        help="gradient checkpointing: what the backward pass keeps of each layer. none (default): "
        "everything; full: the layer's input only (least memory, ~1 more forward); save-dots: the "
        "dense projections' outputs; save-named: the attention and feed-forward outputs",
    )
    g.add_argument(
        "--base-dtype",
        choices=BASE_DTYPES,
        default="auto",
        help="how a base that does not train (--freeze-backbone, --cache-features, LoRA) is stored: "
        "bfloat16 halves its memory; head, adapters and optimizer state stay float32. auto "
        "(default): bfloat16 when the base is frozen and the precision is bfloat16, else float32",
    )
    g.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=None,
        help="store the frozen base's matmul kernels in int8, int4 or nf4 (QLoRA with --lora-rank)",
    )


def _data_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("data")
    g.add_argument("--data", default="bbc_news", help="bbc_news | class folder | table file (default: bbc_news)")
    g.add_argument("--train-file", default=None, help="explicit training file (then --data is ignored)")
    g.add_argument("--validation-file", default=None, help="with --train-file: the validation split")
    g.add_argument("--test-file", default=None, help="with --train-file: the test split")
    g.add_argument("--text-column", default="text")
    g.add_argument("--text-pair-column", default=None, help="second text column (sentence pairs)")
    g.add_argument("--label-column", default="label")
    g.add_argument("--problem-type", default=None, choices=PROBLEM_TYPES, help="default: guessed from the labels")
    g.add_argument(
        "--label-ids",
        action="store_true",
        help="integer labels are class ids 0..K-1 (a class without training rows is kept); by default "
        "each distinct integer is a class named by its value (ratings 1-5: five classes)",
    )
    g.add_argument(
        "--split",
        type=flags.split_fractions,
        default=(0.8, 0.1, 0.1),
        help="train,validation,test fractions of --data (default 0.8,0.1,0.1; 0 for no such split)",
    )
    g.add_argument(
        "--limit", type=flags.positive_int, default=None, help="use a stratified subset of N examples (quick runs)"
    )
    g.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read table files as training runs, in bounded memory, each process its share of every "
        "batch (default: for files over 16 MiB and globs such as 'shards/*.parquet')",
    )
    g.add_argument(
        "--eval-limit",
        type=flags.positive_int,
        default=None,
        help="evaluate during training on a sample of N validation examples (the test split is "
        "evaluated in full at the end)",
    )
    g.add_argument(
        "--labels",
        type=flags.names,
        default=None,
        help="the class names, comma-separated, in id order (default: every label of the data)",
    )
    g.add_argument(
        "--max-length",
        type=flags.positive_int,
        default=D["max_length"],
        help="tokens per text (default 128; at most the model's positions)",
    )
    g.add_argument(
        "--bucket-step",
        type=flags.positive_int,
        default=32,
        help="pad each batch to a multiple of this (<= max length): bounds compiles (default 32)",
    )
    g.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pack several short training texts into one row (BERT-like encoders): the same batches and "
        "loss, fewer padded tokens (default: packed when that needs at most a third of the padded "
        "token slots and the backbone can keep texts apart)",
    )


def _training_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("training")
    g.add_argument("--epochs", type=flags.positive_float, default=D["epochs"], help="default 2")
    g.add_argument("--max-steps", type=flags.positive_int, default=None, help="stop after N steps (overrides --epochs)")
    g.add_argument(
        "--batch-size", type=flags.positive_int, default=D["batch_size"], help="global batch per step (default 16)"
    )
    g.add_argument("--eval-batch-size", type=flags.positive_int, default=64)
    g.add_argument(
        "--eval-every", type=flags.positive_int, default=None, help="steps between validations (default: each epoch)"
    )
    g.add_argument("--log-every", type=flags.positive_int, default=10)
    g.add_argument(
        "--freeze-backbone",
        "--linear-probe",
        dest="freeze_backbone",
        action="store_true",
        help="train the head only; the backbone is not differentiated (linear probe with --head linear)",
    )
    g.add_argument(
        "--cache-features",
        action="store_true",
        help="frozen backbone: encode every split once (length buckets) and train the head on the "
        "cached features (implies --freeze-backbone; see flaxheads.training.features)",
    )
    g.add_argument(
        "--sweep",
        type=flags.non_negative_int,
        default=0,
        metavar="K",
        help="train K heads at once in one vmapped step on cached features (lr log-spaced over "
        "[lr/10, lr*10], weight decay on/off, seeds seed..seed+K-1); the best on validation is "
        "saved as the run's head (implies --cache-features)",
    )
    g.add_argument(
        "--objective",
        default="classification",
        choices=("classification", *RANKING_OBJECTIVES),
        help="classification (default), or a one-score ranker / reward model trained on groups: "
        "pairwise (Bradley-Terry), hinge, listwise (softmax over a group), listnet, pointwise (BCE)",
    )
    g.add_argument(
        "--seed", type=flags.non_negative_int, default=0, help="data split, order, init and dropout (default 0)"
    )
    g.add_argument(
        "--label-smoothing",
        type=flags.below_one,
        default=0.0,
        help="single-label cross-entropy label smoothing in [0, 1) (default 0)",
    )
    g.add_argument("--threshold", type=flags.open_unit, default=0.5, help="multi-label decision threshold for metrics")


def _ranking_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("ranking objectives (--objective other than classification)")
    g.add_argument(
        "--query-column",
        default=None,
        help="query / prompt column of a ranking or preference table (default: prompt, else query)",
    )
    g.add_argument(
        "--negatives",
        type=flags.positive_int,
        default=D["negatives"],
        help="--data bbc_news: passages of other classes per headline (default 3)",
    )
    g.add_argument(
        "--margin",
        type=float,
        default=None,
        help="pairwise: s_chosen - s_rejected must exceed it (default 0); hinge: the margin (default 1)",
    )
    g.add_argument(
        "--scale",
        type=float,
        default=None,
        help="listwise / listnet: scores are multiplied by it before the softmax (default 1)",
    )


def _optimizer_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("optimizer (AdamW)")
    g.add_argument(
        "--lr",
        type=flags.positive_float,
        default=None,
        help=f"peak learning rate (default {DEFAULT_LR}; {PROBE_LR} with a frozen backbone)",
    )
    g.add_argument(
        "--head-lr",
        type=flags.positive_float,
        default=None,
        help=f"peak learning rate of the head (default {DEFAULT_HEAD_LR} when fine-tuning)",
    )
    g.add_argument(
        "--weight-decay", type=flags.non_negative_float, default=0.01, help="not applied to biases and LayerNorm"
    )
    g.add_argument("--schedule", default="linear", choices=["linear", "cosine", "constant"])
    g.add_argument("--warmup-ratio", type=flags.unit_fraction, default=0.1, help="fraction of steps with linear warmup")
    g.add_argument("--max-grad-norm", type=flags.non_negative_float, default=1.0, help="global-norm clipping (0: off)")
    g.add_argument(
        "--accumulation-steps", type=flags.positive_int, default=1, help="gradient accumulation (optax.MultiSteps)"
    )


def _device_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("devices")
    g.add_argument(
        "--parallel",
        default="single",
        choices=["single", "pmap", "mesh"],
        help="single device; pmap over local devices; jit over a device mesh (multi-host capable)",
    )
    g.add_argument(
        "--mesh",
        type=mesh_flag,
        default=None,
        metavar="AXIS=N,...",
        help="device mesh over axes data, fsdp, tensor, e.g. data=2,fsdp=4 (implies --parallel mesh): "
        "the batch is split over data x fsdp, params and optimizer state over fsdp (and tensor) by "
        "their logical axes; unnamed axes are 1, data takes the remaining devices. Prints each "
        "device's memory at the start",
    )
    g.add_argument(
        "--coordinator-address",
        default=None,
        help="multi-host: host:port of process 0 (calls jax.distributed.initialize; implies --parallel "
        "mesh). On TPU pods / SLURM, `auto` lets JAX find the cluster.",
    )
    g.add_argument("--num-processes", type=flags.positive_int, default=None)
    g.add_argument("--process-id", type=flags.non_negative_int, default=None)


def _output_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("output")
    g.add_argument("--output-dir", default=None, help="run folder (default runs/<time>-<data>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    g = ap.add_argument_group("checkpoints (Orbax, in <run folder>/checkpoints)")
    g.add_argument(
        "--no-resume",
        action="store_true",
        help="start from step 0; refuses a run folder that already has checkpoints (default: resume "
        "from its latest checkpoint)",
    )
    g.add_argument(
        "--resume-step", type=flags.non_negative_int, default=None, help="resume from this step instead of the latest"
    )
    g.add_argument(
        "--checkpoint-every",
        type=flags.non_negative_int,
        default=None,
        help="also checkpoint every N steps (default: at each evaluation and the last step; 0: the last "
        "step only, so the run still holds its model)",
    )
    g.add_argument("--keep", type=flags.positive_int, default=3, help="keep the N most recent checkpoints (default 3)")
    g.add_argument(
        "--keep-best-by",
        default="auto",
        help="also keep the best checkpoint by this validation metric, e.g. validation/macro_f1 (lowest "
        "for mse, else highest; default: the validation headline metric; `none`: off)",
    )
    g.add_argument(
        "--report-to",
        help="where the log goes: jsonl, tensorboard (event files in <run folder>/"
        "tensorboard), both joined by a comma, or none (default: both)",
    )
    g.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="write a jax.profiler trace of steps A to B (both included) to <run folder>/profile",
    )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Register every ``train`` flag on ``ap``."""
    for add in (
        _model_flags,
        _data_flags,
        _training_flags,
        _ranking_flags,
        add_lora_flags,
        _optimizer_flags,
        _device_flags,
        _output_flags,
    ):
        add(ap)


def build_parser() -> flags.Parser:
    """The ``flaxheads train`` parser on its own (``flaxheads.cli.main`` registers the same flags)."""
    ap = flags.Parser(prog="flaxheads train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return ap


def add_train_command(sub: argparse._SubParsersAction) -> None:
    """Register ``flaxheads train``."""
    p = sub.add_parser(
        "train",
        help="fine-tune or linear-probe a head on a text-classification dataset",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run_command)


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The run the flags describe; the two conflicts only flags can have are refused here, every
    other one by the library (:func:`flaxheads.run.checks.check_spec`)."""
    if args.bf16 and args.precision not in (None, "bfloat16"):
        raise UsageError(f"--bf16 means --precision bfloat16; it contradicts --precision {args.precision}: give one")
    if args.no_resume and args.resume_step is not None:
        raise UsageError("--no-resume and --resume-step contradict each other; give one")
    given = {name: getattr(args, name) for name in FIELD_GROUP if hasattr(args, name)}
    given.update(
        precision="bfloat16" if args.bf16 else args.precision,
        seed=args.seed,
        resume="never" if args.no_resume else args.resume_step if args.resume_step is not None else "auto",
    )
    return RunSpec.from_kwargs(**given)


def mesh_flag(text: str) -> str:
    """``--mesh``: ``axis=size`` pairs over data, fsdp, tensor, returned as written."""
    try:
        parse_mesh(text)
    except TrainingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def run_command(args: argparse.Namespace, program: Program | None = None) -> int:
    """Everything ``flaxheads train`` does: the flags' spec, run."""
    train(
        spec_from_args(args),
        progress=not (args.no_progress or getattr(args, "quiet", False)),  # -q: errors and warnings only
        argv=sys.argv[1:],
        started=None if program is None else program.started,
        compile_cache=None if program is None else program.compile_cache,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``flaxheads train ARGS``: the same as ``flaxheads.cli.main.main(["train", *ARGS])``."""
    from flaxheads.cli.main import main as flaxheads_main

    return flaxheads_main(["train", *(sys.argv[1:] if argv is None else argv)])
