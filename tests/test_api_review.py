"""The API where a user's slip used to go unnoticed: option patterns that match nothing,
ambiguous display names, and reading back a log a killed or multi-rank run wrote."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class _LeftToRightHMM(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emit = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.trans = _LeftToRightHMM()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trans(self.emit(x))


@pytest.mark.parametrize("option", ["exclude", "allow_inf"])
def test_a_pattern_matching_no_module_is_warned_about(option: str) -> None:
    model = _Tagger()
    with pytest.warns(UserWarning, match="pattern '_LeftToRightHMM' matches no module") as caught:
        nanguard.Guard(model, **{option: ["_LeftToRightHMM"]})  # type: ignore[arg-type]
    assert "pass the class itself" in str(caught[0].message)


def test_patterns_and_types_that_match_are_silent() -> None:
    model = _Tagger()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nanguard.Guard(model, exclude=["emit.*", _LeftToRightHMM], allow_inf=["trans"])


def test_none_for_a_tuple_option_means_none() -> None:
    guard = nanguard.Guard(_Tagger(), exclude=None, allow_inf=None)  # type: ignore[arg-type]
    assert not guard.options.exclude
    assert not guard.options.allow_inf


def test_display_names_must_tell_modules_apart() -> None:
    model = _Tagger()
    with pytest.raises(ValueError, match="cannot give the name ''"):
        nanguard.Guard(model, names={model.emit[0]: ""})
    with pytest.raises(ValueError, match="gives 'proj' to several modules"):
        nanguard.Guard(model, names={model.emit[0]: "proj", model.emit[2]: "proj"})


def _log_two_events(path: str) -> list[nanguard.Event]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with nanguard.watch(model, on_nonfinite="log", log_path=path) as guard:
        for step in range(2):
            x = torch.randn(16, 4)
            x[step, 1] = float("nan")
            model(x).sum().backward()
            guard.step()
    return guard.events


def test_read_events_takes_the_rank_template(tmp_path: Path) -> None:
    template = str(tmp_path / "nan_events.{rank}.jsonl")
    events = _log_two_events(template)
    assert (tmp_path / "nan_events.0.jsonl").exists()
    assert nanguard.read_events(template) == events
    with pytest.raises(FileNotFoundError, match=r"no file matches .*other\.\{rank\}\.jsonl"):
        nanguard.read_events(str(tmp_path / "other.{rank}.jsonl"))


def test_read_events_keeps_what_came_before_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = _log_two_events(str(path))
    text = path.read_text()
    path.write_text(text[: len(text) - 40])  # the job was killed while writing the last line
    with pytest.warns(RuntimeWarning, match=rf"events\.jsonl, line {len(events)}: cut short"):
        read = nanguard.read_events(path)
    assert read == events[:-1]


def test_read_events_names_the_file_and_line_of_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = _log_two_events(str(path))
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + json.dumps({"step": 1}) + "\n" + lines[1])
    with pytest.raises(ValueError, match=r"events\.jsonl, line 2: not an event"):
        nanguard.read_events(path)
    assert len(events) > 2


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_validation_loop_with_gradients_on_is_resolved_as_it_goes(mode: str) -> None:
    """model.eval() without torch.no_grad(): its forwards get no backward. They are not kept
    until the next optimizer step (a long loop's records fragmented the heap), and a NaN batch
    among them raises within the loop, naming the batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    batches = [torch.randn(16, 32) for _ in range(200)]
    batches[150][3, 7] = float("nan")  # a corrupt validation sample
    seen = 0

    def validate() -> None:
        nonlocal seen
        model.eval()
        for x in batches:  # forgot torch.no_grad()
            model(x).argmax(1)
            seen += 1
            assert len(guard._recorder.pending()) <= 32

    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        loss = model(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with pytest.raises(nanguard.NonFiniteError, match="the input batch already contains NaN"):
            validate()
    assert 151 <= seen <= 151 + 32
    assert guard.origin is not None
    assert guard.origin.phase == "input"


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("before_first_step", [False, True])
def test_a_checkpoint_loaded_while_watched_is_named_as_the_weights_source(
    before_first_step: bool, assign: bool
) -> None:
    """Resuming from a checkpoint saved after a NaN update, with the guard already watching:
    the weight is the checkpoint's, not made by optimizer.step() or the forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint["2.weight"][1, 5] = float("nan")
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(4):
            if step == (0 if before_first_step else 3):
                model.load_state_dict(checkpoint, assign=assign)  # (assign: new tensors)
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "2.weight")
    assert origin.step == (0 if before_first_step else 3)
    assert origin.details["reason"] == "loaded_checkpoint"
    assert "since load_state_dict() loaded it" in origin.message
    assert "optimizer.step()" not in origin.message
    assert origin.hint is not None
    assert "earlier checkpoint" in origin.hint
    assert [e.param for e in guard.events if e.is_origin] == ["2.weight"]


def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_running_statistics_loaded_non_finite_are_named_as_the_checkpoints(mode: str) -> None:
    """A checkpoint saved after a NaN batch poisoned BatchNorm's running_var, loaded while
    watched: evaluation goes NaN. The buffer is the checkpoint's, not a batch of this run."""
    torch.manual_seed(0)
    source = _small_cnn()
    checkpoint = {k: v.clone() for k, v in source.state_dict().items()}
    checkpoint["1.running_var"][5] = float("nan")
    model = _small_cnn()
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(5):
            if step == 3:
                model.load_state_dict(checkpoint)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            assert not torch.isfinite(model(x)).all()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.param) == ("param", "1", "1.running_var")
    assert origin.details == {"buffer": True, "reason": "loaded_checkpoint"}
    assert origin.step == 3
    assert "buffer `1.running_var` (BatchNorm2d) is NaN since load_state_dict() loaded it" in (
        origin.message
    )
    assert "a batch with non-finite activations" not in origin.message
    assert origin.hint is not None
    assert "reset_running_stats()" in origin.hint
    assert [e.param for e in guard.events if e.is_origin] == ["1.running_var"]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_checkpoint_loaded_into_a_submodule_is_named(mode: str) -> None:
    """Pretrained weights loaded into the backbone (model.backbone.load_state_dict), not
    the whole model: the NaN weight is still the checkpoint's."""

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
            self.head = nn.Linear(64, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(x))

    torch.manual_seed(0)
    model = Classifier()
    pretrained = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    pretrained["2.weight"][7, 3] = float("inf")
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(4):
            if step == 2:
                model.backbone.load_state_dict(pretrained)
            loss = nn.functional.cross_entropy(
                model(torch.randn(16, 32)), torch.randint(0, 5, (16,))
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param, origin.kind) == ("param", "backbone.2.weight", "inf")
    assert origin.details["reason"] == "loaded_checkpoint"
    assert origin.step == 2
    assert "parameter `backbone.2.weight` (Linear) is +Inf since load_state_dict()" in (
        origin.message
    )


@pytest.mark.parametrize("through", ["DataParallel", "container"])
def test_a_checkpoint_loaded_through_what_holds_the_model_is_named(through: str) -> None:
    """The watched model loaded by its holder (nn.DataParallel, a wrapper's ModuleDict):
    its keys carry a prefix ("module.", "net."), and the load is still seen."""
    torch.manual_seed(0)
    model = _small_cnn()
    holder = nn.DataParallel(model) if through == "DataParallel" else nn.ModuleDict({"net": model})
    checkpoint = {k: v.clone() for k, v in holder.state_dict().items()}
    key = next(k for k in checkpoint if k.endswith("1.running_var"))
    checkpoint[key][2] = float("nan")
    opt = torch.optim.SGD(model.parameters(), 0.05)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(3):
            if step == 1:
                holder.load_state_dict(checkpoint)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.param, origin.step) == ("1.running_var", 1)
    assert origin.details["reason"] == "loaded_checkpoint"


