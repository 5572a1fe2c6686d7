"""torch.compile: no graph break added by nanguard, origins found by an eager replay."""

from __future__ import annotations

import pytest
import torch
from realistic import LogFeatures, MaskedAttention, PairwiseDistances, log_mlp, one_masked_sample
from torch import nn

import nanguard

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402


def compiled_step(model: nn.Module, x: torch.Tensor, backend: str, guard: bool):
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = nanguard.watch(compiled, optimizer=opt, on_nonfinite="log") if guard else None
    try:
        out = compiled(x)
        out.float().pow(2).mean().backward()
        opt.step()
    finally:
        if g is not None:
            g.detach()
    return g, dict(counters["graph_break"])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_reports_the_origin_without_graph_breaks(backend: str) -> None:
    x = torch.randn(16, 784)
    _, breaks_plain = compiled_step(log_mlp(), x, backend, guard=False)
    guard, breaks_guarded = compiled_step(log_mlp(), x, backend, guard=True)
    assert breaks_guarded == breaks_plain == {}
    assert guard is not None
    origin = guard.origin
    assert origin is not None
    # Named as in the original model (no "_orig_mod." prefix), found by an eager replay.
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "1", "LogFeatures")
    assert origin.op == "aten.log.default"
    assert origin.stats is not None
    assert origin.stats.nan_count > 0


def test_compiled_backward_origin() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1))
    guard, breaks = compiled_step(model, torch.randn(6, 8), "aot_eager", guard=True)
    assert breaks == {}
    assert guard is not None
    assert guard.origin is not None
    assert (guard.origin.phase, guard.origin.module) == ("backward", "1")


def test_clean_compiled_training_is_quiet() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(compiled, optimizer=opt) as guard:
        for _ in range(5):
            loss = compiled(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []


def test_hooks_of_a_watched_model_stand_aside_when_it_is_compiled_later() -> None:
    # Watching the original and compiling afterwards: the hooks run inside the compiled
    # region, where they do nothing (no graph break); gradients are still checked.
    model = nn.Sequential(nn.Linear(8, 8), LogFeatures(), nn.Linear(8, 1))
    dynamo.reset()
    counters.clear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        compiled = torch.compile(model, backend="aot_eager")
        compiled(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert dict(counters["graph_break"]) == {}
    assert guard.origin is not None
    assert guard.origin.phase == "grad"


def test_a_loss_after_an_unwatched_compiled_forward_is_not_called_the_culprit() -> None:
    # Compiled after watch(): no forward is recorded, so nanguard cannot say the model's
    # outputs were finite; it must not send the user to the loss function alone.
    model = nn.Sequential(nn.Linear(8, 8), LogFeatures(), nn.Linear(8, 1))
    dynamo.reset()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        compiled = torch.compile(model, backend="aot_eager")
        guard.check_loss(compiled(torch.randn(4, 8)).pow(2).mean()).backward()
        opt.step()
    loss = next(e for e in guard.events if e.phase == "loss")
    assert "no forward of the watched model was recorded" in loss.message
    assert "a torch.compile wrapper made after watch() (watch the compiled model)" in loss.message
    assert "outputs were finite" not in loss.message


def test_a_loss_after_a_recorded_no_grad_forward_is_compared_with_its_outputs() -> None:
    # The no_grad forward is resolved on its own at once; the loss comes later, in the same
    # step: the outputs were seen, and finite.
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        with torch.no_grad():
            out = model(torch.randn(4, 8))
        guard.check_loss(torch.log(out.abs() * 0).mean())
        guard.step()
    loss = next(e for e in guard.events if e.phase == "loss")
    assert "outputs were finite" in loss.message
    assert "no forward of the watched model was recorded" not in loss.message


class AttentionBlock(nn.Module):
    """A pre-norm Transformer block with hand-written masked attention (padding mask)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = MaskedAttention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x), keep)
        return x + self.mlp(x)


class BlockStack(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AttentionBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, keep)
        return self.head(x).mean(dim=(1, 2))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """Training steps of a block stack; step 1's batch holds a sample that is all padding."""
    for step in range(steps):
        x, keep = one_masked_sample()
        if step != 1:
            keep[1] = True
        opt.zero_grad()
        model(x, keep).pow(2).mean().backward()
        opt.step()


def train_compiled_blocks(mode: str, fullgraph: bool) -> tuple[nanguard.Guard, dict]:
    """Each block compiled on its own (as per-block compilation of large models does); a
    batch at step 1 holds a sample whose every position is padding."""
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = BlockStack()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=fullgraph)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="skip_step") as guard:
        train_steps(model, opt, 4)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return guard, dict(counters["graph_break"])


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_compiled_blocks_name_the_module_inside_and_keep_compiling(mode: str) -> None:
    guard, breaks = train_compiled_blocks(mode, fullgraph=True)  # (any graph break raises)
    assert breaks == {}
    origin = guard.origin
    assert origin is not None
    # The attention inside the first compiled block, named as the eager model names it.
    assert (origin.step, origin.phase, origin.module) == (1, "forward", "blocks.0.attn")
    assert origin.module_type == "MaskedAttention"
    assert origin.op == "aten._softmax.default"
    names = {e.module for e in guard.events} | {e.param for e in guard.events}
    assert not any("_orig_mod" in (n or "") for n in names)
    assert "OptimizedModule" not in {e.module_type for e in guard.events}
    assert len([e for e in guard.events if e.is_origin]) == 1  # steps 2-3 ran, compiled


