"""nanguard under torch.distributed: DistributedDataParallel on CPU (gloo), two ranks.

Every scenario runs in two freshly spawned processes that train the same small model
under DDP with a guard on each rank. A worker writes what its guard saw (events as
dicts, the NonFiniteError it stopped on, a checksum of its weights) to a JSON file in
``tmp_path``; the test reads both files. Processes are daemons, the process group has a
short timeout, each worker arms a faulthandler watchdog that kills it, and the parent
kills whatever is still alive when it gives up: nothing outlives a test, even a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import math
import multiprocessing
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import nanguard

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)

WORLD = 2
BAD_RANK = 1  # the only rank whose batch goes bad
BAD_STEP = 2
JOIN_TIMEOUT_S = 180.0  # the parent's limit for a whole scenario: spawning and importing
# torch can take a minute on a loaded machine; a worker that hangs is ended by its watchdog
WATCHDOG_S = 45.0  # a worker dumps its stack and exits after this long
PG_TIMEOUT = datetime.timedelta(seconds=20)  # a collective nobody answers fails


# --------------------------------------------------------------------------- the model
class LogLayer(nn.Module):
    """Where a negative input turns into NaN."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


class Net(nn.Module):
    """``fc2(log(sigmoid(norm(fc1(x))) + x[:, :1]))``: finite while ``x[:, 0] > 0``."""

    def __init__(self, batchnorm: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.log = LogLayer()
        self.fc2 = nn.Linear(16, 1)
        # Never called: needs DDP(find_unused_parameters=True).
        self.unused = nn.Linear(16, 1) if unused else None

    def forward(self, x: Tensor) -> Tensor:
        h = torch.sigmoid(self.norm(self.fc1(x)))
        return self.fc2(self.log(h + x[:, :1]))


class GatherNet(Net):
    """Net whose forward also mixes in every rank's features (an all_gather, as MoCo's key
    queue and losses over gathered embeddings computed inside the model do)."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.log(torch.sigmoid(self.norm(self.fc1(x))) + x[:, :1])
        everyone = torch.cat(torch.distributed.nn.all_gather(h))  # (differentiable)
        return self.fc2(h) + everyone.mean()


class Sqrt(nn.Module):
    """Finite at 0, with an infinite derivative there: an Inf made in the backward."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(x)


class SqrtNet(Net):
    """``fc2(sqrt(sigmoid(fc1(x)) * x[:, :1]))``: a sample with ``x[:, 0] == 0`` makes Inf
    in the backward only."""

    def __init__(self, batchnorm: bool = False, unused: bool = False) -> None:
        super().__init__(batchnorm, unused)
        self.sq = Sqrt()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.sq(torch.sigmoid(self.norm(self.fc1(x))) * x[:, :1]))


def _batch(
    gen: torch.Generator, rank: int, step: int, bad: str | None, bad_steps: Any = (BAD_STEP,)
) -> tuple[Tensor, Tensor]:
    x = torch.rand(4, 8, generator=gen) + 0.5  # x[:, 0] >= 0.5: log's input is positive
    y = torch.randn(4, 1, generator=gen)
    if rank == BAD_RANK and step in bad_steps:
        if bad == "input_nan":
            x[0, 3] = float("nan")  # the data pipeline delivers a NaN
        elif bad == "log_neg":
            x[0, 0] = -5.0  # finite, but log() of the sum is NaN for row 0
        elif bad == "zero":
            x[0, 0] = 0.0  # sqrt(0): finite, its gradient is not
    return x, y


