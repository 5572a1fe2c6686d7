"""User extensions of PyTorch around a watched model: torch.func ensembles, custom ops,
tensor subclasses, and the user's own hooks."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

import nanguard


def line_of(obj: Callable[..., object] | type, code: str) -> str:
    """``file:line`` of the line of ``obj``'s source holding ``code``."""
    lines, start = inspect.getsourcelines(obj)
    offset = next(i for i, line in enumerate(lines) if code in line)
    return f"{inspect.getsourcefile(obj)}:{start + offset}"


class _Member(nn.Module):
    """One member of an ensemble: normalised features (0/0 on an all-zero padded row)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 16, bias=False)
        self.l2 = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        h = h / h.norm(dim=-1, keepdim=True)
        return self.l2(h)


class _Ensemble(nn.Module):
    """torch.func's model-ensembling recipe: stacked weights, one template run under vmap."""

    def __init__(self, template: str, k: int = 4) -> None:
        super().__init__()
        members = [_Member() for _ in range(k)]
        params, _ = stack_module_state(members)  # type: ignore[arg-type]
        self.names = list(params)
        self.params = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        # The tutorial's stateless template on the meta device, or a real one.
        self.base = copy.deepcopy(members[0]).to("meta") if template == "meta" else members[0]

    def forward(self, x: Tensor) -> Tensor:
        params = dict(zip(self.names, self.params, strict=True))

        def one(p: dict[str, Tensor], xx: Tensor) -> Tensor:
            return functional_call(self.base, p, (xx,))  # type: ignore[no-any-return]

        return vmap(one, in_dims=(0, None))(params, x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("template", ["meta", "real"])
def test_a_vmap_ensemble_is_watched_and_its_members_line_is_named(template: str, mode: str) -> None:
    # watch() read the meta template's parameters (a crash: "Cannot copy out of meta
    # tensor"), and with a real template the operation was looked for in the template's own
    # calls, which run inside vmap unprobed: no op, no line, "Look at" the wrong forward.
    def train(x: Tensor, guarded: bool) -> tuple[nn.Module, nanguard.Guard | None]:
        torch.manual_seed(0)
        model = _Ensemble(template)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log")
        if not guarded:
            guard.detach()
        try:
            for _ in range(3):
                loss = ((model(x) - 1) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        finally:
            if guard.attached:
                guard.detach()
        return model, guard if guarded else None

    torch.manual_seed(1)
    x = torch.randn(32, 6)
    model, guard = train(x, guarded=True)
    plain, _ = train(x, guarded=False)
    assert guard is not None
    assert guard.events == []
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        if not a.is_meta:
            assert torch.equal(a, b)

    x[3] = 0.0  # a padded row
    _, guard = train(x, guarded=True)
    assert guard is not None
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.kind, origin.op) == (
        0,
        "forward",
        "nan",
        "aten.div.Tensor",
    )
    assert origin.source is not None
    assert origin.source.startswith(line_of(_Member.forward, "h = h / h.norm"))
    assert origin.reproducible is True
    assert origin.hint is not None
    assert "divided by zero" in origin.hint


class _Tagged(torch.Tensor):
    """A batch carrying metadata through every operation (MONAI's MetaTensor, simplified)."""

    meta: dict[str, object]

    @staticmethod
    def __new__(cls, x: Tensor, meta: dict[str, object]) -> _Tagged:
        t = torch.Tensor._make_subclass(cls, x, x.requires_grad)
        t.meta = dict(meta)
        return t

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., object],
        types: tuple[type, ...],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, _Tagged):
            out.meta = next((a.meta for a in args if isinstance(a, _Tagged)), {})
        return out


class _SignalNet(nn.Module):
    """Features of a 2-channel signal and its log intensity (-Inf for a blank channel)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 8, 3, padding=1)
        self.head = nn.Linear(10, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.conv(x)).mean(-1)
        intensity = torch.log(x.abs().mean(-1))
        return self.head(torch.cat([h, intensity], -1))  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_source_of_an_operation_on_a_subclass_batch_is_the_models_line(mode: str) -> None:
    # The subclass's __torch_function__ runs every operation on the batch: its line was
    # named as the source of the log(0), for every origin found with such a batch.
    torch.manual_seed(0)
    model = _SignalNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(16, 2, 20)
    x[4, 1] = 0.0  # a blank channel
    batch = _Tagged(x, {"spacing": (1.0,)})
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        out = model(batch).as_subclass(torch.Tensor)
        loss = ((out - 1) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind, origin.op) == (
        "forward",
        "",
        "inf",
        "aten.log.default",
    )
    assert origin.source is not None
    assert origin.source.startswith(line_of(_SignalNet.forward, "torch.log(x.abs()"))


@torch.library.custom_op("nanguard_tests::vector_norm", mutates_args=())
def _vector_norm(x: Tensor) -> Tensor:
    """Norms of 3-D vector features (an equivariant network's), backward written by hand."""
    return x.pow(2).sum(-1).sqrt()


@_vector_norm.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[:-1])