@pytest.mark.parametrize(
    "where", ["model", "model after watch", "blocks", "blocks after watch", "wrapped after watch"]
)
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_modules_compiled_in_place_are_replayed_eagerly(where: str, mode: str) -> None:
    # module.compile() compiles the module's call with its hooks inside, where they stand
    # aside: the model's own hooks run around the compiled call instead.
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = BlockStack()
    if where == "model":
        model.compile(backend="aot_eager")
    elif where == "blocks":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    compiled = model._compiled_call_impl
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        if where == "model after watch":
            model.compile(backend="aot_eager")
            compiled = model._compiled_call_impl
        elif where == "blocks after watch":  # (the parent's own code is not the origin)
            for block in model.blocks:
                block.compile(backend="aot_eager")
        elif where == "wrapped after watch":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block, backend="aot_eager")
        train_steps(model, opt, 3)
    assert dict(counters["graph_break"]) == {}
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (1, "forward", "blocks.0.attn")
    assert origin.op == "aten._softmax.default"
    assert model._compiled_call_impl is compiled  # put back as it was at detach


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_identical_blocks_compiled_one_by_one_share_their_graph(mode: str) -> None:
    # torchtitan's per-block compile: twelve identical blocks share one compiled graph.
    # Per-module hooks must not make each block recompile (the limit is 8: fullgraph=True
    # then raises, and without it the later blocks silently run eagerly).
    def compiled_graphs(guarded: bool) -> int:
        dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = BlockStack(depth=12)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, keep = one_masked_sample()
        keep[1] = True
        guard = nanguard.watch(model, optimizer=opt, mode=mode) if guarded else None
        try:
            for _ in range(2):
                opt.zero_grad()
                model(x, keep).pow(2).mean().backward()
                opt.step()
        finally:
            if guard is not None:
                guard.detach()
        return int(counters["stats"]["unique_graphs"])

    assert compiled_graphs(guarded=True) == compiled_graphs(guarded=False)


@pytest.mark.parametrize("name", ["blocks.0.attn", "blocks.0._orig_mod.attn"])
def test_a_module_inside_a_compiled_block_is_excluded_by_either_name(name: str) -> None:
    # Events name it without "_orig_mod"; named_modules() gives it with: both exclude it.
    dynamo.reset()
    torch.manual_seed(0)
    model = BlockStack()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, keep = one_masked_sample()
    with nanguard.watch(model, optimizer=opt, exclude=[name], on_nonfinite="log") as guard:
        model(x, keep).pow(2).mean().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.module == "blocks.0"  # its excluded attention ran inside the block's code
    hooked = [e for e in guard.events if e.phase in ("forward", "backward")]
    assert not any((e.module or "").startswith("blocks.0.attn") for e in hooked)


@pytest.mark.parametrize("on_nonfinite", ["log", "skip_step"])
def test_a_compiled_optimizer_step_runs_the_guards_hooks_eagerly(on_nonfinite: str) -> None:
    """torch.compile's recipe for a faster optimizer step: the guard's step hooks (which
    read the host and take locks) run outside the traced graph."""
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    @torch.compile(backend="aot_eager")
    def opt_step() -> None:
        opt.step()

    with nanguard.watch(model, optimizer=opt, on_nonfinite=on_nonfinite) as guard:
        for step in range(5):
            x = torch.randn(8, 8)
            if step == 3:
                x[2, 1] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt_step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (3, "input")
    if on_nonfinite == "skip_step":
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert counters["stats"]["unique_graphs"] <= 4