# ------------------------------------------------------------------------- the worker
def _worker(rank: int, init_method: str, out: str, cfg: dict[str, Any]) -> None:
    """One rank: train under DDP with a guard; write what happened to ``out``."""
    watchdog = open(os.path.join(out, f"stack.{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=watchdog)
    result: dict[str, Any] = {"rank": rank, "error": None, "stopped": None}
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        kind = GatherNet if cfg.get("gather") else SqrtNet if cfg.get("sqrt") else Net
        model = kind(batchnorm=cfg.get("batchnorm", False), unused=cfg.get("unused", False))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        log_path = os.path.join(out, "events.{rank}.jsonl")
        options: dict[str, Any] = {
            "on_nonfinite": cfg["policy"],
            "log_path": log_path,
            "mode": cfg.get("mode", "full"),
        }
        if cfg.get("backward") is not None:
            options["backward"] = cfg["backward"]
        if cfg.get("exclude"):
            options["exclude"] = cfg["exclude"]
        scaler = torch.amp.GradScaler("cpu") if cfg.get("scaler") else None
        if scaler is not None:
            options["scaler"] = scaler
            options["max_consecutive_skips"] = cfg.get("max_skips", 10)
        if cfg.get("early"):  # watched before the process group exists (no rank known yet)
            guard = nanguard.watch(model, optimizer=opt, **options)
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=PG_TIMEOUT
        )
        if cfg.get("before_ddp"):  # watched with the group up, before DDP wraps the model
            guard = nanguard.watch(model, optimizer=opt, **options)
        if cfg.get("fsdp1"):  # FSDP1, its default flat parameter (use_orig_params=False)
            from torch.distributed.fsdp import FullyShardedDataParallel

            ddp = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        elif cfg.get("fsdp"):  # FSDP2: each layer and the model sharded across the ranks
            from torch.distributed.fsdp import fully_shard

            for layer in (model.fc1, model.fc2):
                fully_shard(layer)
            ddp = fully_shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)  # (of the sharded parameters)
        else:
            ddp = nn.parallel.DistributedDataParallel(model, **cfg.get("ddp", {}))
            if cfg.get("fp16_hook"):  # gradients all-reduced in float16
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        if not cfg.get("early") and not cfg.get("before_ddp"):
            watched = ddp.module if cfg.get("inner") else ddp
            ends = None if cfg.get("guard_step") else opt  # (guard.step() ends the steps)
            guard = nanguard.watch(watched, optimizer=ends, **options)
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        steps = cfg.get("steps", 5)
        join = contextlib.nullcontext()
        if cfg.get("join"):  # uneven inputs: the bad rank has one batch more, its last
            from torch.distributed.algorithms.join import Join

            join = Join([ddp])
            steps += rank == BAD_RANK
        with guard, join:
            for step in range(steps):
                x, y = _batch(gen, rank, step, cfg.get("bad"), cfg.get("bad_steps", (BAD_STEP,)))
                try:
                    with torch.autocast("cpu", torch.bfloat16, enabled=scaler is not None):
                        pred = ddp(x)
                        loss = nn.functional.mse_loss(pred.float(), y)
                    if cfg.get("gather_loss"):  # a term over every rank's outputs
                        loss = loss + torch.cat(torch.distributed.nn.all_gather(pred)).var()
                    if cfg.get("loss_scale") and step == BAD_STEP:  # finite, huge gradients
                        loss = loss * cfg["loss_scale"]
                    if cfg.get("loss_term"):  # per-sample weights from the data pipeline
                        weights = torch.ones(4, 1)
                        if rank == BAD_RANK and step in cfg.get("bad_steps", (BAD_STEP,)):
                            weights[0] = float("inf")  # the loss is Inf, its gradient is not
                        loss = loss + (weights - 1).sum()
                    loss = guard.check_loss(loss)
                    opt.zero_grad()
                    if scaler is not None:
                        scaler.scale(loss).backward()
                        scaler.step(opt)
                        scaler.update()
                    else:
                        loss.backward()
                        if cfg.get("guard_step"):
                            guard.step()
                        opt.step()
                except nanguard.NonFiniteError as err:
                    result["stopped"] = {"step": step, "event": err.event.to_dict()}
                    break
            result["current_step"] = guard.current_step
        result["events"] = [e.to_dict() for e in guard.events]
        result["params_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        result["checksum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
        dist.barrier()  # every rank got here: nobody is left waiting in a collective
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(out, f"result.{rank}.json"), "w", encoding="utf-8") as fh:
            json.dump(result, fh)
        if dist.is_initialized():
            dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------------- the parent
class RankResult:
    def __init__(self, data: dict[str, Any]) -> None:
        self.rank: int = data["rank"]
        self.events = [nanguard.Event.from_dict(e) for e in data["events"]]
        self.stopped = data["stopped"]
        self.stopped_event = (
            nanguard.Event.from_dict(self.stopped["event"]) if self.stopped else None
        )
        self.current_step: int = data["current_step"]
        self.params_finite: bool = data["params_finite"]
        self.checksum: float = data["checksum"]

    @property
    def origins(self) -> list[nanguard.Event]:
        return [e for e in self.events if e.is_origin]

    def at(self, step: int) -> list[nanguard.Event]:
        return [e for e in self.events if e.step == step]


