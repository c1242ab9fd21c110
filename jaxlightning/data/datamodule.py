"""`DataModule`: the data side of a run, in one object (Lightning's `LightningDataModule`).

The Trainer uses any object with the same methods (duck-typed), so an existing
``lightning.LightningDataModule`` subclass, which is plain torch data code,
works unchanged as ``datamodule=``; Lightning need not be installed.
"""

from __future__ import annotations

from typing import Any

from jaxlightning.cluster import distributed

# Base classes whose loader methods are placeholders, not the user's code.
_PLACEHOLDER_OWNERS = ("DataModule", "LightningDataModule", "DataHooks")
_LOADER_OF_STAGE = {
    "train": "train_dataloader",
    "validation": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


class DataModule:
    """Override the loaders your runs need; all hooks are optional.

    Order, per Trainer call: `prepare_data` (process 0 of a multi-process run
    only: download or write files once), then `setup` with the stage
    (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``) on every process,
    then the stage's loaders. `state_dict` is saved in checkpoints and handed
    to `load_state_dict` when `fit` resumes.
    """

    def prepare_data(self) -> None:
        """Once per job, on process 0: download, tokenise, write to disk."""

    def setup(self, stage: str) -> None:
        """On every process, before the stage's loaders are asked for."""

    def teardown(self, stage: str) -> None:
        """After the stage, on every process."""

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no train_dataloader()")

    def val_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no val_dataloader()")

    def test_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no test_dataloader()")

    def predict_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no predict_dataloader()")

    def state_dict(self) -> dict[str, Any]:
        """State to keep in checkpoints (JSON-serialisable)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""


def is_datamodule(obj: Any) -> bool:
    """Whether ``obj`` is a data module (this project's or Lightning's): passed
    where loaders go, ``trainer.fit(model, dm)``, it is used as ``datamodule=``."""
    return any(cls.__name__ in ("DataModule", "LightningDataModule") for cls in type(obj).__mro__)


def defines_loader(datamodule: Any, stage: str) -> bool:
    """Whether ``datamodule`` has its own loader method for ``stage``."""
    method = getattr(type(datamodule), _LOADER_OF_STAGE[stage], None)
    if method is None:
        return False
    owner = getattr(method, "__qualname__", "").split(".")[0]
    return owner not in _PLACEHOLDER_OWNERS


def loaders(datamodule: Any, stage: str, *, required: bool) -> Any:
    """``datamodule``'s loader(s) for ``stage``, or ``None`` when it has none
    and they are not ``required``."""
    name = _LOADER_OF_STAGE[stage]
    if not defines_loader(datamodule, stage):
        if required:
            raise TypeError(
                f"the datamodule {type(datamodule).__name__} defines no {name}(), which "
                f"the Trainer needs for {stage}"
            )
        return None
    return getattr(datamodule, name)()


def prepare(datamodule: Any, stage: str) -> None:
    """``prepare_data`` on process 0 (the others wait), then ``setup(stage)``."""
    if distributed.is_rank_zero() and hasattr(datamodule, "prepare_data"):
        datamodule.prepare_data()
    distributed.barrier()  # the others wait for the files
    if hasattr(datamodule, "setup"):
        datamodule.setup(stage)


def stage_loaders(stage: str, dataloaders: Any, datamodule: Any, module: Any = None) -> Any:
    """The loaders of a ``validate``/``test``/``predict`` call: given, or the
    datamodule's (not both), or, with neither, the module's own
    ``val_dataloader``/``test_dataloader``/``predict_dataloader`` where it
    defines one (as Lightning)."""
    if datamodule is None:
        if dataloaders is None and module is not None and defines_loader(module, stage):
            return loaders(module, stage, required=True)
        if dataloaders is None:
            name = _LOADER_OF_STAGE[stage]
            raise TypeError(
                f"{stage} needs dataloaders (or datamodule=..., or a module defining {name}())"
            )
        return dataloaders
    if dataloaders is not None:
        raise ValueError(f"pass either dataloaders or datamodule= to {stage}, not both")
    return loaders(datamodule, stage, required=True)


def fit_loaders(train: Any, val: Any, datamodule: Any, module: Any = None) -> tuple[Any, Any]:
    """The training and validation loaders of a ``fit`` call: given, or the
    datamodule's (not both; ``val_dataloader`` asked first, as Lightning does:
    the sanity check runs before training), or, with neither, the module's own
    ``train_dataloader``/``val_dataloader`` methods where it defines them."""
    own = module is not None and defines_loader(module, "train")
    if datamodule is None and train is None and val is None and own:
        return loaders(module, "train", required=True), loaders(
            module, "validation", required=False
        )
    if datamodule is not None:
        if train is not None or val is not None:
            raise ValueError("pass either dataloaders or datamodule= to fit, not both")
        val = loaders(datamodule, "validation", required=False)
        train = loaders(datamodule, "train", required=True)
    if train is None:
        raise TypeError("fit needs train_dataloaders (or datamodule=...)")
    return train, val