def test_check_loss_inside_a_fullgraph_compiled_function_adds_no_graph_break() -> None:
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt) as guard:

        @torch.compile(backend="aot_eager", fullgraph=True)
        def compute_loss(x: torch.Tensor) -> torch.Tensor:
            return guard.check_loss(model(x).pow(2).mean())

        for _ in range(3):
            opt.zero_grad()
            compute_loss(torch.randn(8, 8)).backward()
            opt.step()
    assert dict(counters["graph_break"]) == {}
    assert guard.origin is None


def test_a_watched_compile_wrapper_is_named_by_its_models_class() -> None:
    dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(compiled, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(4):
            x = torch.randn(8, 8)
            if step == 1:
                x[0, 0] = float("nan")  # a NaN batch: the weights are NaN after it ("log")
            opt.zero_grad()
            compiled(x).pow(2).mean().backward()
            opt.step()
    assert guard.origin is not None
    types = {e.module_type for e in guard.events}
    assert "OptimizedModule" not in types
    assert "OptimizedModule" not in " ".join(e.message for e in guard.events)


@pytest.mark.filterwarnings("ignore:nanguard. step 0 ends without a recorded call")
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_compiled_train_step_calling_the_model_is_said_to_hide_it(where: str) -> None:
    # torch.compile(lambda x: loss(model(x))): the model's hooks stand aside in the compiled
    # function. The messages blamed "gradients crossing the boundary were finite" and
    # custom autograd Functions, or offered "watch the compiled model" (there is none).
    torch.manual_seed(0)
    dynamo.reset()
    if where == "forward":
        model = nn.Sequential(nn.Linear(8, 16), LogFeatures(), nn.Linear(16, 1))
    else:
        model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = torch.compile(lambda x: model(x).pow(2).mean(), backend="aot_eager")
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = step(torch.randn(6, 8))
        guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    if where == "forward":
        assert origin.phase == "loss"
        assert "a compiled function that calls the model, a compiled train step" in (origin.message)
    else:
        assert origin.phase == "grad"
        assert "no forward of the model was recorded in this step" in origin.message
        assert "or compile the model itself" in origin.message
        assert "Check custom autograd Functions" not in origin.message


class _NormBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))  # type: ignore[no-any-return]


def _regional_graphs(**options: object) -> int:
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    blocks = nn.Sequential(*(_NormBlock() for _ in range(4)))
    for block in blocks:
        block.compile(backend="aot_eager")  # regional compilation
    model = nn.Sequential(blocks, nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nanguard.watch(model, optimizer=opt, **options) if options else None  # type: ignore[arg-type]
    try:
        for _ in range(9):
            loss = model(torch.randn(4, 8, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if guard is not None:
            assert guard.events == []
            guard.detach()
    return int(counters["stats"]["unique_graphs"])


def test_full_checks_every_n_steps_do_not_recompile_compiled_blocks() -> None:
    # The per-module hooks went on for full steps and off for the others: dynamo guards on
    # them, so every compiled block was compiled again for each variant.
    plain = _regional_graphs()
    assert _regional_graphs(mode="full", every=4) == plain
    assert _regional_graphs(mode="sentinel") == plain


class CompiledPathOnly(nn.Module):
    """Takes a square root at a value compiled code computes below 0 and eager code does not
    (as inductor's reduction order can for a variance of a constant row): simulated with
    torch.compiler.is_compiling()."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        shift = 1e-3 if torch.compiler.is_compiling() else -1e-3
        return self.head(h * torch.sqrt(h.var(-1, keepdim=True) * 0 - shift))


def test_a_value_only_compiled_code_makes_is_told_as_such_not_as_a_hardware_fault() -> None:
    torch.manual_seed(0)
    model = CompiledPathOnly()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(compiled, optimizer=opt, on_nonfinite="log") as guard:
        loss = guard.check_loss(compiled(torch.randn(4, 8)).pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.reproducible is False
    assert origin.hint is not None
    assert "torch.compile'd code" in origin.hint
    assert "aot_eager" in origin.hint
    assert "hardware fault" not in origin.message