def run_ranks(out: Path, **cfg: Any) -> list[RankResult]:
    """Run the scenario ``cfg`` on ``WORLD`` spawned ranks; fail on a hang or a crash."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    init_method = (out / "store").as_uri()
    procs = [
        ctx.Process(target=_worker, args=(rank, init_method, str(out), cfg), daemon=True)
        for rank in range(WORLD)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    stacks = {
        rank: (out / f"stack.{rank}.txt").read_text()
        for rank in range(WORLD)
        if (out / f"stack.{rank}.txt").exists()
    }
    if hung:
        pytest.fail(f"ranks {hung} hung in {cfg}; stacks: {stacks}")
    results = []
    for rank in range(WORLD):
        path = out / f"result.{rank}.json"
        if not path.exists():
            pytest.fail(f"rank {rank} died without a result in {cfg}; stack: {stacks.get(rank)}")
        data = json.loads(path.read_text())
        if data["error"] is not None:
            pytest.fail(f"rank {rank} failed in {cfg}:\n{data['error']}")
        results.append(RankResult(data))
    return results


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param({}, id="plain"),
        pytest.param(
            {"batchnorm": True, "ddp": {"gradient_as_bucket_view": True}},
            id="batchnorm-bucket-view",
        ),
        pytest.param({"unused": True, "ddp": {"find_unused_parameters": True}}, id="find-unused"),
    ],
)
def test_healthy_ddp_training_reports_nothing(tmp_path: Path, cfg: dict[str, Any]) -> None:
    ranks = run_ranks(tmp_path, policy="raise", steps=20, **cfg)
    for r in ranks:
        assert r.events == [], [str(e) for e in r.events]
        assert r.stopped is None
        assert r.current_step == 20  # the optimizer's step counted every step
        assert r.params_finite
    # DDP kept the replicas identical; nanguard changed nothing.
    assert math.isclose(ranks[0].checksum, ranks[1].checksum, rel_tol=1e-6)
    for rank in range(WORLD):  # {rank} in log_path: a file per rank, empty when healthy
        assert nanguard.read_events(tmp_path / f"events.{rank}.jsonl") == []


@pytest.fixture(scope="module")
def nan_on_rank1(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[RankResult]]:
    """Rank 1's batch makes ``log`` see a negative value at step 2; policy "log"."""
    out = tmp_path_factory.mktemp("nan_on_rank1")
    return out, run_ranks(out, policy="log", bad="log_neg", steps=4)


def test_rank1_names_the_module_that_created_the_nan(
    nan_on_rank1: tuple[Path, list[RankResult]],
) -> None:
    _, ranks = nan_on_rank1
    first = ranks[BAD_RANK].origins[0]
    assert (first.step, first.phase, first.kind) == (BAD_STEP, "forward", "nan")
    assert (first.module, first.module_type, first.tensor) == ("module.log", "LogLayer", "output")
    assert first.rank == BAD_RANK
    assert first.stats is not None
    assert first.stats.nan_count == 16  # one row of 16 features
    assert "module.log" in first.message
    assert ranks[BAD_RANK].at(BAD_STEP - 1) == []


def test_rank0_sees_the_nan_only_in_its_gradients(
    nan_on_rank1: tuple[Path, list[RankResult]],
) -> None:
    """Rank 0's forward and loss were finite; the NaN reached it through the gradient
    all-reduce, at the same step: it must not blame its forward, its input or the loss."""
    _, ranks = nan_on_rank1
    rank0 = ranks[0]
    assert rank0.at(BAD_STEP - 1) == []
    seen = rank0.at(BAD_STEP)
    assert seen, "rank 0 did not notice the NaN gradients"
    assert {e.phase for e in seen} <= {"backward", "grad", "param"}
    assert all(e.kind == "nan" and e.rank == 0 for e in seen)
    assert not any(e.module == "module.log" for e in seen)
    # DDP all-reduced the NaN into every parameter's gradient on rank 0 too: one event
    # says so, and it is not an origin (rank 1 made it).
    assert not any(e.is_origin for e in rank0.events)
    allreduce = [e for e in seen if e.details.get("reason") == "allreduce"]
    assert len(allreduce) == 1
    event = allreduce[0]
    assert (event.phase, event.kind) == ("grad", "nan")
    assert event.param is not None
    assert event.param.startswith("module.")
    assert event.details["local_gradients_finite"] is True
    assert event.details["world_size"] == WORLD
    assert event.message.startswith(f"nanguard: step {BAD_STEP} (rank 0): ")
    assert "all-reduce" in event.message
    assert "another rank" in event.message
    # Rank 1's messages say which rank speaks too.
    assert ranks[BAD_RANK].origins[0].message.startswith(f"nanguard: step {BAD_STEP} (rank 1): ")
    # Every rank tags its own events.
    for r in ranks:
        assert {e.rank for e in r.events} == {r.rank}


