"""``elastic-mnist``: the train, evaluate, inspect, plot, rendezvous and synth commands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from elastic_mnist import rendezvous
from elastic_mnist.config import add_train_arguments, train_config_from_args
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    USER_ERRORS,
    CheckpointError,
    ConfigError,
    DataError,
    EnvError,
    InvalidCheckpoint,
    report_user_error,
)


class OneLineParser(argparse.ArgumentParser):
    """Bad flags get one line on stderr and exit code 2, not a usage dump."""

    def error(self, message: str) -> None:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="elastic-mnist", description=__doc__.split("\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    train = commands.add_parser("train", help="train under torchrun (or as one process)",
                                description="Train the ConvNet; launch under torchrun for "
                                            "several processes.")
    add_train_arguments(train)

    evaluate = commands.add_parser("evaluate", help="test accuracy of the newest checkpoint",
                                   description="Evaluate the newest valid checkpoint on the test "
                                               "split.")
    evaluate.add_argument("--checkpoint-dir", required=True, help="folder of the checkpoints")
    evaluate.add_argument("--data-dir", default=None,
                          help="folder of the digits (default: the one the run trained on)")
    evaluate.add_argument("--dataset", choices=("mnist", "synthetic"), default=None,
                          help="dataset kind (default: the one the run trained on)")
    evaluate.add_argument("--no-download", dest="download", action="store_false",
                          help="do not download MNIST when its files are missing")
    evaluate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                          help="where to evaluate (default: auto)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")

    inspect = commands.add_parser("inspect", help="list checkpoints, verified",
                                  description="List every checkpoint with its step, epoch, world "
                                              "size, validity and model digest.")
    inspect.add_argument("--checkpoint-dir", required=True, help="folder of the checkpoints")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")

    plot = commands.add_parser("plot", help="draw a run's curves into a PNG, SVG or PDF",
                               description="Loss, error rate and throughput over steps, restarts "
                                           "and the world size marked, from a run folder "
                                           "(<logdir>/<run id>), with matplotlib.")
    plot.add_argument("run_dir", help="the run's folder (<logdir>/<run id>)")
    plot.add_argument("-o", "--out", default="run.png",
                      help="file to write; its ending picks the format: .png, .svg or .pdf "
                           "(default: run.png)")

    store = commands.add_parser("rendezvous", help="serve the rendezvous store",
                                description="Serve the rendezvous store, at which torchrun's "
                                            "agents meet (under our rendezvous or torch's c10d), "
                                            "as a process of its own, outside every training "
                                            "node (RDZV_STORE=external in jobs/node.sh).")
    rendezvous.add_arguments(store)

    synth = commands.add_parser("synth", help="write a synthetic digits dataset",
                                description="Render synthetic digits into DIR in MNIST's layout.")
    synth.add_argument("--out", required=True, help="folder to write (DIR/MNIST/raw/...)")
    synth.add_argument("--train", type=int, default=60_000, help="training images (default: 60000)")
    synth.add_argument("--test", type=int, default=10_000, help="test images (default: 10000)")
    synth.add_argument("--seed", type=int, default=0, help="seed of the rendering (default: 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"train": cmd_train, "evaluate": cmd_evaluate, "inspect": cmd_inspect,
               "plot": cmd_plot, "rendezvous": rendezvous.run, "synth": cmd_synth}[args.command]
    try:
        status = command(args)
        sys.stdout.flush()  # a reader that went away (| head) shows here, not at exit
        return status
    except USER_ERRORS + (CheckpointError,) as e:
        return report_user_error(args.command, e)
    except BrokenPipeError:  # the reader has what it wanted: a normal end
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl-C before the training loop answers it (start-up, imports)
        return report_interrupt(args.command)


def report_interrupt(command: str) -> int:
    """One line (from rank 0 alone) for a Ctrl-C that came before any step could answer it; the
    status as job.report_stop gives it: 0 under torchrun, which must not restart the worker."""
    try:
        env = DistEnv.from_environ()
    except EnvError:
        env = DistEnv()
    if env.is_main:
        sys.stderr.write(f"elastic-mnist {command}: interrupted\n")
        sys.stderr.flush()
    return 0 if env.launched else EXIT_INTERRUPTED



def cmd_train(args: argparse.Namespace) -> int:
    cfg = train_config_from_args(args)
    cfg.validate()
    env = DistEnv.from_environ()
    from elastic_mnist.worker import worker_main

    return worker_main(cfg, env)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from elastic_mnist.checkpoint import deserialize, newest_valid
    from elastic_mnist.data.datasets import dataset_root, load, prepare
    from elastic_mnist.distributed import resolve_device
    from elastic_mnist.model import build_model
    from elastic_mnist.report import evaluate

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    found = newest_valid(Path(args.checkpoint_dir))
    if found is None:
        raise DataError(f"no valid checkpoint in {args.checkpoint_dir}")
    manifest, data = found
    source = str(Path(args.checkpoint_dir) / manifest.file)
    payload = deserialize(data, source)
    trained_on = payload["config"]["data"]
    data_dir = Path(args.data_dir or trained_on["data_dir"])
    dataset_flag = args.dataset or trained_on["dataset"]
    kind = prepare(data_dir, dataset_flag, download=args.download,
                   synthetic_fallback=args.dataset is None and payload["data"]["kind"] == "synthetic")
    dataset = load(dataset_root(data_dir, dataset_flag, kind), kind)
    device = resolve_device(args.device, DistEnv())
    model = build_model(0).to(device)
    model.load_state_dict(payload["model"])
    loss, accuracy = evaluate(model, dataset.test.to(device), device, DistEnv())
    result = {"accuracy": accuracy, "loss": loss, "step": manifest.step, "epoch": manifest.epoch,
              "epoch_number": manifest.epoch_number,
              "checkpoint": source, "dataset": kind, "test_samples": len(dataset.test)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{source}: step {manifest.step}, epoch {manifest.epoch_number}: test accuracy "
              f"{100 * accuracy:.2f}%, loss {loss:.4f} on {len(dataset.test)} {kind} digits")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from elastic_mnist.checkpoint import (
        POINTER,
        Manifest,
        deserialize,
        list_manifests,
        read_verified,
    )
    from elastic_mnist.model import state_digest

    directory = Path(args.checkpoint_dir)
    if not directory.is_dir():
        raise DataError(f"{directory} is not a folder")
    rows = []
    for entry in list_manifests(directory):
        if not isinstance(entry, Manifest):
            rows.append({"file": entry[0].name, "path": str(entry[0].resolve()), "valid": False,
                         "reason": entry[1]})
            continue
        row = {"file": entry.file, "path": str((directory / entry.file).resolve()),
               "step": entry.step, "epoch": entry.epoch,
               "cursor": entry.cursor, "samples_seen": entry.samples_seen,
               "world_size": entry.world_size, "run_id": entry.run_id,
               "restart_generation": entry.restart_generation, "bytes": entry.bytes,
               "saved_at": entry.saved_at, "data_fingerprint": entry.data_fingerprint,
               "valid": False, "model_digest": None, "reason": "",
               "epoch_number": entry.epoch_number}
        try:
            payload = deserialize(read_verified(directory, entry), str(directory / entry.file))
            row.update(valid=True, model_digest=state_digest(payload["model"]))
        except (InvalidCheckpoint, CheckpointError) as e:
            row["reason"] = str(e)
        rows.append(row)
    pointer = directory / POINTER
    latest = pointer.read_text().strip() if pointer.exists() else None
    if args.json:
        print(json.dumps({"checkpoint_dir": str(directory), "latest": latest,
                          "checkpoints": rows}, indent=2))
        return 0
    print(f"{directory} (latest: {latest})")
    for row in rows:
        if "step" not in row:
            print(f"  {row['file']}: INVALID ({row['reason']})")
            continue
        status = f"digest {row['model_digest'][:16]}" if row["valid"] else \
            f"INVALID ({row['reason']})"
        print(f"  step {row['step']:>7}  epoch {row['epoch_number']:>3}  "
              f"world {row['world_size']:>3}  "
              f"{row['bytes']:>9} B  {status}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from elastic_mnist.plot import plot_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise DataError(f"{run_dir} is not a folder")
    try:
        plot_run(run_dir, Path(args.out))
    except ValueError as e:
        raise DataError(str(e)) from None
    print(f"wrote {args.out}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from elastic_mnist.data.datasets import write_synthetic

    for flag in ("train", "test"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag} must be positive, got {getattr(args, flag)}")
    write_synthetic(Path(args.out), train=args.train, test=args.test, seed=args.seed)
    print(f"wrote {args.train} train and {args.test} test synthetic digits to {args.out}/MNIST/raw")
    return 0


if __name__ == "__main__":
    sys.exit(main())
