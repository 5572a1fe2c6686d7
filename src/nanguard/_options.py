"""The options of :func:`nanguard.watch`, validated once, up front.

Every user error is an exception that names the valid values; nothing here is
an ``assert``.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal, TypedDict

import torch
from torch import nn

__all__ = ["Options", "WatchOptions", "ON_NONFINITE", "SYNC", "parse_options", "Matcher"]

#: Policies for a non-finite value.
ON_NONFINITE: Final = ("raise", "warn", "log", "skip_step")
#: When the device is asked whether the probes were finite.
SYNC: Final = ("step", "module")
#: How much is probed in a step.
MODE: Final = ("full", "sentinel")

OnNonFinite = Literal["raise", "warn", "log", "skip_step"]
Sync = Literal["step", "module"]
Mode = Literal["full", "sentinel"]
ModuleSpec = type[nn.Module] | str


class WatchOptions(TypedDict, total=False):
    """Keyword options of :func:`nanguard.watch` (see :class:`Options`)."""

    mode: Mode
    every: int
    on_nonfinite: OnNonFinite
    sync: Sync
    exclude: Iterable[ModuleSpec]
    allow_inf: Iterable[ModuleSpec]
    names: Mapping[nn.Module, str]
    max_events: int
    log_path: str | os.PathLike[str] | None
    optimizer: torch.optim.Optimizer | None
    replay: bool
    max_propagated: int
    backward: bool | Literal["replay", "probes"]
    check_params: bool | int | None
    grad_norm: bool
    grad_norm_ratio: float
    grad_norm_threshold: float | None
    param_norm_threshold: float | None
    scaler: torch.amp.GradScaler | None
    amp_max_skips: int
    amp_scale_floor: float
    overflow_fraction: float | None
    max_consecutive_skips: int


@dataclasses.dataclass(frozen=True)
class Matcher:
    """Matches modules by type (``isinstance``) or by qualified-name glob (``fnmatch``)."""

    types: tuple[type[nn.Module], ...] = ()
    patterns: tuple[str, ...] = ()

    @classmethod
    def parse(cls, option: str, specs: Any) -> Matcher:
        if isinstance(specs, (str, type)):
            specs = (specs,)
        try:
            items = tuple(specs)
        except TypeError:
            raise TypeError(
                f"{option}= takes module types (e.g. nn.Dropout) or name patterns "
                f"(e.g. 'encoder.*.dropout'), got {specs!r}"
            ) from None
        types: list[type[nn.Module]] = []
        patterns: list[str] = []
        for item in items:
            if isinstance(item, str):
                patterns.append(item)
            elif isinstance(item, type) and issubclass(item, nn.Module):
                types.append(item)
            else:
                raise TypeError(
                    f"{option}= takes module types (subclasses of torch.nn.Module) or "
                    f"name patterns (str), got {item!r}"
                )
        return cls(tuple(types), tuple(patterns))

    def __bool__(self) -> bool:
        return bool(self.types or self.patterns)

    def matches(self, module: nn.Module, name: str) -> bool:
        if self.types and isinstance(module, self.types):
            return True
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


@dataclasses.dataclass(frozen=True)
class Options:
    """All settings of a :class:`nanguard.Guard`.

    Attributes:
        mode: ``"full"`` probes every module in every step; ``"sentinel"`` probes only the
            model's outputs, the loss and the gradients (the cheapest mode; the inputs are
            kept) and replays a failing step with every module probed, for the same origin.
        every: with ``mode="full"``, probe every module only every this many steps (the
            steps between are sentinel steps).
        on_nonfinite: ``"raise"`` a :class:`nanguard.NonFiniteError`, ``"warn"`` with a
            :class:`nanguard.NonFiniteWarning`, only ``"log"``, or ``"skip_step"``: drop
            the optimizer step whose gradients or loss are non-finite (the weights keep
            the values they had) and raise after ``max_consecutive_skips`` such steps in a
            row.
        sync: ``"step"`` (default) asks the device once per step; ``"module"`` checks
            every module's output at once (one host sync per module: a debugging
            mode that raises inside the forward, at the origin).
        exclude: module types or name globs not to check (their submodules neither);
            a value created inside one is reported where it is next seen.
        allow_inf: module types or name globs that produce +/-Inf on purpose
            (attention masks): their Inf is not reported, their NaN still is.
        names: display names overriding ``named_modules()`` names.
        max_events: size of the in-memory event log (the oldest are dropped and counted).
        log_path: JSON-lines file that gets every event, flushed as it is written.
            ``{rank}`` in the path is replaced by the distributed rank.
        optimizer: its ``step()`` ends each training step.
        replay: on a failure, re-run the failing forward (and its backward) to compute
            exact statistics of the offending tensors and name the operation that made
            them (RNG and buffers are restored).
        max_propagated: how many downstream module calls of an origin are logged as
            their own (``is_origin=False``) events; the rest are only counted.
        backward: localise non-finite gradients to the module whose backward made them.
            ``True``/``"replay"`` (default): only the gradients crossing the model and the
            parameters' gradients are probed in each step; a failing step is replayed
            with every module's gradients checked. ``"probes"``: probe every module's
            gradients in every backward (costs more, needs no replay). ``False``: off.
        check_params: sweep parameters and floating buffers for NaN/Inf every this many
            steps (``True``: every 16; ``False``: never), at the end, and whenever a step
            goes non-finite: a weight corrupted in ``optimizer.step()`` makes the next
            forward non-finite where it is used, and is reported at the step it happened.
            Default: every 16 steps in the full mode; in the sentinel mode only when a
            step goes non-finite (its steps check the outputs, loss and gradients only).
        grad_norm: flag gradient-norm spikes relative to the run's recent history.
        grad_norm_ratio: a total norm this many times the recent median, and twice the
            largest of the last 10,000 steps, is a spike.
        grad_norm_threshold: also flag a total gradient norm above this value.
        param_norm_threshold: also flag any parameter's gradient norm above this value.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision run: overflows on the
            steps it skips are expected (kind ``"amp_overflow"``), a collapsing scale is not.
        amp_max_skips: consecutive skipped steps that count as a collapsing scale.
        amp_scale_floor: a scale below this counts as collapsed.
        overflow_fraction: flag a float16/bfloat16 activation whose largest magnitude
            reaches this fraction of the dtype's maximum (``None``: off).
        max_consecutive_skips: with ``"skip_step"``, raise after this many skipped
            steps in a row.
    """

    mode: Mode = "full"
    every: int = 1
    on_nonfinite: OnNonFinite = "raise"
    sync: Sync = "step"
    exclude: Matcher = Matcher()
    allow_inf: Matcher = Matcher()
    names: Mapping[nn.Module, str] = dataclasses.field(default_factory=dict)
    max_events: int = 10_000
    log_path: str | None = None
    optimizer: torch.optim.Optimizer | None = None
    # The optimizer given perturbs the weights between a step's forwards (SAM's first_step).
    perturbs: bool = False
    replay: bool = True
    max_propagated: int = 3
    backward: bool | Literal["replay", "probes"] = True
    check_params: int | None = None  # None: the mode's default (see sweep_every)
    grad_norm: bool = True
    grad_norm_ratio: float = 3.0
    grad_norm_threshold: float | None = None
    param_norm_threshold: float | None = None
    scaler: torch.amp.GradScaler | None = None
    amp_max_skips: int = 10
    amp_scale_floor: float = 1.0
    overflow_fraction: float | None = 0.5
    max_consecutive_skips: int = 5

    @property
    def sweep_every(self) -> int:
        """Steps between parameter sweeps; 0: only when a step goes non-finite."""
        if self.check_params is None:
            return 16 if self.mode == "full" else 0
        return self.check_params


#: The options a user may pass (``perturbs`` is learnt from the optimizer, not given).
_FIELDS: Final = tuple(f.name for f in dataclasses.fields(Options) if f.name != "perturbs")
_SCALER_TYPES: Final[tuple[type[torch.amp.GradScaler], ...]] = tuple(
    cls
    for cls in (getattr(torch.amp, "GradScaler", None), getattr(torch.cuda.amp, "GradScaler", None))
    if isinstance(cls, type)
)


def _choice(option: str, value: Any, valid: tuple[str, ...]) -> Any:
    if not isinstance(value, str) or value not in valid:
        listed = ", ".join(repr(v) for v in valid)
        raise ValueError(f"{option}={value!r} is not valid; choose one of {listed}")
    return value


def _positive_int(option: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option}= takes an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{option}= takes an int >= {minimum}, got {value}")
    return value


def _number(
    option: str, value: Any, *, low: float, high: float = float("inf"), optional: bool = False
) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number or None" if optional else "a number"
        raise TypeError(f"{option}= takes {kind}, got {value!r}")
    if not (low < value <= high):
        bound = f"in ({low:g}, {high:g}]" if high != float("inf") else f"> {low:g}"
        raise ValueError(f"{option}= takes a number {bound}, got {value}")
    return float(value)


def _bool(option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{option}= takes True or False, got {value!r}")
    return value


def parse_options(options: Mapping[str, Any]) -> Options:
    """Validate keyword options and build :class:`Options`.

    Raises:
        TypeError: an unknown option (the message lists the valid ones), or a value
            of the wrong type.
        ValueError: a value outside the valid choices (the message lists them).
    """
    unknown = [k for k in options if k not in _FIELDS]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, _FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"unknown option {key!r}{hint}; valid options are: {', '.join(_FIELDS)}")
    kw: dict[str, Any] = {}
    if "on_nonfinite" in options:
        kw["on_nonfinite"] = _choice("on_nonfinite", options["on_nonfinite"], ON_NONFINITE)
    if "sync" in options:
        kw["sync"] = _choice("sync", options["sync"], SYNC)
    if "mode" in options:
        kw["mode"] = _choice("mode", options["mode"], MODE)
    if "every" in options:
        kw["every"] = _positive_int("every", options["every"])
    if kw.get("mode") == "sentinel" and kw.get("sync") == "module":
        raise ValueError("sync='module' checks every module: it cannot go with mode='sentinel'")
    for name in ("exclude", "allow_inf"):
        if name in options:
            kw[name] = Matcher.parse(name, () if options[name] is None else options[name])
    if "names" in options:
        names = options["names"]
        if names is None:
            names = {}
        if not isinstance(names, Mapping) or not all(
            isinstance(m, nn.Module) and isinstance(n, str) for m, n in names.items()
        ):
            raise TypeError("names= takes a dict {module: 'display name'} of nn.Module to str")
        if "" in names.values():
            raise ValueError("names= cannot give the name '': events name the model itself so")
        given = list(names.values())
        twice = sorted({n for n in given if given.count(n) > 1})
        if twice:
            raise ValueError(
                f"names= gives {twice[0]!r} to several modules: events could not tell them apart"
            )
        kw["names"] = dict(names)
    if "max_events" in options:
        kw["max_events"] = _positive_int("max_events", options["max_events"])
    if "max_propagated" in options:
        kw["max_propagated"] = _positive_int("max_propagated", options["max_propagated"], 0)
    if "log_path" in options:
        path = options["log_path"]
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"log_path= takes a str or os.PathLike path, got {path!r}")
        kw["log_path"] = None if path is None else os.fspath(path)
    if "optimizer" in options:
        opt = options["optimizer"]
        if opt is not None and not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer= takes a torch.optim.Optimizer, got {type(opt).__name__}")
        kw["optimizer"] = _stepping_optimizer(opt)
        kw["perturbs"] = callable(getattr(opt, "first_step", None))
    for name in ("replay", "grad_norm"):
        if name in options:
            kw[name] = _bool(name, options[name])
    if options.get("check_params") is not None:  # None: the mode's default
        value = options["check_params"]
        if value is True:
            value = 16
        elif value is False:
            value = 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise (ValueError if isinstance(value, int) else TypeError)(
                "check_params= takes True (every 16 steps), False or 0 (never), None (the "
                f"mode's default) or a number of steps >= 1, got {value!r}"
            )
        kw["check_params"] = value
    if "backward" in options:
        backward = options["backward"]
        if backward == "replay":
            backward = True
        if not isinstance(backward, bool) and backward != "probes":
            raise ValueError(
                f"backward={backward!r} is not valid; choose one of True, False, 'replay', 'probes'"
            )
        kw["backward"] = backward
    if "grad_norm_ratio" in options:
        kw["grad_norm_ratio"] = _number("grad_norm_ratio", options["grad_norm_ratio"], low=1.0)
    for name in ("grad_norm_threshold", "param_norm_threshold"):
        if name in options:
            kw[name] = _number(name, options[name], low=0.0, optional=True)
    if "overflow_fraction" in options:
        kw["overflow_fraction"] = _number(
            "overflow_fraction", options["overflow_fraction"], low=0.0, high=1.0, optional=True
        )
    if "amp_scale_floor" in options:
        kw["amp_scale_floor"] = _number("amp_scale_floor", options["amp_scale_floor"], low=0.0)
    for name in ("amp_max_skips", "max_consecutive_skips"):
        if name in options:
            kw[name] = _positive_int(name, options[name])
    if "scaler" in options:
        scaler = options["scaler"]
        if scaler is not None and not isinstance(scaler, _SCALER_TYPES):
            raise TypeError(f"scaler= takes a torch.amp.GradScaler, got {type(scaler).__name__}")
        kw["scaler"] = scaler
    if kw.get("mode") == "sentinel" and kw.get("every", 1) != 1:
        raise ValueError(
            "every= applies to mode='full' (every N-th step fully probed, sentinel steps "
            "between); mode='sentinel' probes only the model's outputs in every step"
        )
    parsed = Options(**kw)
    from nanguard._recording import user_stacklevel  # (imports this module)

    if (
        parsed.on_nonfinite == "skip_step"
        and parsed.backward is False
        and not parsed.grad_norm
        and parsed.grad_norm_threshold is None
        and parsed.param_norm_threshold is None
    ):
        warnings.warn(
            "nanguard: on_nonfinite='skip_step' with backward=False and "
            "grad_norm=False reads no gradient: an update with non-finite gradients (a NaN a "
            "backward made from a finite loss) is applied, and found only in the weights "
            "afterwards. Keep grad_norm=True (one norm a step) to skip it.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return parsed


#: Where optimizer wrappers keep the optimizer they wrap (SAM, timm's and lonePatient's
#: Lookahead, apex-style wrappers).
_WRAPPED_OPTIMIZER: Final = ("base_optimizer", "_base_optimizer", "optimizer", "_optimizer")


def _stepping_optimizer(opt: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step()`` moves the weights: a wrapper sharing its
    ``param_groups`` with the optimizer it wraps (SAM's ``base_optimizer``, Lookahead's)
    steps that one, and its own ``step()`` may never run (``first_step()``/``second_step()``
    called by hand) or take no step hooks (a subclass that never ran
    ``Optimizer.__init__``)."""
    if opt is None:
        return None
    for name in _WRAPPED_OPTIMIZER:
        base = getattr(opt, name, None)
        if (
            isinstance(base, torch.optim.Optimizer)
            and base is not opt
            and base.param_groups is opt.param_groups
            and hasattr(base, "_optimizer_step_pre_hooks")
        ):
            return base
    if not hasattr(opt, "_optimizer_step_pre_hooks"):
        raise TypeError(
            f"optimizer= got a {type(opt).__name__} that never ran torch.optim.Optimizer."
            "__init__, so it takes no step hooks: pass the optimizer it wraps (its step() "
            "ends nanguard's steps), or call guard.step() before its step()"
        )
    return opt