def test_log_path_with_rank_gives_each_rank_its_file(
    nan_on_rank1: tuple[Path, list[RankResult]],
) -> None:
    out, ranks = nan_on_rank1
    for r in ranks:
        written = nanguard.read_events(out / f"events.{r.rank}.jsonl")
        assert [e.to_dict() for e in written] == [e.to_dict() for e in r.events]
        assert {e.rank for e in written} == {r.rank}
    from_rank1 = nanguard.read_events(out / f"events.{BAD_RANK}.jsonl")
    assert any(e.is_origin and e.module == "module.log" for e in from_rank1)
    from_rank0 = nanguard.read_events(out / "events.0.jsonl")
    assert not any(e.module == "module.log" for e in from_rank0 if e.step == BAD_STEP)
    assert not (out / "events.{rank}.jsonl").exists()


def test_input_nan_on_rank1_is_an_input_origin_of_the_ddp_wrapper(tmp_path: Path) -> None:
    ranks = run_ranks(tmp_path, policy="log", bad="input_nan", steps=3)
    first = ranks[BAD_RANK].origins[0]
    assert (first.step, first.phase, first.module, first.tensor) == (
        BAD_STEP,
        "input",
        "",
        "args[0]",
    )
    assert first.module_type == "DistributedDataParallel"
    assert first.rank == BAD_RANK
    assert first.stats is not None
    assert first.stats.nan_count == 1
    assert {e.phase for e in ranks[0].at(BAD_STEP)} <= {"backward", "grad", "param"}
    assert not any(e.phase == "input" for e in ranks[0].events)


def test_guarding_the_inner_module_drops_the_module_prefix(tmp_path: Path) -> None:
    """``watch(ddp.module)``: names as the user's model has them, ``fc1`` not
    ``module.fc1``. With BatchNorm (DDP broadcasts its buffers in every forward of the
    wrapper) the replay of the inner module runs no collective: no hang."""
    ranks = run_ranks(tmp_path, policy="log", bad="log_neg", steps=4, inner=True, batchnorm=True)
    first = ranks[BAD_RANK].origins[0]
    assert (first.step, first.phase, first.module, first.module_type) == (
        BAD_STEP,
        "forward",
        "log",
        "LogLayer",
    )
    assert first.rank == BAD_RANK
    for r in ranks:
        named = {e.module for e in r.events if e.module} | {e.param for e in r.events if e.param}
        assert named
        assert not any(name.startswith("module.") for name in named), named
    grads = {e.param for e in ranks[0].at(BAD_STEP) if e.phase == "grad"}
    assert grads
    assert grads <= {f"{m}.{p}" for m in ("fc1", "norm", "fc2") for p in ("weight", "bias")}


def test_raise_stops_every_rank_before_the_weights_change(tmp_path: Path) -> None:
    """The gradient all-reduce spreads the NaN to every rank before optimizer.step(), so
    every rank raises in the same step: nobody is left waiting in a collective."""
    ranks = run_ranks(tmp_path, policy="raise", bad="input_nan", steps=5)
    for r in ranks:
        assert r.stopped is not None
        assert r.stopped["step"] == BAD_STEP
        assert r.params_finite  # raised in the step pre-hook: the weights never saw the NaN
        assert r.current_step == BAD_STEP + 1
        assert r.stopped_event is not None
        assert r.stopped_event.rank == r.rank
    stopped = ranks[BAD_RANK].stopped_event
    assert stopped is not None
    assert (stopped.phase, stopped.module) == ("input", "")
    # Rank 0 stops on the NaN the all-reduce brought it, not on an origin of its own.
    on_rank0 = ranks[0].stopped_event
    assert on_rank0 is not None
    assert not on_rank0.is_origin
    assert on_rank0.details["reason"] == "allreduce"
    assert "that rank reports the origin (in its own log, " in on_rank0.message  # (its log_path)
    assert math.isclose(ranks[0].checksum, ranks[1].checksum, rel_tol=1e-6)