def _vector_norm_setup(ctx: object, inputs: tuple[Tensor], output: Tensor) -> None:
    ctx.save_for_backward(inputs[0], output)  # type: ignore[attr-defined]


def _vector_norm_backward(ctx: object, grad: Tensor) -> Tensor:
    x, norm = ctx.saved_tensors  # type: ignore[attr-defined]
    return grad[..., None] * x / norm[..., None]  # type: ignore[no-any-return]


_vector_norm.register_autograd(_vector_norm_backward, setup_context=_vector_norm_setup)


@torch.library.custom_op("nanguard_tests::log_pool", mutates_args=())
def _log_pool(x: Tensor, weight: Tensor) -> Tensor:
    """The log of a gated sum over a sequence: log(0) for a fully padded one."""
    return torch.log((x * weight).sum(-1))


@_log_pool.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[:-1])


class _VectorNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 1)

    def forward(self, v: Tensor) -> Tensor:  # v: (batch, 4 channels, 3), a masked atom is 0
        h = self.mix(v.transpose(1, 2)).transpose(1, 2)
        return self.head(_vector_norm(h))  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_custom_ops_registered_backward_is_named_with_its_line(mode: str) -> None:
    # The backward given to register_autograd runs inside torch's generated Function: it was
    # taken for torch's own, so the source was the forward's call and the hint unknown.
    torch.manual_seed(0)
    model = _VectorNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    v = torch.randn(16, 4, 3)
    v[5] = 0.0  # a masked atom: a zero vector, whose norm's slope is 0/0
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = ((model(v) - 1) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("backward", "nan")
    assert origin.op is not None
    assert origin.op.startswith("aten.div.Tensor in GeneratedBackwardFor_")
    assert origin.source is not None
    assert origin.source.startswith(line_of(_vector_norm_backward, "grad[..., None] * x"))
    assert origin.hint is not None
    assert origin.hint.startswith(
        "In the backward given to register_autograd for nanguard_tests_vector_norm_default "
        "(a torch.library custom op), aten.div.Tensor divided by zero"
    )
    assert "the backward given to register_autograd" in origin.message


class _LogPoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 1)
        self.weight = nn.Parameter(torch.rand(10) + 0.1)
        self.head = nn.Linear(1, 1)

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, 10 steps, 8), padded steps all 0
        gate = torch.sigmoid(self.enc(x)).squeeze(-1) * (x.abs().sum(-1) > 0)
        return self.head(_log_pool(gate, self.weight)[:, None])  # type: ignore[no-any-return]


def test_a_custom_ops_own_body_is_said_to_be_opaque() -> None:
    torch.manual_seed(0)
    model = _LogPoolNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 10, 8)
    x[2] = 0.0  # a fully padded sequence: log(0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard, torch.no_grad():
        model(x)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "inf")
    assert origin.op == "nanguard_tests.log_pool.default"
    assert origin.hint is not None
    assert origin.hint.startswith(
        "nanguard_tests.log_pool.default is not one of torch's operations (a custom op, or an "
        "extension's kernel): nanguard cannot look inside it. It made -Inf from finite inputs"
    )


class _ScaledBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc2(torch.relu(self.fc1(self.ln(x))))
        scale = torch.sqrt(h.mean(-1, keepdim=True))  # NaN where the mean is negative
        return x + h * scale


