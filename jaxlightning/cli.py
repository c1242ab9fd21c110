"""A command line for a module and a data module, in the manner of Lightning's
``LightningCLI`` and on the library it uses, jsonargparse.

    python train.py fit --trainer.max_epochs 3 --model.lr 1e-3
    python train.py fit --config cfg.yaml --trainer.callbacks+=EarlyStopping \\
        --trainer.callbacks.monitor val/loss
    python train.py fit --print_config > cfg.yaml
    python train.py validate --config cfg.yaml --ckpt_path last

Arguments come from the type hints and docstrings of ``Trainer.__init__``, the
module's ``__init__`` and the data module's ``__init__`` (``--trainer.*``,
``--model.*``, ``--data.*``); callbacks, loggers and strategies are given by
class name or ``class_path``/``init_args``. After ``fit`` it prints the
``tensorboard --logdir`` command for the run. Bad arguments exit with status 2
and jsonargparse's message naming the argument. ``fit`` saves the full
configuration as ``config.yaml`` in the run directory, which reruns the same
run with ``--config``.

Needs the ``cli`` extra: ``pip install jaxlightning[cli]``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from jaxlightning import distributed
from jaxlightning.module import JaxModule
from jaxlightning.trainer import Trainer

SUBCOMMANDS = ("fit", "validate", "test", "predict")


def _jsonargparse() -> Any:
    try:
        import jsonargparse
    except ImportError as exc:
        raise ImportError(
            "jaxlightning.cli needs jsonargparse: pip install 'jaxlightning[cli]' "
            "(or 'jsonargparse[signatures]')"
        ) from exc
    return jsonargparse


class LightningCLI:
    """Parses the command line, builds the Trainer, module and data module, and
    runs the subcommand (``fit``, ``validate``, ``test`` or ``predict``).

    Subclass it to act around a subcommand: ``before_fit``/``after_fit`` (and
    the same for the others) are called with no arguments when defined; the
    objects are ``self.trainer``, ``self.model``, ``self.datamodule``, and what
    the subcommand returned is ``self.result``.

    Args:
        model_class: the `JaxModule` subclass (``None``: any, chosen on the
            command line with ``--model.class_path``).
        datamodule_class: the data module class (``None``: none).
        trainer_defaults: defaults for ``Trainer`` arguments, which the command
            line and config files override.
        args: the arguments (default: ``sys.argv[1:]``).
        run: run the subcommand (``False``: only build the objects from
            arguments without a subcommand).
        default_subcommand: the subcommand when the arguments name none
            (``None``: one is required, as in Lightning).
        save_config: write ``config.yaml`` into the run directory at ``fit``.
    """

    def __init__(
        self,
        model_class: type[JaxModule] | None = None,
        datamodule_class: type | None = None,
        *,
        trainer_defaults: dict[str, Any] | None = None,
        args: Sequence[str] | None = None,
        run: bool = True,
        default_subcommand: str | None = None,
        save_config: bool = True,
        description: str | None = None,
    ) -> None:
        if default_subcommand not in (None, *SUBCOMMANDS):
            raise ValueError(f"default_subcommand={default_subcommand!r}: use one of {SUBCOMMANDS}")
        self.model_class = model_class
        self.datamodule_class = datamodule_class
        self.trainer_defaults = dict(trainer_defaults or {})
        self.save_config = save_config
        args = list(sys.argv[1:] if args is None else args)
        self.parser = self._parser(description, subcommands=run)
        if run and default_subcommand and not _names_subcommand(args):
            args = [default_subcommand, *args]
        self.config = self.parser.parse_args(args)
        self.subcommand: str | None = self.config.get("subcommand") if run else None
        own = self.config[self.subcommand] if self.subcommand else self.config
        self._own_config = own
        objects = self._instantiate(own)
        self.trainer: Trainer = objects.trainer
        self.model: JaxModule = objects.model
        self.datamodule: Any = objects.get("data")
        self.result: Any = None
        if self.subcommand:
            self._run(self.subcommand, own.get("ckpt_path"))

    # ------------------------------------------------------------- parsing
    def _parser(self, description: str | None, *, subcommands: bool) -> Any:
        ja = _jsonargparse()
        parser = ja.ArgumentParser(description=description)
        if not subcommands:
            self._add_arguments(parser, None)
            return parser
        subs = parser.add_subcommands(required=True, dest="subcommand")
        for name in SUBCOMMANDS:
            sub = ja.ArgumentParser(description=f"Trainer.{name}")
            self._add_arguments(sub, name)
            subs.add_subcommand(name, sub, help=f"run Trainer.{name}")
        return parser

    def _add_arguments(self, parser: Any, subcommand: str | None) -> None:
        ja = _jsonargparse()
        parser.add_argument("--config", action=ja.ActionConfigFile, help="a YAML config file")
        # The Trainer first: in a multi-process job it joins the processes
        # before anything else touches the devices.
        parser.add_class_arguments(Trainer, "trainer", fail_untyped=False)
        if self.trainer_defaults:
            parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items()})
        if self.model_class is None:
            parser.add_subclass_arguments(JaxModule, "model", fail_untyped=False)
        else:
            parser.add_class_arguments(self.model_class, "model", fail_untyped=False)
        if self.datamodule_class is not None:
            parser.add_class_arguments(self.datamodule_class, "data", fail_untyped=False)
        if subcommand is not None:
            parser.add_argument(
                "--ckpt_path",
                type=str | None,
                default=None,
                help="a checkpoint folder, 'last' or 'best'",
            )

    def _instantiate(self, config: Any) -> Any:
        parser = self.parser
        if self.subcommand:
            parser = parser._subcommands_action._name_parser_map[self.subcommand]
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        return instantiate(config)

    # --------------------------------------------------------------- running
    def _run(self, subcommand: str, ckpt_path: str | None) -> None:
        before = getattr(self, f"before_{subcommand}", None)
        if before is not None:
            before()
        if subcommand == "fit" and self.save_config:
            self._write_config()
        method = getattr(self.trainer, subcommand)
        kwargs: dict[str, Any] = {"ckpt_path": ckpt_path}
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        self.result = method(self.model, **kwargs)
        log_dir = self.trainer.log_dir
        if subcommand == "fit" and log_dir is not None and distributed.is_rank_zero():
            print(f"TensorBoard: tensorboard --logdir {os.path.dirname(log_dir)}", flush=True)
        after = getattr(self, f"after_{subcommand}", None)
        if after is not None:
            after()

    def _write_config(self) -> None:
        """``config.yaml`` in the run directory: ``--config`` reruns the run."""
        log_dir = self.trainer.log_dir
        if log_dir is None or not distributed.is_rank_zero():
            return
        os.makedirs(log_dir, exist_ok=True)
        sub = self.parser._subcommands_action._name_parser_map[self.subcommand]
        text = sub.dump(self._own_config)
        with open(os.path.join(log_dir, "config.yaml"), "w") as f:
            f.write(text)


def _names_subcommand(args: list[str]) -> bool:
    """Whether ``args`` name a subcommand (or only ask for top-level help)."""
    return bool(args) and args[0] in (*SUBCOMMANDS, "-h", "--help")