def test_skip_step_skips_the_same_step_on_every_rank(tmp_path: Path) -> None:
    """With gradient_as_bucket_view=True the gradients are views of DDP's buckets:
    skip_step sets them to None, and the next backward rebuilds them."""
    ranks = run_ranks(
        tmp_path,
        policy="skip_step",
        bad="input_nan",
        steps=6,
        ddp={"gradient_as_bucket_view": True},
    )
    for r in ranks:
        skipped = [e for e in r.events if e.details.get("skipped")]
        assert [e.step for e in skipped] == [BAD_STEP]
        assert r.params_finite
        assert r.stopped is None
        assert r.current_step == 6
        # Training went on cleanly after the skipped step.
        assert all(e.step == BAD_STEP for e in r.events)
    assert math.isclose(ranks[0].checksum, ranks[1].checksum, rel_tol=1e-6)


def test_raise_for_a_loss_only_one_rank_saw_stops_every_rank(tmp_path: Path) -> None:
    """The bad rank's loss is Inf and its gradients are finite: it raises, and the other
    rank, whose all-reduced gradients are finite, must stop in the same step too, or it
    waits for it in the next all-reduce (or, the error caught, the replicas diverge)."""
    ranks = run_ranks(tmp_path, policy="raise", loss_term=True, steps=4)
    for r in ranks:
        assert r.stopped is not None
        assert r.stopped["step"] == BAD_STEP
        assert r.params_finite
    stopped = ranks[BAD_RANK].stopped_event
    assert stopped is not None
    assert (stopped.phase, stopped.is_origin) == ("loss", True)
    on_rank0 = ranks[0].stopped_event
    assert on_rank0 is not None
    assert not on_rank0.is_origin
    assert on_rank0.details["reason"] == "other_rank"
    assert "another rank found a non-finite value in this step" in on_rank0.message
    assert ranks[0].checksum == ranks[1].checksum


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_guard_step_makes_every_rank_act_on_a_loss_only_one_rank_saw(
    tmp_path: Path, policy: str
) -> None:
    """Steps ended by guard.step() before opt.step() (no optimizer=): the ranks agree as
    they do at optimizer='s step, or the one with the Inf loss acts alone."""
    ranks = run_ranks(tmp_path, policy=policy, loss_term=True, steps=4, guard_step=True)
    for r in ranks:
        if policy == "raise":
            assert r.stopped is not None
            assert r.stopped["step"] == BAD_STEP
        else:
            assert [e.step for e in r.events if e.details.get("skipped")] == [BAD_STEP]
    assert ranks[0].checksum == ranks[1].checksum


def test_skip_step_for_a_loss_only_one_rank_saw_is_taken_on_every_rank(tmp_path: Path) -> None:
    """The bad rank's loss is Inf and its gradients are finite: the other rank's all-reduced
    gradients are finite too, yet it must skip with it, or the replicas diverge."""
    ranks = run_ranks(tmp_path, policy="skip_step", loss_term=True, steps=4)
    for r in ranks:
        skipped = [e for e in r.events if e.details.get("skipped")]
        assert [e.step for e in skipped] == [BAD_STEP]
        assert r.stopped is None
    (origin,) = ranks[BAD_RANK].origins
    assert (origin.step, origin.phase) == (BAD_STEP, "loss")
    assert ranks[0].origins == []
    (note,) = [e for e in ranks[0].events if e.details.get("skipped")]
    assert "another rank's step went non-finite" in note.message
    assert ranks[0].checksum == ranks[1].checksum


def test_a_model_watched_before_ddp_wraps_it_agrees_across_ranks(tmp_path: Path) -> None:
    """watch(model), then DDP(model): the wrapper is found after the guard was made, so a
    loss only one rank saw non-finite is still skipped on every rank (the replicas stay
    the same), not on the bad rank alone."""
    ranks = run_ranks(tmp_path, policy="skip_step", loss_term=True, steps=4, before_ddp=True)
    for r in ranks:
        skipped = [e for e in r.events if e.details.get("skipped")]
        assert [e.step for e in skipped] == [BAD_STEP]
    assert ranks[0].origins == []
    assert ranks[0].checksum == ranks[1].checksum