def test_a_partial_rollback_does_not_blame_the_checkpoint_for_what_it_did_not_load() -> None:
    """A corrupt sample's forward wrote NaN into BatchNorm's running statistics; the loop
    rolls the parameters back (strict=False, no buffers in that checkpoint). The statistics
    are the batch's doing, not the checkpoint's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    params_only = {k: v.clone() for k, v in model.named_parameters()}
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(4):
            x = torch.randn(32, 10)
            if step == 2:
                x[5, 3] = float("nan")  # a corrupt sample
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 2:
                model.load_state_dict(params_only, strict=False)  # roll the weights back
    assert not any(e.details.get("reason") == "loaded_checkpoint" for e in guard.events)
    assert guard.origin is not None
    assert (guard.origin.step, guard.origin.phase) == (2, "input")


def test_a_corrupt_checkpoint_replaced_by_a_good_one_is_not_blamed_later() -> None:
    """latest.pt holds NaN; the loop sees it and loads previous.pt instead. A divergence
    steps later (a learning rate of 1e38) is not that checkpoint's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    latest = {k: v.clone() for k, v in good.items()}
    latest["2.weight"][0, 0] = float("nan")
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(6):
            if step == 1:
                model.load_state_dict(latest)
                model.load_state_dict(good)  # (latest was corrupt: the one before)
            if step == 4:
                opt.param_groups[0]["lr"] = 1e38  # a broken schedule
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.origin is not None
    assert guard.origin.step >= 4
    assert not any("since load_state_dict() loaded it" in e.message for e in guard.events)


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(100, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU())
        self.lm_head = nn.Linear(32, 100, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, GPT-2 style

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.wte(ids)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_tied_weight_loaded_under_its_second_name_is_the_checkpoints(mode: str) -> None:
    """safetensors keeps one name per shared tensor (lm_head.weight), loaded with
    strict=False: what the load wrote is what changed, whatever name it came under."""
    torch.manual_seed(0)
    model = _TiedLM()
    saved = {k: v.clone() for k, v in _TiedLM().state_dict().items() if k != "wte.weight"}
    saved["lm_head.weight"][3, :4] = float("nan")
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(4):
            if step == 2:
                model.load_state_dict(saved, strict=False)
            ids = torch.randint(0, 100, (4, 16))
            loss = F.cross_entropy(model(ids).view(-1, 100), ids.view(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (2, "param")
    assert origin.details["reason"] == "loaded_checkpoint"


def test_keys_a_model_renames_as_it_loads_are_the_checkpoints() -> None:
    """A model that maps its old checkpoints' keys (fc -> classifier) in
    _load_from_state_dict: the weights it wrote are still the checkpoint's."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.classifier = nn.Linear(16, 4)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.classifier(h)  # type: ignore[no-any-return]

        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
            for name in ("weight", "bias"):
                old = f"{prefix}fc.{name}"
                if old in state_dict:
                    state_dict[f"{prefix}classifier.{name}"] = state_dict.pop(old)
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Head())
    old = {"0.weight": model[0].weight.clone(), "0.bias": model[0].bias.clone()}
    old["2.fc.weight"] = torch.full((4, 16), float("nan"))
    old["2.fc.bias"] = torch.zeros(4)
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(3):
            if step == 1:
                model.load_state_dict(old)
            loss = model(torch.randn(8, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.param) == (1, "2.classifier.weight")
    assert origin.details["reason"] == "loaded_checkpoint"


def test_a_copy_of_a_watched_model_loads_without_the_guard() -> None:
    import copy

    model = nn.Sequential(nn.Linear(4, 4))
    with nanguard.watch(model) as guard:
        twin = copy.deepcopy(model)
        state = {k: torch.full_like(v, float("nan")) for k, v in model.state_dict().items()}
        twin.load_state_dict(state)  # not the watched model: nothing to tell
        guard.step()
        twin(torch.randn(2, 4))  # (its first forward sheds the inert hooks)
    assert guard.events == []
    for module in twin.modules():
        assert not module._load_state_dict_pre_hooks
        assert not module._load_state_dict_post_hooks


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("zero_in_except", [False, True])
def test_a_caught_raise_before_zero_grad_is_told_as_gradients_left_over(
    mode: str, zero_in_except: bool
) -> None:
    """backward(); step(); zero_grad(): the caught NonFiniteError skips zero_grad(), and the
    next steps add finite gradients to the NaN ones. No new origin (no hook, DDP or clipping
    changed .grad): the step that left them is named, and how to fix the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    raised: list[nanguard.NonFiniteError] = []
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for step in range(4):
            x = torch.randn(16, 6)
            if step == 1:
                x[0, 0] = float("nan")
            nn.functional.mse_loss(model(x), torch.randn(16, 1)).backward()
            try:
                opt.step()
            except nanguard.NonFiniteError as err:
                raised.append(err)
                if zero_in_except:
                    opt.zero_grad()
                continue
            opt.zero_grad()
    assert [(e.step, e.phase) for e in guard.events if e.is_origin] == [(1, "input")]
    if zero_in_except:
        assert len(raised) == 1
        return
    assert len(raised) == 3
    for err in raised[1:]:
        event = err.event
        assert not event.is_origin
        assert event.details["reason"] == "not_zeroed"
        assert event.details["origin_step"] == 1
        assert "still hold the NaN of step 1" in event.message
        assert "zero the gradients in the except block" in event.message


def test_a_nan_validation_batch_says_it_was_an_inference_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            val = torch.randn(32, 4)
            val[17, 2] = float("nan")
            model(val)
        model.train()
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "input"
    assert origin.details["inference"] is True
    assert "an evaluation or validation batch, not a training one" in origin.message
    training = [e for e in guard.events if e.is_origin and "inference" in e.details]
    assert training == [origin]


def test_a_copy_of_a_watched_model_sheds_every_nanguard_hook_at_its_first_forward() -> None:
    """An EMA copy (timm's ModelEMA deep-copies the model being trained): after its first
    forward it holds no hook of nanguard's, load hooks included, so its pickle (a checkpoint)
    loads where nanguard is not installed."""
    import copy
    import pickle

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with nanguard.watch(model):
        ema = copy.deepcopy(model)
        ema(torch.randn(2, 4))
        assert b"nanguard" not in pickle.dumps(ema)
        for module in ema.modules():
            assert not module._load_state_dict_post_hooks


def test_an_eval_mode_rollout_waits_for_its_step() -> None:
    """A dynamics model unrolled 48 times in eval() (dropout off for fine-tuning), one loss and
    one backward at the end: its forwards keep their outputs for the loss, so they wait for
    the step (raised at opt.step(), not in the middle of the rollout)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 4))
    model.eval()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    actions = torch.randn(48, 16, 2) * 0.01
    actions[10, 4, 1] = float("nan")
    state = torch.zeros(16, 4)
    with nanguard.watch(model, optimizer=opt) as guard:
        states = []
        for t in range(48):
            state = state + model(torch.cat([state, actions[t]], -1))  # no NaN raised here
            states.append(state)
        loss = torch.stack(states).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError, match="the input batch already contains NaN"):
            opt.step()
    assert guard.origin is not None
    assert guard.origin.details.get("forward") == 11


def test_a_log_path_that_cannot_be_opened_is_named_in_the_error(tmp_path: Path) -> None:
    """A file where the log's directory should be: the error says it is log_path=."""
    (tmp_path / "runs").write_text("not a directory")
    model = nn.Linear(2, 2)
    with pytest.raises(OSError, match=r"log_path=.*cannot be opened for appending"):
        nanguard.watch(model, log_path=str(tmp_path / "runs" / "nan.jsonl"))
    assert not model._forward_hooks  # (nothing left attached)


@pytest.mark.parametrize(
    ("value", "error"), [("16", TypeError), (-1, ValueError), (1.5, TypeError)]
)
def test_a_bad_check_params_names_every_valid_value(value: object, error: type) -> None:
    with pytest.raises(error, match=r"True \(every 16 steps\), False or 0 \(never\), None"):
        nanguard.watch(nn.Linear(2, 2), check_params=value)
