"""A command line for a module and a data module, in the manner of Lightning's
``LightningCLI`` and on the library it uses, jsonargparse.

    python train.py fit --trainer.max_epochs 3 --model.lr 1e-3 --seed_everything 7
    python train.py fit --config cfg.yaml --trainer.callbacks+=EarlyStopping \\
        --trainer.callbacks.monitor loss
    python train.py fit --print_config > cfg.yaml
    python train.py validate --config cfg.yaml --ckpt_path last

Arguments come from the type hints and docstrings of ``Trainer.__init__``, the
module's ``__init__`` and the data module's ``__init__`` (``--trainer.*``,
``--model.*``, ``--data.*``); callbacks, loggers and strategies are given by
class name or ``class_path``/``init_args``. ``--seed_everything`` seeds the
run (`seed_everything`) before anything is built. After ``fit`` it prints the
``tensorboard --logdir`` command for the run. Bad arguments exit with status 2
and jsonargparse's message naming the argument. A `SaveConfigCallback` saves
the full configuration as ``config.yaml`` in the run directory, which reruns
the same run with ``--config``.

Needs the ``cli`` extra: ``pip install jaxlightning[cli]``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxlightning.callbacks.base import Callback
from jaxlightning.cluster import distributed
from jaxlightning.io import storage
from jaxlightning.module import JaxModule
from jaxlightning.seed import seed_everything
from jaxlightning.trainer import Trainer

try:
    import jsonargparse
    from jsonargparse import ActionConfigFile, ArgumentParser
except ImportError:  # the ``cli`` extra is not installed: using the CLI says so
    jsonargparse = ActionConfigFile = None
    ArgumentParser = object


def _keep_none() -> dict[str, bool]:
    """``save``'s argument that keeps ``None`` values (an explicit ``null``
    overriding a default must rerun as ``null``); renamed in jsonargparse 4.49."""
    if jsonargparse is None:
        return {}
    version = tuple(int(p) for p in jsonargparse.__version__.split(".")[:2] if p.isdigit())
    return {"skip_unset": False} if version >= (4, 49) else {"skip_none": False}


_KEEP_NONE = _keep_none()

SUBCOMMANDS = ("fit", "validate", "test", "predict")
_INSTALL_HINT = (
    "jaxlightning.cli needs jsonargparse: pip install 'jaxlightning[cli]' "
    "(or 'jsonargparse[signatures]')"
)


class LightningArgumentParser(ArgumentParser):  # type: ignore[misc,valid-type]
    """jsonargparse's ``ArgumentParser`` with Lightning's `add_lightning_class_args`.

    `LightningCLI.add_arguments_to_parser` receives one; its
    ``link_arguments``, ``add_argument``, ``set_defaults`` and
    ``add_class_arguments`` are jsonargparse's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if ActionConfigFile is None:
            raise ImportError(_INSTALL_HINT)
        super().__init__(*args, **kwargs)
        self.callback_keys: list[str] = []

    def add_lightning_class_args(
        self,
        lightning_class: type,
        nested_key: str,
        subclass_mode: bool = False,
        required: bool = True,
    ) -> list[str]:
        """Adds the ``__init__`` arguments of ``lightning_class`` under ``nested_key``
        (``--nested_key.arg``). A `Callback` class added so is built from them
        and appended to the Trainer's callbacks.

        Args:
            lightning_class: a `Callback`, `JaxModule`, data module or `Trainer` class.
            nested_key: the arguments' prefix.
            subclass_mode: accept any subclass, chosen with ``--nested_key.class_path``.
            required: (with ``subclass_mode``) whether the argument must be given.

        Returns:
            The names of the arguments added.
        """
        if not isinstance(lightning_class, type):
            raise TypeError(
                f"add_lightning_class_args({lightning_class!r}, {nested_key!r}): pass a class "
                "(a Callback, JaxModule, data module or Trainer class)"
            )
        if issubclass(lightning_class, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(
                lightning_class, nested_key, fail_untyped=False, required=required
            )
        return self.add_class_arguments(
            lightning_class,
            nested_key,
            fail_untyped=False,
            instantiate=not issubclass(lightning_class, Trainer),
            sub_configs=True,
        )


class SaveConfigCallback(Callback):
    """Saves the CLI's configuration as ``config_filename`` in the run directory
    (the Trainer's ``log_dir``), once: with ``--config``, it reruns the run.

    A ``fit`` saves it when it starts (``on_fit_start``: after a resumed fit has
    taken over its checkpoint's run directory), ``validate``/``test``/``predict``
    in ``setup``. A Trainer without a logger has no run directory: the file
    goes into ``default_root_dir``, as Lightning's.

    Args:
        parser: the parser that read the configuration.
        config: the configuration to save.
        config_filename: the file's name.
        overwrite: replace a file of that name already in the run directory.
        multifile: keep configuration read from several files in several files.
        save_to_log_dir: write the file (``False``: only call `save_config`,
            for a subclass that saves elsewhere).

    Raises:
        RuntimeError: when the file exists in the run directory of a new run
            and ``overwrite`` is off, to keep an earlier run's configuration.
            A fit that continues a run (resumed from a checkpoint, or the same
            Trainer again) keeps the file it finds.
    """

    def __init__(
        self,
        parser: Any,
        config: Any,
        config_filename: str = "config.yaml",
        overwrite: bool = False,
        multifile: bool = False,
        save_to_log_dir: bool = True,
    ) -> None:
        self.parser = parser
        self.config = config
        self.config_filename = config_filename
        self.overwrite = overwrite
        self.multifile = multifile
        self.save_to_log_dir = save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and type(self).save_config is SaveConfigCallback.save_config:
            raise ValueError(
                "SaveConfigCallback(save_to_log_dir=False) saves nothing: subclass it and "
                "implement save_config() to save the configuration elsewhere"
            )

    def setup(self, trainer: Any, module: JaxModule, stage: str) -> None:
        if stage != "fit":
            self._save(trainer, module, stage)

    def on_fit_start(self, trainer: Any, module: JaxModule) -> None:
        self._save(trainer, module, "fit")

    def save_config(self, trainer: Any, module: JaxModule, stage: str) -> None:
        """Override to save the configuration somewhere else too (process 0
        only), e.g. ``self.parser.dump(self.config, skip_none=False)`` to a logger."""

    def _save(self, trainer: Any, module: JaxModule, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            folder = trainer.log_dir or trainer.default_root_dir  # no logger: Lightning's
            self._write(folder, continuing=trainer.global_step > 0)
        if distributed.is_rank_zero():
            self.save_config(trainer, module, stage)
        self.already_saved = True

    def _write(self, log_dir: str, *, continuing: bool) -> None:
        path = storage.join(log_dir, self.config_filename)
        found = distributed.is_rank_zero() and storage.exists(path)
        if bool(distributed.broadcast(np.int32(found))) and not self.overwrite:
            if continuing:  # the run's own configuration: keep it
                return
            raise RuntimeError(
                f"{type(self).__name__} expected {path} to NOT exist. Aborting to avoid "
                "overwriting results of a previous run. You can delete the previous config "
                "file, set `LightningCLI(save_config_callback=None)` to disable config "
                'saving, or set `LightningCLI(save_config_kwargs={"overwrite": True})` to '
                "overwrite the config file."
            )
        if distributed.is_rank_zero():
            if storage.is_remote(path):  # one file, written whole
                text = self.parser.dump(self.config, **_KEEP_NONE)
                with storage.open_file(path, "w") as f:
                    f.write(text)
                return
            os.makedirs(log_dir, exist_ok=True)
            self.parser.save(
                self.config, path, overwrite=self.overwrite, multifile=self.multifile, **_KEEP_NONE
            )


class LightningCLI:
    """Parses the command line, seeds the run, builds the Trainer, module and
    data module, and runs the subcommand (``fit``, ``validate``, ``test`` or
    ``predict``).

    Subclass it to act around a subcommand: ``before_fit``/``after_fit`` (and
    the same for the others) are called with no arguments when defined; the
    objects are ``self.trainer``, ``self.model``, ``self.datamodule``, and what
    the subcommand returned is ``self.result``. `add_arguments_to_parser` adds
    arguments or links them (``parser.link_arguments("data.num_classes",
    "model.num_classes", apply_on="instantiate")``).

    Args:
        model_class: the `JaxModule` subclass (``None``: any, chosen on the
            command line with ``--model.class_path``).
        datamodule_class: the data module class (``None``: none).
        save_config_callback: the callback that saves the configuration in
            the run directory (``None``: none).
        save_config_kwargs: its arguments (``{"overwrite": True}``,
            ``{"config_filename": "name.yaml"}``).
        trainer_defaults: defaults for ``Trainer`` arguments, which the command
            line and config files override. Its ``callbacks`` (instances, or
            ``{"class_path": ..., "init_args": ...}``) are not arguments: they
            are always added, after those of the command line.
        seed_everything_default: the default of ``--seed_everything``: a seed,
            ``True`` for `seed_everything`'s own (``PL_GLOBAL_SEED``, else 0),
            ``False`` to seed nothing.
        args: the arguments (default: ``sys.argv[1:]``), or a dict of the
            configuration.
        run: run the subcommand (``False``: only build the objects from
            arguments without a subcommand).
        default_subcommand: the subcommand when the arguments name none
            (``None``: one is required, as in Lightning).
        description: the ``--help`` text.
        save_config: ``False`` is ``save_config_callback=None``.
    """

    def __init__(
        self,
        model_class: type[JaxModule] | None = None,
        datamodule_class: type | None = None,
        *,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        args: Sequence[str] | Mapping[str, Any] | None = None,
        run: bool = True,
        default_subcommand: str | None = None,
        description: str | None = None,
        save_config: bool = True,
    ) -> None:
        if default_subcommand not in (None, *SUBCOMMANDS):
            raise ValueError(f"default_subcommand={default_subcommand!r}: use one of {SUBCOMMANDS}")
        self.model_class = model_class
        self.datamodule_class = datamodule_class
        self.save_config_callback = save_config_callback if save_config else None
        self.save_config_kwargs = dict(save_config_kwargs or {})
        self.trainer_defaults = dict(trainer_defaults or {})
        self.seed_everything_default = seed_everything_default
        self.setup_parser(run, description)
        self.parse_arguments(self.parser, args, default_subcommand if run else None)
        self.subcommand: str | None = self.config["subcommand"] if run else None
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        self.result: Any = None
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------- parsing
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """A parser with ``-c/--config`` (YAML files)."""
        parser = LightningArgumentParser(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile, help="a YAML config file")
        return parser

    def setup_parser(self, add_subcommands: bool, description: str | None) -> None:
        """``self.parser``, with a parser per subcommand (or, without
        subcommands, the arguments themselves)."""
        self.parser = self.init_parser(description=description)
        self._subcommand_parsers: dict[str, LightningArgumentParser] = {}
        if not add_subcommands:
            self._add_arguments(self.parser)
            return
        subcommands = self.parser.add_subcommands(required=True, dest="subcommand")
        for name in SUBCOMMANDS:
            summary = _first_line(getattr(Trainer, name).__doc__) or f"Trainer.{name}"
            sub = self.init_parser(description=summary)
            self._add_arguments(sub)
            sub.add_argument(
                "--ckpt_path",
                type=str | None,
                default=None,
                help="a checkpoint folder, 'last' or 'best'",
            )
            self._subcommand_parsers[name] = sub
            subcommands.add_subcommand(name, sub, help=summary)

    def _add_arguments(self, parser: LightningArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--seed_everything``."""
        parser.add_argument(
            "--seed_everything",
            type=bool | int,
            default=self.seed_everything_default,
            help=(
                "seed Python, numpy, torch and the Trainer's JAX keys (unless "
                "--trainer.seed is given) with this int before anything is built; true: "
                "seed_everything's own seed (PL_GLOBAL_SEED, else 0); false: seed nothing"
            ),
        )

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--trainer.*``, ``--model.*`` and ``--data.*``."""
        # The Trainer is built by `instantiate_trainer`, with the callbacks the
        # arguments cannot hold; its arguments' classes are built by the parser.
        parser.add_lightning_class_args(Trainer, "trainer")
        for key, value in self.trainer_defaults.items():
            if key != "callbacks":
                _set_trainer_default(parser, key, value)
        if self.model_class is None:
            parser.add_lightning_class_args(JaxModule, "model", subclass_mode=True)
        else:
            parser.add_lightning_class_args(self.model_class, "model")
        if self.datamodule_class is not None:
            parser.add_lightning_class_args(self.datamodule_class, "data")

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Override to add arguments or links to each parser (one per subcommand):
        ``parser.link_arguments("data.batch_size", "model.batch_size")``,
        ``parser.add_lightning_class_args(EarlyStopping, "early_stopping")``."""

    def parse_arguments(
        self,
        parser: LightningArgumentParser,
        args: Sequence[str] | Mapping[str, Any] | None,
        default_subcommand: str | None = None,
    ) -> None:
        """Parses ``args`` (or ``sys.argv[1:]``) into ``self.config``."""
        if isinstance(args, Mapping):
            self.config = parser.parse_object(dict(args))
            return
        args = list(sys.argv[1:] if args is None else args)
        if default_subcommand and not _names_subcommand(args):
            args = [default_subcommand, *args]
        self.config = parser.parse_args(args)

    def _parser(self, subcommand: str | None) -> LightningArgumentParser:
        return self.parser if subcommand is None else self._subcommand_parsers[subcommand]

    def _get(self, config: Any, key: str, default: Any = None) -> Any:
        """``key`` of the subcommand's part of ``config`` (or of ``config``)."""
        own = config.get(self.subcommand, config) if self.subcommand else config
        return own.get(key, default)

    # -------------------------------------------------------------- seeding
    def _set_seed(self) -> None:
        """Runs `seed_everything` as ``--seed_everything`` says, and records the
        seed used in the configuration (so a saved config reruns the run)."""
        seed = self._get(self.config, "seed_everything")
        if seed is False:
            return
        seed = seed_everything(None if seed is True else seed, workers=True)
        own = self.config[self.subcommand] if self.subcommand else self.config
        own["seed_everything"] = seed

    # --------------------------------------------------------- instantiation
    def before_instantiate_classes(self) -> None:
        """Override to run code before the objects are built."""

    def after_instantiate_classes(self) -> None:
        """Override to run code after the objects are built."""

    def instantiate_classes(self) -> None:
        """Builds ``self.model``, ``self.datamodule`` and ``self.trainer``."""
        # A multi-process job joins before anything touches the devices.
        distributed.initialize(self._get(self.config, "trainer").get("num_nodes"))
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        self.config_init = instantiate(self.config)
        self.model: JaxModule = self._get(self.config_init, "model")
        self.datamodule: Any = self._get(self.config_init, "data")
        self.trainer: Trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer of the configuration (``kwargs`` override it), with the
        callbacks of `add_lightning_class_args`, of ``trainer_defaults`` and the
        `SaveConfigCallback` after its own."""
        config = dict(self._get(self.config_init, "trainer", {}))
        config.update(kwargs)
        keys = self._parser(self.subcommand).callback_keys
        extra = [self._get(self.config_init, key) for key in keys]
        callbacks = [*_as_list(config.get("callbacks")), *extra]
        callbacks += [_built(c) for c in _as_list(self.trainer_defaults.get("callbacks"))]
        if self.save_config_callback is not None and not config.get("fast_dev_run"):
            callbacks.append(
                self.save_config_callback(
                    self._parser(self.subcommand),
                    self.config[self.subcommand] if self.subcommand else self.config,
                    **self.save_config_kwargs,
                )
            )
        config["callbacks"] = callbacks
        return Trainer(**config)

    # --------------------------------------------------------------- running
    def _run_subcommand(self, subcommand: str) -> None:
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        kwargs: dict[str, Any] = {"ckpt_path": self._get(self.config_init, "ckpt_path")}
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        own = getattr(self, subcommand, None)
        if callable(own):  # a subclass's method of the subcommand's name runs instead,
            self.result = own(model=self.model, **kwargs)  # called as Lightning calls it
        else:
            self.result = getattr(self.trainer, subcommand)(self.model, **kwargs)
        log_dir = self.trainer.log_dir
        if subcommand == "fit" and log_dir is not None and distributed.is_rank_zero():
            print(f"TensorBoard: tensorboard --logdir {os.path.dirname(log_dir)}", flush=True)
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()


def _names_subcommand(args: list[str]) -> bool:
    """Whether ``args`` name a subcommand (or only ask for top-level help)."""
    return bool(args) and args[0] in (*SUBCOMMANDS, "-h", "--help")


def _set_trainer_default(parser: LightningArgumentParser, key: str, value: Any) -> None:
    """``trainer_defaults[key]`` as the default of ``--trainer.key``, or an error
    that names it and says what to give."""
    try:
        parser.set_defaults({f"trainer.{key}": value})
    except KeyError as exc:
        raise ValueError(
            f"trainer_defaults[{key!r}]: Trainer has no argument {key!r}; see "
            "Trainer.__init__ for the ones it has"
        ) from exc
    except ValueError as exc:
        name = type(value).__name__
        raise ValueError(
            f"trainer_defaults[{key!r}] is a {name} instance: a default the command line "
            f"overrides and config.yaml records cannot be one ({exc}). Give "
            f"{{'class_path': '{type(value).__module__}.{name}', 'init_args': {{...}}}} or "
            f"jsonargparse.lazy_instance({name}, ...) instead"
        ) from exc


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n")[0].strip()


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _built(callback: Any) -> Any:
    """A ``trainer_defaults`` callback: an instance as it is, or one built from
    ``{"class_path": ..., "init_args": {...}}`` (a bare class name is looked up
    in ``jaxlightning.callbacks``)."""
    if not isinstance(callback, Mapping):
        return callback
    if "class_path" not in callback:
        raise ValueError(
            f"trainer_defaults['callbacks'] holds {callback!r}: give callback instances, or "
            "dicts with a 'class_path' (and 'init_args')"
        )
    module_name, _, name = str(callback["class_path"]).rpartition(".")
    module = importlib.import_module(module_name or "jaxlightning.callbacks")
    return getattr(module, name)(**dict(callback.get("init_args") or {}))