def test_uneven_inputs_under_join_with_a_scaler_and_skip_step_do_not_crash(
    tmp_path: Path,
) -> None:
    """The bad rank's extra batch is bad: the rank that ran out only shadows DDP's own
    collectives (Join), so nanguard adds none of its own there."""
    ranks = run_ranks(
        tmp_path, policy="skip_step", scaler=True, join=True, bad="input_nan", bad_steps=(5,)
    )
    (origin,) = ranks[BAD_RANK].origins
    assert (origin.step, origin.phase) == (5, "input")
    assert ranks[0].events == []


def test_a_float16_comm_hook_overflowing_is_named_when_no_rank_made_a_nan(
    tmp_path: Path,
) -> None:
    """Every rank's own gradients are finite (large): fp16_compress_hook's float16 sum
    overflows. No rank has an origin; each one's event names the hook as the way it came."""
    ranks = run_ranks(tmp_path, policy="log", fp16_hook=True, loss_scale=1e6, steps=3)
    for r in ranks:
        assert r.origins == []
        (event,) = [e for e in r.events if e.details.get("reason") == "allreduce"]
        assert event.step == BAD_STEP
        assert "fp16_compress_hook" in event.message


def test_exclude_names_the_users_modules_under_a_watched_ddp_wrapper(tmp_path: Path) -> None:
    """watch(ddp, exclude=("log",)): `module.log` is the user's `log`; the NaN it makes is
    then found where next seen, its parent's code."""
    ranks = run_ranks(tmp_path, policy="log", bad="log_neg", steps=3, exclude=("log",))
    first = ranks[BAD_RANK].origins[0]
    assert (first.step, first.phase, first.module) == (BAD_STEP, "forward", "module")


def test_watching_the_ddp_wrapper_with_batchnorm_does_not_hang(tmp_path: Path) -> None:
    """DDP's forward broadcasts BatchNorm's buffers: a replay of the wrapper on one rank
    alone would wait forever. The replay runs the wrapped module instead."""
    ranks = run_ranks(tmp_path, policy="log", bad="input_nan", steps=4, batchnorm=True)
    first = ranks[BAD_RANK].origins[0]
    assert (first.step, first.phase, first.module, first.tensor) == (
        BAD_STEP,
        "input",
        "",
        "args[0]",
    )
    assert first.stats is not None
    assert first.stats.nan_count == 1
    assert not any(e.is_origin for e in ranks[0].events)