class _BlockNet(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Linear(16, d)
        self.blocks = nn.ModuleList([_ScaledBlock(d) for _ in range(3)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_symbolically_traced_model_names_the_line_of_its_traced_code(mode: str) -> None:
    # fx inlines the blocks' own code into the GraphModule's generated forward: that code
    # (in linecache as <eval_with_key>) was skipped, so no source was given at all.
    torch.manual_seed(0)
    model = torch.fx.symbolic_trace(_BlockNet())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = ((model(torch.randn(32, 16)) - torch.randn(32, 1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "", "aten.sqrt.default")
    assert origin.tensor == "args[0] of blocks.1.ln"
    assert origin.source is not None
    assert origin.source.startswith("<eval_with_key>")
    assert origin.source.endswith(" of the traced code: sqrt = torch.sqrt(mean)")


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.l2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.l2(self.act(self.l1(x))))  # type: ignore[no-any-return]


def _normalise_rows(module: nn.Module, grad_in: tuple[Tensor, ...], grad_out: object) -> object:
    return (grad_in[0] / grad_in[0].norm(dim=-1, keepdim=True),)  # 0/0 at a zero row


def _normalise(grad: Tensor) -> Tensor:
    return grad / grad.abs().max()  # 0/0 for an all-zero gradient


def _weighted_step(guard: nanguard.Guard, model: nn.Module, weight: Tensor) -> None:
    opt = guard.options.optimizer
    assert opt is not None
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    loss = ((model(x) - y) ** 2 * weight).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("before", [True, False])
def test_a_modules_backward_hook_that_makes_nan_is_named(before: bool, mode: str) -> None:
    # Per-row gradient normalisation in a full backward hook; a padding sample (loss weight
    # 0) has a zero row. It was laid on Net.forward's own code, "pattern not recognised".
    torch.manual_seed(0)
    model = _Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    if before:
        model.l2.register_full_backward_hook(_normalise_rows)
    guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log")
    if not before:
        model.l2.register_full_backward_hook(_normalise_rows)
    weight = torch.ones(16, 1)
    weight[4] = 0.0
    try:
        _weighted_step(guard, model, weight)
    finally:
        guard.detach()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("backward", "l2", "nan")
    assert origin.op == "aten.div.Tensor in BackwardHookFunctionBackward"
    assert origin.source is not None
    assert origin.source.startswith(line_of(_normalise_rows, "grad_in[0] / grad_in[0]"))
    assert origin.hint is not None
    assert origin.hint.startswith(
        "In a module's backward hook (register_full_backward_hook), aten.div.Tensor divided by zero"
    )
    assert "look at a module's backward hook (register_full_backward_hook)" in origin.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_hook_on_a_parameters_gradient_that_makes_nan_is_named(mode: str) -> None:
    # Gradient normalisation by the largest entry, no eps, on an all-padding micro-batch:
    # the message said "Look at Linear.forward", with no line and no hint.
    torch.manual_seed(0)
    model = _Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log")
    model.l2.weight.register_hook(_normalise)
    try:
        _weighted_step(guard, model, torch.zeros(16, 1))
    finally:
        guard.detach()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.param) == ("backward", "l2", "l2.weight")
    assert origin.op == "aten.div.Tensor in torch::autograd::AccumulateGrad"
    assert origin.source is not None
    assert origin.source.startswith(line_of(_normalise, "grad / grad.abs().max()"))
    assert origin.hint is not None
    assert origin.hint.startswith("In a hook on a parameter's gradient (Tensor.register_hook)")
    assert "Look at Linear.forward" not in origin.message


def _standardise(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
    return (out - out.mean(0)) / out.std(0)  # NaN for a batch of identical rows


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_forward_hook_registered_after_watch_is_the_modules_own(mode: str) -> None:
    # It ran after nanguard's hook: full mode checked l2's output before the hook rewrote
    # it, and blamed the model's own code between l2 and head (sentinel named l2).
    torch.manual_seed(0)
    model = _Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        model.l2.register_forward_hook(_standardise)
        x = torch.randn(1, 8).expand(16, 8)  # one sample repeated: a std of 0
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("forward", "l2", "output")
    assert origin.op == "aten.div.Tensor"
    assert origin.source is not None
    assert origin.source.startswith(line_of(_standardise, "out.std(0)"))


class _AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 3)
        self.dec = nn.Linear(3, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.dec(torch.tanh(self.enc(x)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_jacobian_term_built_with_torch_func_is_named_for_nan_gradients(mode: str) -> None:
    # A contractive autoencoder's penalty, the Frobenius norm of the encoder's Jacobian per
    # sample (vmap(jacrev)): an outlier saturates tanh, its Jacobian is 0, sqrt's slope is
    # infinite. Full mode said "the output gradients were not kept", sentinel mode
    # "something wrote .grad after autograd": neither named the Jacobian term.
    from torch.func import jacrev

    torch.manual_seed(0)
    model = _AutoEncoder()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(16, 6)
    x[3] *= 200.0

    def encode(sample: Tensor) -> Tensor:
        return torch.tanh(model.enc(sample))

    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        out = model(x)
        jacobians = vmap(jacrev(encode))(x)
        penalty = jacobians.pow(2).sum((1, 2)).sqrt().mean()
        loss = ((out - x) ** 2).mean() + 0.1 * penalty
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("grad", "enc.weight")
    if mode == "full":
        assert origin.details["reason"] == "double_backward"
        assert "inside torch.func transforms (jacrev, vmap, grad" in origin.message
        assert "were not kept" not in origin.message
        assert origin.hint is not None
        assert "norm of a Jacobian (torch.func)" in origin.hint
    else:  # (the encoder's own calls are not watched in sentinel mode)
        assert "a torch.func Jacobian of the encoder" in origin.message
        assert "mode='full' tells" in origin.message


class _PlainBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))  # type: ignore[no-any-return]


def test_an_exported_model_names_the_line_of_its_graph_not_exports_hooks() -> None:
    # torch.export's module() runs one flat graph: only the model can be named. It was
    # sent to export's input-checking pre-hooks, which compute nothing.
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 64), _PlainBlock(64), _PlainBlock(64), _PlainBlock(64), nn.Linear(64, 1)
    )
    exported = torch.export.export(net, (torch.randn(32, 16),)).module()
    opt = torch.optim.SGD(exported.parameters(), lr=1e-2)
    with torch.no_grad():
        exported.get_submodule("2.fc2").weight.mul_(1e38)  # blown up by an update
    with nanguard.watch(exported, optimizer=opt, on_nonfinite="log") as guard:
        loss = ((exported(torch.randn(32, 16)) - torch.randn(32, 1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == (
        "forward",
        "",
        "aten.native_layer_norm.default",
    )
    assert origin.source is not None
    assert "3_ln_weight" in origin.source  # (the graph's line names the layer)
    assert "_check_input_constraints_pre_hook" not in origin.message
    assert "forward pre-hooks" not in origin.message