def test_a_guard_attached_before_the_process_group_learns_its_rank(tmp_path: Path) -> None:
    ranks = run_ranks(tmp_path, policy="log", bad="log_neg", steps=4, early=True)
    for r in ranks:
        assert r.events
        assert {e.rank for e in r.events} == {r.rank}
        written = nanguard.read_events(tmp_path / f"events.{r.rank}.jsonl")
        assert [e.to_dict() for e in written] == [e.to_dict() for e in r.events]
    first = ranks[BAD_RANK].origins[0]
    assert (first.phase, first.module, first.rank) == ("forward", "log", BAD_RANK)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_fsdp2_rank0_gets_the_reduce_scattered_nan_without_crashing(
    tmp_path: Path, mode: str
) -> None:
    """FSDP2's gradients are DTensors reduce-scattered inside the backward: nanguard reads
    each rank's shard (a whole DTensor read runs collectives only one rank would join), and
    rank 0, whose own backward was finite, is told the NaN came from another rank."""
    ranks = run_ranks(tmp_path, policy="skip_step", bad="log_neg", steps=4, fsdp=True, mode=mode)
    origin = ranks[BAD_RANK].origins[0]
    # (A sharded model is not replayed: sentinel mode can name only the model.)
    inside = "log" if mode == "full" else ""
    assert (origin.step, origin.phase, origin.module) == (BAD_STEP, "forward", inside)
    if mode == "sentinel":
        assert "a replay on one rank alone would wait for the other ranks" in origin.message
        assert 'mode="full" probes every module in the step itself, and names it' in (
            origin.message
        )
    assert not ranks[0].origins
    shards = [e for e in ranks[0].events if e.details.get("sharded")]
    assert len(shards) == 1
    assert (shards[0].step, shards[0].phase, shards[0].kind) == (BAD_STEP, "grad", "nan")
    assert "reduce-scattered" in shards[0].message
    assert "another rank" in shards[0].message
    # Statistics of this rank's shard: half the rows of fc1's (16, 8) weight.
    assert shards[0].param == "fc1.weight"
    assert shards[0].stats is not None
    assert (shards[0].stats.shape, shards[0].stats.numel) == ((8, 8), 64)
    for r in ranks:  # the same step skipped on both ranks, the weights still finite
        assert [e.step for e in r.events if e.details.get("skipped")] == [BAD_STEP]
        assert r.params_finite
        assert r.current_step == 4


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_forward_with_a_collective_is_not_replayed_on_one_rank(tmp_path: Path, mode: str) -> None:
    """Rank 1's NaN reaches rank 0 through an all_gather inside the forward. Rank 0's replay
    must not issue that all_gather alone (it would wait for rank 1 until the process group's
    timeout): it is refused, and the event says the NaN may come from another rank."""
    ranks = run_ranks(tmp_path, policy="skip_step", bad="log_neg", steps=4, gather=True, mode=mode)
    origin = ranks[BAD_RANK].origins[0]
    assert (origin.step, origin.phase) == (BAD_STEP, "forward")
    if mode == "full":
        assert origin.module == "module.log"
    rank0 = ranks[0].at(BAD_STEP)
    assert any("runs a collective (c10d." in e.message for e in rank0)
    assert any("another rank" in e.message for e in rank0)
    for r in ranks:
        skipped = [e for e in r.events if e.details.get("skipped")]
        assert [e.step for e in skipped] == [BAD_STEP]
        assert skipped[0].message.startswith(f"nanguard: step {BAD_STEP} (rank {r.rank}): ")
        assert r.params_finite
        assert r.current_step == 4


def test_a_loss_over_gathered_outputs_points_at_the_other_ranks(tmp_path: Path) -> None:
    """Rank 0's loss gathers every rank's outputs: rank 1's NaN arrives there, so rank 0's
    loss is non-finite from finite outputs; its event says where to look first."""
    ranks = run_ranks(tmp_path, policy="skip_step", bad="log_neg", steps=4, gather_loss=True)
    assert ranks[BAD_RANK].origins[0].module == "module.log"
    loss = next(e for e in ranks[0].at(BAD_STEP) if e.phase == "loss")
    assert "if the loss gathers tensors from every rank" in loss.message
    assert "if another rank reports an origin in this step, look there first" in loss.message


def test_fsdp2_weights_the_nan_corrupted_are_no_new_origin_in_sentinel_mode(
    tmp_path: Path,
) -> None:
    """Policy "log" lets the NaN gradients into the sharded weights; the next steps' NaN
    outputs come from those weights (the sentinel step cannot be replayed on one rank, so
    only the weights tell), not from a new origin."""
    ranks = run_ranks(tmp_path, policy="log", bad="log_neg", steps=4, fsdp=True, mode="sentinel")
    assert [e.step for e in ranks[BAD_RANK].origins] == [BAD_STEP]
    assert ranks[0].origins == []
    assert any(e.phase == "param" for e in ranks[0].events)  # the weights the update broke


def test_gradscaler_skips_count_on_every_rank_so_all_stop_in_the_same_step(
    tmp_path: Path,
) -> None:
    """GradScaler skips a step on every rank (the all-reduced gradients hold rank 1's NaN),
    but only rank 1 knows it was a real origin: they agree, and max_consecutive_skips stops
    both ranks in the same step (rank 0 waited alone in the next all-reduce)."""
    ranks = run_ranks(
        tmp_path,
        policy="skip_step",
        bad="log_neg",
        bad_steps=(1, 2, 3),
        scaler=True,
        max_skips=2,
    )
    assert [r.stopped["step"] if r.stopped else None for r in ranks] == [2, 2]
    assert "2 optimizer steps in a row were skipped" in ranks[0].stopped_event.message
    # Rank 0 found no origin of its own: its error says the origin is another rank's.
    assert "; none on this rank, another rank's origin (its own log names it): " in (
        ranks[0].stopped_event.message
    )
    assert "; the last origin: " in ranks[BAD_RANK].stopped_event.message
    for r in ranks:
        assert [e.step for e in r.events if e.details.get("skipped")] == [1, 2]
        assert r.params_finite
    assert ranks[0].checksum == ranks[1].checksum


def test_raise_with_a_gradscaler_stops_every_rank_in_the_same_step(tmp_path: Path) -> None:
    """GradScaler skips the step on every rank (the all-reduced gradients hold rank 1's
    NaN), and to rank 0 it looks like an expected overflow: under "raise" the ranks agree,
    so rank 0 raises too rather than run on and wait for rank 1 in the next all-reduce
    (a loop that stops on the error would hang until the process group's timeout)."""
    ranks = run_ranks(tmp_path, policy="raise", bad="log_neg", scaler=True, steps=5)
    assert [r.stopped["step"] if r.stopped else None for r in ranks] == [BAD_STEP, BAD_STEP]
    stopped = ranks[BAD_RANK].stopped_event
    assert stopped is not None
    assert stopped.is_origin
    on_rank0 = ranks[0].stopped_event
    assert on_rank0 is not None
    assert not on_rank0.is_origin
    assert on_rank0.details["reason"] == "other_rank"
    for r in ranks:
        assert r.params_finite
    assert ranks[0].checksum == ranks[1].checksum


def test_fsdp2_a_backward_origin_on_one_rank_is_named_there(tmp_path: Path) -> None:
    """A sharded model is never replayed: its backward is probed module by module instead,
    so the rank whose sqrt made Inf names it, and the other rank is told it came in."""
    ranks = run_ranks(tmp_path, policy="skip_step", bad="zero", sqrt=True, steps=4, fsdp=True)
    origins = ranks[BAD_RANK].origins
    assert [(o.step, o.phase, o.module) for o in origins] == [(BAD_STEP, "backward", "sq")]
    assert not ranks[0].origins
    shards = [e for e in ranks[0].events if e.details.get("sharded")]
    assert [e.step for e in shards] == [BAD_STEP]
    for r in ranks:
        assert r.params_finite


@pytest.mark.parametrize("bad", ["input_nan", "zero"])
def test_ddp_with_probed_backward_gives_the_other_rank_an_allreduce_event(
    tmp_path: Path, bad: str
) -> None:
    """backward="probes": rank 0's every module gradient was finite, its parameters' were
    not (DDP's all-reduce): no origin there, one "allreduce" event."""
    ranks = run_ranks(
        tmp_path, policy="log", bad=bad, sqrt=True, steps=3, backward="probes", inner=True
    )
    expected = ("input", "") if bad == "input_nan" else ("backward", "sq")
    assert [(o.phase, o.module) for o in ranks[BAD_RANK].origins[:1]] == [expected]
    assert not [o for o in ranks[0].origins if o.step == BAD_STEP]
    spread = [e for e in ranks[0].at(BAD_STEP) if e.details.get("reason") == "allreduce"]
    assert len(spread) == 1
    assert "every module's gradient was probed" in spread[0].message


def test_fsdp1_weights_its_flat_parameter_spread_nan_to_are_no_new_origins(
    tmp_path: Path,
) -> None:
    """Under "log" the NaN gradients reach FSDP1's flat parameter, which holds every
    module's weights: the later forwards that use it are not new origins."""
    ranks = run_ranks(tmp_path, policy="log", bad="log_neg", steps=4, fsdp1=True)
    origins = ranks[BAD_RANK].origins
    assert [(o.step, o.phase) for o in origins] == [(BAD_STEP, "forward")]
    assert origins[0].module.endswith("log")
    assert not [o for r in ranks for o in r.origins if o.step > BAD_STEP]


def test_fsdp1_watched_inside_its_wrapper_is_not_replayed_on_one_rank(tmp_path: Path) -> None:
    """watch(fsdp.module): its weights are views of the flat parameter FSDP gathers and
    frees. A replay on one rank failed on freed storage, and the rank that only received
    the NaN through the reduce-scatter claimed a backward origin of its own."""
    ranks = run_ranks(tmp_path, policy="skip_step", bad="log_neg", steps=4, fsdp1=True, inner=True)
    origins = ranks[BAD_RANK].origins
    assert [(o.step, o.phase, o.module) for o in origins] == [(BAD_STEP, "forward", "log")]
    assert ranks[0].origins == []
    for r in ranks:
        assert not any("setStorage" in e.message for e in r.events)
